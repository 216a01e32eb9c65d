"""benchmarks/gpu_check.sh end to end in its CPU mode (the dry run of the GPU check): every step
runs and writes its JSON; and the bundle it carries to an offline GPU machine fits the limit."""

from __future__ import annotations

import json
import subprocess
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "gpu_check.sh"


def _run(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


def test_cpu_dry_run_writes_every_result(tmp_path: Path) -> None:
    from forecache.build import installed_build_info

    if installed_build_info()["backend"] != "cpu":
        pytest.skip("the dry run is for CPU builds (it would replace this GPU build)")
    out = tmp_path / "out"
    res = _run("all", str(out), "--cpu")
    assert res.returncode == 0, res.stderr[-3000:]
    build = json.loads((out / "build.json").read_text())
    assert build["backend"] == "cpu" and build["patches"]
    doctor = json.loads((out / "doctor.json").read_text())
    assert doctor["build"]["backend"] == "cpu" and doctor["devices"]
    lossless = json.loads((out / "lossless.json").read_text())
    assert lossless["exit_code"] == 0 and lossless["failed"] == 0 and lossless["passed"] > 0
    bench = json.loads((out / "policy_bench.json").read_text())
    assert {r["policy"] for r in bench["results"]} == {
        "offload", "ncmoe", "lru", "static", "promoe", "promoe+spec", "promoe+little",
        "promoe+resident"}
    # the exact runs (speculation among them) agree; the little passes (lossy) are left out
    assert bench["same_tokens"] is True and bench["h2d_gbps"] is not None
    plans = json.loads((out / "batch_plans.json").read_text())
    assert {r["placement"] for r in plans["rows"]} == {"stock", "cache"}
    assert all(r["predicted_tps"] > 0 and r["measured_tps"] > 0 for r in plans["rows"])
    # the device tool returns at most 8 files: these, plus the CPU mode's small model
    assert sorted(p.name for p in out.iterdir()) == [
        "batch_plans.json", "build.json", "build.log", "doctor.json", "lossless.json",
        "lossless.log", "policy_bench.json", "tiny-q4_k_m.gguf"]


def test_usage_errors(tmp_path: Path) -> None:
    assert _run().returncode == 2
    assert _run("nonsense", str(tmp_path)).returncode == 2
    assert _run("test").returncode == 2  # no OUT


def test_bundle_fits_the_carry_limit() -> None:
    res = _run("bundle", timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    bundle = REPO / ".gpu-bundle"
    with tarfile.open(bundle / "llama-src.tar.xz") as tf:
        names = tf.getnames()
    assert "llama-src/vendor/llama.cpp/ggml/src/ggml-cuda/CMakeLists.txt" in names
    wheels = sorted(p.name.split("-")[0] for p in (bundle / "wheels").glob("*.whl"))
    assert wheels == ["diskcache", "gguf"]
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True,
                             check=True).stdout.split(b"\0")
    size = sum((REPO / n.decode()).stat().st_size for n in tracked if n and
               (REPO / n.decode()).is_file())
    size += sum(p.stat().st_size for p in bundle.rglob("*") if p.is_file())
    assert size < 60 << 20, f"{size / 2**20:.1f} MiB would travel"

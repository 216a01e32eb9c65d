"""benchmarks/gpu_check.sh in its CPU mode (the dry run of the GPU check): the one device call's
steps run on the tiny model and write every result the GPU run returns."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "gpu_check.sh"


def _run(*args: str, timeout: float = 1500, env: dict | None = None,
         ) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, env=env)


def test_cpu_dry_run_writes_every_result(tmp_path: Path) -> None:
    from forecache.build import installed_build_info

    if installed_build_info()["backend"] != "cpu":
        pytest.skip("the dry run is for CPU builds")
    out = tmp_path / "out"
    env = {**os.environ, "FORECACHE_GPU_CHECK_BUDGET": "1200"}
    # setup: the short first call (the build runs there, the model and the routings are made)
    res = _run("setup", str(out), "--cpu", env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == [
        "doctor.json", "run.log", "traces.json"]
    res = _run("run", str(out), "--cpu", env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "writing the tiny model" not in res.stderr  # setup's model is used
    # the device tool returns at most 8 files
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == [
        "bench_fit12.json", "bench_fit24.json", "bench_fixed.json", "bench_routings.json",
        "doctor.json", "lossless.json", "run.log", "traces.json"]
    doctor = json.loads((out / "doctor.json").read_text())
    assert doctor["build"]["backend"] == "cpu" and doctor["devices"]
    traces = json.loads((out / "traces.json").read_text())["traces"]
    # the three routings span what a cache sees: uniform > fitted to OLMoE > skewed
    ent = {n: t["load_entropy"] for n, t in traces.items()}
    assert ent["uniform"] > ent["olmoe-fit"] > ent["skewed"]
    fit = json.loads((out / "bench_fit24.json").read_text())
    assert {r["policy"] for r in fit["results"]} == {
        "all-gpu", "ncmoe", "ncmoe-mmap", "promoe", "promoe+bank", "infinity", "default"}
    # what a run without --policy gets, with its reason, from the chosen run of the same call
    chosen = next(r for r in fit["results"] if r["policy"] == "default")["chosen"]
    assert chosen["policy"] in ("promoe", "ncmoe") and chosen["reason"]
    banked = next(r for r in fit["results"] if r["policy"] == "promoe+bank")
    # (the dry run's budget holds the tiny model's every expert: nothing for banks to copy)
    assert "banked" in banked["hot_path"] and not fit["errors"]
    # a long prompt against stock at each ubatch size; promoe's ratio is over the best of them
    long = fit["prefill_4k"]
    assert long["prompt_len"] == 128 and not long["errors"]
    assert {r["policy"] for r in long["results"]} == {
        "ncmoe", "ncmoe@ub2048", "ncmoe@ub4096", "promoe", "promoe@ub2048"}
    best = min(r["ttft_s"] for r in long["results"] if r["policy"].startswith("ncmoe"))
    p4k = next(r for r in long["results"] if r["policy"] == "promoe")
    assert abs(p4k["ratios"]["ncmoe"]["ttft_speedup"] - best / p4k["ttft_s"]) < 1e-9
    assert fit["routing_trace"].endswith("olmoe-fit.npz") and fit["same_tokens"] is None
    promoe = next(r for r in fit["results"] if r["policy"] == "promoe")
    assert promoe["ratios"]["ncmoe"]["decode_speedup"] > 0
    assert set(promoe["hot_path"]["phases"]) == {"prefill", "decode"}  # host work by phase
    # promoe's timeline: every MoE layer's ids, gate and compute in prompt and decode passes,
    # or its quiet mark (the tiny model's experts all fit the dry run's budget)
    tl = fit["timeline_run"]["results"][0]["timeline"]
    assert set(tl["phases"]) == {"prefill", "decode"} and tl["dropped"] == 0
    for phase in tl["phases"].values():
        k = phase["kinds"]
        assert phase["passes"] > 0 and k["ids"]["n"] + k["quiet"]["n"] > 0
        assert k["gate"]["n"] == k["ids"]["n"]
        assert phase["host_overlap_s"] >= 0.0
    # speculation: stock's best and promoe with the same draft model, acceptance replayed; the
    # drafted runs' ratios over stock's best with and without the draft
    spec = fit["spec"]
    assert "0.70 a token" in spec["acceptance_replay"] and not spec["errors"]
    assert spec["draft_model"].endswith("tiny-draft-random-q4_k_m.gguf")
    runs = {r["policy"]: r for r in spec["results"]}
    assert set(runs) == {"ncmoe", "ncmoe+draft", "promoe+draft"}
    assert runs["promoe+draft"]["spec"]["verify_passes"] > 0
    assert {"ncmoe", "ncmoe+draft"} <= set(runs["promoe+draft"]["ratios"])
    # a batch job: stock's and forecache's plans, the same requests on the routing replayed
    batch = fit["batch"]
    assert batch["routing"].endswith("olmoe-fit.npz") and batch["requests"] == 6
    assert sorted(r["experts"] for r in batch["rows"]) == ["cache", "ncmoe"]
    assert all(r["failed"] == 0 and r["tokens"] > 0 for r in batch["rows"])
    assert batch["ratio"] > 0
    small = json.loads((out / "bench_fit12.json").read_text())
    assert {r["policy"] for r in small["results"]} == {"ncmoe", "ncmoe-mmap", "promoe",
                                                       "promoe+nostream", "default"}
    assert all("whole" in r["hot_path"] and "event_waits" in r["hot_path"]
               for r in small["results"] if r["policy"].startswith("promoe"))
    # the disk tier: promoe reads experts from the file
    disk = small["disk_run"]
    assert disk["host_budget"] > 0 and not disk["errors"]
    assert {r["policy"] for r in disk["results"]} == {"promoe"}
    for r in disk["results"]:
        assert r["disk"]["reads_per_token"] > 0 and r["disk"]["measured_gbps"] > 0, r
    routings = json.loads((out / "bench_routings.json").read_text())
    assert {"uniform", "skewed"} <= set(routings)
    assert all(r["routing_trace"] for r in routings.values())
    assert all(any(x["policy"] == "default" for x in r["results"]) for r in routings.values())
    fixed = json.loads((out / "bench_fixed.json").read_text())
    assert {r["policy"] for r in fixed["full"]["results"]} == {"all-gpu", "promoe"}
    assert fixed["full"]["routing_trace"] and fixed["own"]["routing_trace"] is None
    lossless = json.loads((out / "lossless.json").read_text())
    assert lossless["exit_code"] == 0 and lossless["failed"] == 0 and lossless["passed"] > 0


def test_usage_errors(tmp_path: Path) -> None:
    assert _run().returncode == 2
    assert _run("nonsense", str(tmp_path)).returncode == 2
    assert _run("run").returncode == 2  # no OUT


def test_wheels_needs_nvcc(tmp_path: Path) -> None:
    """Without the CUDA toolkit the wheels step stops at once and says what is missing."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    path = ":".join(d for d in os.environ["PATH"].split(":")
                    if not (Path(d) / "nvcc").exists()) + f":{bin_dir}"
    res = _run("wheels", env={**os.environ, "PATH": path}, timeout=60)
    assert res.returncode == 1 and "no nvcc" in res.stderr

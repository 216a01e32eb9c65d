"""A wheel of forecache carries its data: installed (not editable) into a fresh virtual
environment and run from another directory, the commands that read models.yaml, the patch series
and the machine profiles work."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _run(cmd: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    res = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, f"{' '.join(cmd)} exited {res.returncode}:\n{res.stderr[-3000:]}"
    return res


def test_wheel_installs_with_its_data(tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
          "-w", str(dist), str(REPO)], cwd=tmp_path)
    wheel = next(dist.glob("forecache-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    for part in ("forecache/data/models.yaml", "forecache/data/profiles/rtx4090.json",
                 "forecache/data/models/forecache-ref-q8_0.gguf"):
        assert part in names, part
    shipped = {n for n in names if n.startswith("forecache/data/patches/") and n.endswith(".patch")}
    patches = REPO / "forecache/data/patches"
    assert shipped == {f"forecache/data/patches/{p.relative_to(patches)}"
                       for p in patches.rglob("*.patch")}
    for src in (REPO / "forecache/csrc").iterdir():
        assert f"forecache/csrc/{src.name}" in names, src.name

    # A fresh environment whose dependencies come from this one (a path line, so this
    # environment's editable install of forecache is not seen), with the wheel installed into it.
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=tmp_path)
    py = venv / "bin" / "python"
    site = Path(_run([str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                     cwd=tmp_path).stdout.strip())
    (site / "deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    _run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site),
          str(wheel)], cwd=tmp_path)

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    where = _run([str(py), "-c", "import forecache; print(forecache.__file__)"],
                 cwd=elsewhere).stdout.strip()
    assert Path(where).is_relative_to(site), where
    fc = [str(py), "-m", "forecache"]
    models = json.loads(_run(fc + ["models", "--json"], cwd=elsewhere).stdout)
    assert models, "no models listed"
    _run(fc + ["make-model", str(elsewhere / "t.gguf"), "--preset", "tiny"], cwd=elsewhere)
    assert (elsewhere / "t.gguf").stat().st_size > 0
    assert "--shape" in _run(fc + ["simulate", "--help"], cwd=elsewhere).stdout
    n = _run([str(py), "-c", "from forecache import build as b; "
              "print(len(b.patch_files()), b.patch_series_hash())"], cwd=elsewhere).stdout.split()
    from forecache import build

    # the hash covers forecache/csrc too: an equal hash means the sources shipped intact
    assert n == [str(len(build.patch_files())), build.patch_series_hash()]

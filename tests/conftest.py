"""Shared fixtures: tiny models written once per test session."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """tiny_model(qtype, preset="tiny", fuse_gate_up=False) -> path of that preset in that type
    (seed 0), made on first use."""
    from forecache.gguf.maker import make_model

    root = tmp_path_factory.mktemp("tiny")
    made: dict[tuple[str, str, bool], Path] = {}

    def get(qtype: str = "q8_0", preset: str = "tiny", fuse_gate_up: bool = False) -> Path:
        key = (qtype, preset, fuse_gate_up)
        if key not in made:
            path = root / f"{preset}-{qtype}{'-fused' if fuse_gate_up else ''}.gguf"
            make_model(path, preset, qtype, seed=0, workers=1, fuse_gate_up=fuse_gate_up)
            made[key] = path
        return made[key]

    return get


# Largest change of a prompt's logits that other kernels (repacked CPU weights, GPU kernels) may
# cause, relative to the spread of the logits; measured under 0.2% on made models.
ROUNDING = 2e-2


def assert_same_greedy(tokens: list[int], logits: np.ndarray, ref_tokens: list[int],
                       ref_logits: np.ndarray, where: str, exact: bool = True,
                       device_diff: float = 0.0) -> None:
    """``exact``: the same tokens and bit-identical logits at every step (one CPU build's kernels
    on both sides). Otherwise equal up to rounding: the prompt's logits within ROUNDING of the
    spread (plus 1.5x ``device_diff``, stock llama.cpp's own difference between computing the
    experts on the CPU and on the GPU for this prompt, where a run computes some on each), and
    the tokens the same up to the first difference, which must be a near tie (later steps read
    other contexts)."""
    if exact:
        assert tokens == ref_tokens, f"tokens differ: {where}"
        assert np.array_equal(logits, ref_logits), f"logits differ: {where}"
        return
    spread = float(np.ptp(ref_logits[0]))
    diff0 = float(np.max(np.abs(logits[0] - ref_logits[0])))
    allowed = ROUNDING * spread + 1.5 * device_diff
    assert diff0 <= allowed, (f"{where}: prompt logits differ by {diff0:.3g} (allowed "
                              f"{allowed:.3g}; stock's CPU-vs-GPU experts: {device_diff:.3g})")
    for i, (a, b) in enumerate(zip(tokens, ref_tokens, strict=True)):
        if a != b:
            diff = float(np.max(np.abs(logits[i] - ref_logits[i])))
            top2 = np.sort(ref_logits[i])[-2:]
            assert top2[1] - top2[0] <= 2 * diff, f"{where}: step {i} token {a} vs {b}"
            return


def assert_same_tokens(tokens: list[int], ref_tokens: list[int], ref_logits: np.ndarray,
                       where: str) -> None:
    """The same greedy tokens up to the first difference, which must be a near tie of the
    reference's logits (within ROUNDING of their spread)."""
    for i, (a, b) in enumerate(zip(tokens, ref_tokens, strict=True)):
        if a != b:
            top2 = np.sort(ref_logits[i])[-2:]
            assert top2[1] - top2[0] <= ROUNDING * float(np.ptp(ref_logits[i])), \
                f"{where}: step {i} token {a} vs {b}"
            return


class ChildRunError(AssertionError):
    """A greedy run in a child process failed; ``returncode`` is negative for a signal."""

    def __init__(self, message: str, returncode: int) -> None:
        super().__init__(message)
        self.returncode = returncode


def run_greedy_child(job: dict, work: Path, site: Path | None = None,
                     info: dict | None = None) -> list[tuple[list[int], np.ndarray]]:
    """Run tests/stock_runner.py on ``job`` in a child process (with ``site`` first on
    PYTHONPATH when given): [(greedy tokens, logits of each step [n_gen, n_vocab])] per run;
    ``info`` gets forecache's expert cache's stats and slot devices, when it had one."""
    n = len(list(work.glob("job-*.json")))
    job_path, out = work / f"job-{n}.json", work / f"out-{n}.npz"
    job_path.write_text(json.dumps(job))
    env = dict(os.environ)
    if site is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(site), *filter(None, [env.get("PYTHONPATH")])])
    res = subprocess.run([sys.executable, str(Path(__file__).with_name("stock_runner.py")),
                          str(job_path), str(out)], env=env, capture_output=True, text=True,
                         timeout=600)
    if res.returncode != 0:
        who = "the unpatched reference" if site is not None else "forecache"
        raise ChildRunError(f"{who} exited {res.returncode} on {job['model']}:\n"
                            f"{res.stderr[-3000:]}", res.returncode)
    data = np.load(out)
    if info is not None and "cache_info" in data:
        info.update(json.loads(data["cache_info"].tobytes()))
    return [(data[f"tokens_{i}"].tolist(), data[f"logits_{i}"]) for i in range(len(job["runs"]))]


def greedy_job(model: Path, prompts: list[list[int]], n_gen: int, repack: bool = False,
               loader: str = "llama_cpp", rpc: list[str] | None = None,
               **params: object) -> dict:
    """A job for tests/stock_runner.py (``rpc``: RPC servers whose devices it registers
    first)."""
    return {"model": str(model), "params": params, "repack": repack, "loader": loader,
            "rpc": rpc or [],
            "runs": [{"prompt": list(map(int, p)), "n_gen": n_gen} for p in prompts]}


class StockReference:
    """Greedy runs on the unpatched llama-cpp-python of the same sdist, each in a child process
    (tests/stock_runner.py), memoised for the session."""

    def __init__(self, site: Path, work: Path, backend: str = "cpu") -> None:
        self.site = site
        self.work = work
        self.backend = backend
        self._memo: dict[str, list[tuple[list[int], np.ndarray]]] = {}

    def run(self, model: Path, prompts: list[list[int]], n_gen: int, repack: bool = False,
            rpc: list[str] | None = None, **params: object
            ) -> list[tuple[list[int], np.ndarray]]:
        """[(greedy tokens, logits of each step [n_gen, n_vocab])] for each prompt; ``repack``
        keeps llama.cpp's default CPU weight repacking (off by default, as in forecache's
        policies); ``rpc``: RPC servers whose devices take the layers."""
        if self.backend != "cpu" or rpc:  # every layer on the devices, as forecache places them
            params.setdefault("n_gpu_layers", -1)
        job = greedy_job(model, prompts, n_gen, repack, rpc=rpc, **params)
        key = json.dumps(job, sort_keys=True)
        if key not in self._memo:
            self._memo[key] = run_greedy_child(job, self.work, self.site)
        return self._memo[key]


@pytest.fixture(scope="session")
def stock(tmp_path_factory: pytest.TempPathFactory) -> StockReference:
    """The unpatched llama-cpp-python reference (built into the cache on first use; `make test`
    builds it before the tests)."""
    from forecache import build

    backend = (build.installed_build_info() or {}).get("backend", "cpu")
    site = build.build_reference(backend=backend)
    return StockReference(site, tmp_path_factory.mktemp("stock"), backend)

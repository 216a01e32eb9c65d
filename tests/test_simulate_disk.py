"""``forecache simulate --host-budget``: a replay with experts beyond host memory read from the
model file by the disk tier (llama.cpp's mmap'd baseline through its page cache)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from forecache.sim.disk_reads import host_weight_bytes
from forecache.sim.shapes import shape_of
from forecache.trace.format import TraceWriter
from tests.cli_helpers import run_cli, run_cli_json


def _trace(path: Path) -> Path:
    """Four requests of 24 prompt and 16 decode tokens, each token keeping half its experts."""
    rng = np.random.default_rng(4)
    n_layers, n_expert, k, n_tok = 8, 32, 4, 40
    with TraceWriter(path, n_layers=n_layers, top_k=k) as w:
        for _ in range(4):
            ex = np.zeros((n_tok, n_layers, k), np.int16)
            for t in range(n_tok):
                for il in range(n_layers):
                    keep = ex[t - 1, il, :2] if t else rng.choice(n_expert, 2, replace=False)
                    rest = rng.choice(np.setdiff1d(np.arange(n_expert), keep), k - 2,
                                      replace=False)
                    ex[t, il] = np.r_[keep, rest]
            w.add_request(ex, token_ids=rng.integers(0, 100, n_tok).astype(np.int32),
                          phase=np.r_[np.zeros(24, np.int8), np.ones(n_tok - 24, np.int8)])
    return path


def _quarter(shape_name: str, qtype: str) -> int:
    sh = shape_of(shape_name, qtype)
    return host_weight_bytes(shape_name, qtype) + sh.experts * sh.expert_bytes * sh.layers // 4


ARGS = ("--shape", "reference", "--qtype", "q8_0", "--cache-fraction", "0.25", "--predictor",
        "history")


def test_a_host_budget_reads_the_rest_from_the_file(tmp_path: Path) -> None:
    trace = _trace(tmp_path / "t.npz")
    budget = str(_quarter("reference", "q8_0"))
    out = run_cli_json("simulate", "--trace", str(trace), *ARGS, "--host-budget", budget)
    assert out["host_slots"] == shape_of("reference", "q8_0").experts // 4
    assert out["disk"]["gbps"] == 7.0
    run = out["runs"][0]
    assert run["disk_reads"] > 0 and run["decode_disk_reads"] > 0
    slower = run_cli_json("simulate", "--trace", str(trace), *ARGS, "--host-budget", budget,
                          "--disk-gbps", "0.5", "--disk-latency-us", "500")
    assert slower["disk"]["gbps"] == 0.5 and slower["disk"]["latency_us"] == 500
    assert slower["runs"][0]["tpot_s"] > run["tpot_s"]
    text = run_cli("simulate", "--trace", str(trace), *ARGS, "--host-budget", budget,
                   "--compare", check=True).stdout
    assert "disk tier: 8/32 experts a layer in host slots" in text, text
    assert "ncmoe: cannot run (" in text  # --no-mmap reads every host expert into memory
    assert "promoe: " in text and "from the file a decoded token" in text


def test_a_host_budget_that_holds_every_expert_needs_no_disk(tmp_path: Path) -> None:
    trace = _trace(tmp_path / "t.npz")
    text = run_cli("simulate", "--trace", str(trace), *ARGS, "--host-budget", "64GiB",
                   check=True).stdout
    assert "disk tier: off, the host budget holds every expert" in text
    assert "from the file a decoded token" not in text


def test_a_profile_without_a_disk_needs_its_rate(tmp_path: Path) -> None:
    trace = _trace(tmp_path / "t.npz")
    budget = str(_quarter("reference", "q8_0"))
    bad = run_cli("simulate", "--trace", str(trace), *ARGS, "--profile", "h200-xeon",
                  "--host-budget", budget)
    assert bad.returncode != 0 and "has no disk section: give --disk-gbps" in bad.stderr
    ok = run_cli_json("simulate", "--trace", str(trace), *ARGS, "--profile", "h200-xeon",
                      "--host-budget", budget, "--disk-gbps", "3")
    assert ok["disk"]["gbps"] == 3 and ok["runs"][0]["disk_reads"] > 0

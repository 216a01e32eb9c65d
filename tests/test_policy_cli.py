"""`generate --policy` and `bench` as users run them."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from cli_helpers import run_cli, run_cli_json


def test_generate_json_has_cache_stats(tiny_model: Callable[[str], Path]) -> None:
    model = str(tiny_model("q8_0"))
    base = ["generate", "-m", model, "-p", "Hello there", "-n", "12", "--greedy", "--ignore-eos"]
    plain = run_cli_json(*base)
    out = run_cli_json(*base, "--policy", "lru", "--cache-fraction", "0.5")
    stats = out["stats"]
    for key in ("hits", "misses", "h2d_bytes", "stall_s", "cache_slots"):
        assert key in stats, key
    assert stats["policy"] == "lru" and stats["cache_slots"] == 4 * 8
    assert stats["hits"] + stats["misses"] > 0 and stats["h2d_bytes"] > 0
    assert out["tokens"] == plain["tokens"]


def test_bench_reports_every_policy_with_ratios(tiny_model: Callable[[str], Path]) -> None:
    model = str(tiny_model("q8_0"))
    rep = run_cli_json("bench", "-m", model, "--gpu-budget", "1GiB", "--prompt-len", "16",
                       "--gen", "4", "--prompts", "1")
    assert [r["policy"] for r in rep["results"]] == ["ncmoe", "offload", "lru", "lfu", "static",
                                                     "promoe", "infinity"]
    assert rep["same_tokens"]
    for r in rep["results"]:
        assert r["tpot_s"] > 0 and r["ttft_s"] > 0
        others = {"offload", "ncmoe", "lru"} - {r["policy"]}
        assert set(r["ratios"]) == others
    table = run_cli("bench", "-m", model, "--cache-fraction", "0.5", "--policies", "offload,lru",
                    "--prompt-len", "8", "--gen", "3", "--prompts", "1", check=True)
    assert "ncmoe" not in table.stdout.split("ratios")[0].split("\n", 2)[2]
    assert "lru" in table.stdout and "vs offload" in table.stdout


def test_bench_ablation_and_cache_rates(tiny_model: Callable[[str], Path]) -> None:
    model = str(tiny_model("q8_0"))
    rep = run_cli_json("bench", "-m", model, "--cache-fraction", "0.25", "--ablation",
                       "--prompt-len", "24", "--gen", "4", "--prompts", "1")
    assert [r["run"] for r in rep["runs"]] == ["base (lru)", "+prefetch", "+chunked",
                                               "+early preemption", "+reordered", "+host split"]
    assert rep["same_tokens"]  # every step of the ablation is lossless
    base = rep["runs"][0]
    assert base["prefill_speedup"] == 1.0 and base["decode_speedup"] == 1.0
    assert base["host_layers"] > 0  # lru computes a ubatch with more experts than slots on the CPU
    assert rep["runs"][4]["host_layers"] == 0  # reordered: those ubatches stream through slots
    sweep = run_cli_json("bench", "-m", model, "--rates", "0.25,0.75", "--policies",
                         "offload,lru,promoe", "--prompt-len", "16", "--gen", "3", "--prompts",
                         "1")
    assert list(sweep["rates"]) == ["0.25", "0.75"]
    for row in sweep["rates"].values():
        assert set(row) == {"offload", "lru", "promoe"}
        assert all(ttft > 0 and tpot > 0 for ttft, tpot in row.values())
    assert sweep["rates"]["0.25"]["offload"] == sweep["rates"]["0.75"]["offload"]  # run once
    bad = run_cli("bench", "-m", model, "--rates", "0.5,2")
    assert bad.returncode != 0 and "(0, 1]" in bad.stderr


def test_benchmarks_count_threads_as_llama_cpp_does() -> None:
    """One thread per physical core: SMT siblings (same physical and core id) count once."""
    from forecache.bench import llama_cpp_threads

    def cpu(n: int, phys: int, core: int) -> str:
        return f"processor\t: {n}\nphysical id\t: {phys}\ncore id\t\t: {core}\n"

    smt = "\n".join(cpu(i, 0, i % 4) for i in range(8))  # 4 cores, 2 threads each
    assert llama_cpp_threads(smt) == 4
    two_sockets = "\n".join(cpu(i, i // 4, i % 4) for i in range(8))
    assert llama_cpp_threads(two_sockets) == 8
    assert llama_cpp_threads("processor\t: 0\n") >= 1  # no core ids: every CPU


def test_bench_reports_the_runs_that_ran_when_one_fails(tiny_model: Callable[[str], Path]) -> None:
    """A placement that cannot run (here lru under a budget too small for the model's own
    weights) is named in the report and the exit status; the others' figures stand."""
    import json

    model = str(tiny_model("q8_0"))
    res = run_cli("bench", "-m", model, "--policies", "all-gpu,lru", "--gpu-budget", "1MiB",
                  "--prompt-len", "16", "--gen", "4", "--prompts", "1", "--threads", "1",
                  "--json")
    assert res.returncode == 1
    report = json.loads(res.stdout)
    assert [r["policy"] for r in report["results"]] == ["all-gpu"]
    assert set(report["errors"]) == {"lru"} and "lru" in res.stderr.splitlines()[-1]

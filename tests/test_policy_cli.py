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
    assert [r["policy"] for r in rep["results"]] == ["offload", "ncmoe", "lru", "static",
                                                     "promoe"]
    assert rep["same_tokens"]
    for r in rep["results"]:
        assert r["tpot_s"] > 0 and r["ttft_s"] > 0
        others = {"offload", "ncmoe", "lru"} - {r["policy"]}
        assert set(r["ratios"]) == others
    table = run_cli("bench", "-m", model, "--cache-fraction", "0.5", "--policies", "offload,lru",
                    "--prompt-len", "8", "--gen", "3", "--prompts", "1", check=True)
    assert "ncmoe" not in table.stdout.split("ratios")[0].split("\n", 2)[2]
    assert "lru" in table.stdout and "vs offload" in table.stdout

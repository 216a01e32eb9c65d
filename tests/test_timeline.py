"""The expert cache's timeline (forecache_cache_set_timeline): spans of its work per layer, their
ring, and the per-layer summary benchmarks print."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

from forecache.cache.timeline import TimelineSpan, format_summary, overlap_s, summarize
from forecache.generate import SamplingParams, generate
from forecache.llama import Llama
from tests.cli_helpers import run_cli, run_cli_json

PROMPT = list(range(10, 50))  # 40 tokens: one prompt pass
N_GEN = 6


def _record(llm: Llama, capacity: int | None = None) -> tuple[list, int, dict]:
    cache = llm.expert_cache
    assert cache is not None
    cache.reset_stats()
    cache.start_timeline(capacity)
    generate(llm, PROMPT, N_GEN, SamplingParams(greedy=True), ignore_eos=True)
    stats = cache.stats()
    spans, dropped = cache.timeline()
    return spans, dropped, stats


def test_spans_follow_every_layer_of_every_pass(tiny_model: Callable[..., Path]) -> None:
    with Llama(str(tiny_model("q8_0")), policy="promoe", cache_fraction=0.5, n_ctx=256,
               predictor="history", verbose=False) as llm:
        spans, dropped, stats = _record(llm)
        moe = llm.model_file.moe_layers()
    assert dropped == 0
    by_pass: dict[int, list] = {}
    for s in spans:
        assert s.t0 <= s.t1 and s.layer in moe
        by_pass.setdefault(s.pass_id, []).append(s)
    routed = {p: v for p, v in by_pass.items() if any(s.kind == "ids" for s in v)}
    assert len(routed) == N_GEN  # the prompt's pass, then a pass per token fed back
    for group in routed.values():
        ids = [s for s in group if s.kind == "ids"]
        gates = [s for s in group if s.kind == "gate"]
        # every MoE layer read its ids once and was gated once, in layer order, ids first
        assert [s.layer for s in ids] == moe and [s.layer for s in gates] == moe
        for i, g in zip(ids, gates, strict=True):
            assert i.t1 <= g.t0 and g.n == i.n
    tokens = sorted({s.n for s in spans if s.kind == "ids"})
    assert tokens == [1, len(PROMPT)]
    # every copy the cache counted is a span, with its bytes
    copies = [s for s in spans if s.kind == "copy"]
    assert sum(s.nbytes for s in copies) == stats["h2d_bytes"] > 0
    assert len(copies) == stats["n_chunks"]
    assert all(s.expert >= 0 and s.slot >= 0 for s in copies)
    summary = summarize(spans, dropped)
    pre, dec = summary["phases"]["prefill"], summary["phases"]["decode"]
    assert (pre["passes"], dec["passes"]) == (1, N_GEN - 1)
    assert pre["kinds"]["ids"]["n"] == len(moe) and dec["kinds"]["gate"]["n"] == len(moe) * 5
    assert pre["copy_bytes"] + dec["copy_bytes"] == stats["h2d_bytes"]
    text = format_summary(summary)
    assert text.startswith("prefill: 1 passes") and "\ndecode: 5 passes" in text
    assert sum(line.split()[0].isdigit() for line in text.splitlines()) == 2 * len(moe)


def test_host_layers_are_host_spans(tiny_model: Callable[..., Path]) -> None:
    """A prompt that routes more experts than lru's slots computes its layers on the CPU: one
    host span for each such layer, its experts computed whole (every projection)."""
    with Llama(str(tiny_model("q8_0")), policy="lru", cache_fraction=0.25, n_ctx=256,
               verbose=False) as llm:
        spans, _, stats = _record(llm)
    kinds = Counter(s.kind for s in spans)
    assert stats["host_layers"] > 0
    assert kinds["host"] == stats["host_layers"] == stats["whole"]
    host = [s for s in spans if s.kind == "host"]
    assert all(s.n > 0 and s.proj == -1 for s in host)
    pre = summarize(spans)["phases"]["prefill"]
    assert pre["kinds"]["host"]["items"] == sum(s.n for s in host if s.pass_id == host[0].pass_id)
    assert "host entries:" in format_summary(summarize(spans))


def _span(kind: str, t0: float, t1: float, n: int = 1) -> TimelineSpan:
    return TimelineSpan(kind, 0, 0, -1, -1, n, 7, 0, t0, t1)


def test_host_overlap_is_the_time_both_threads_ran() -> None:
    """The CPU's host entries beside the device side's groups and waits: the intersection of
    the two unions of intervals, each counted once however many spans cover it."""
    host = [_span("host", 0.0, 4.0, 64), _span("host", 3.0, 5.0, 32), _span("host", 9.0, 10.0)]
    dev = [_span("group", 1.0, 2.0, 3), _span("wait", 1.5, 3.5), _span("group", 4.5, 9.5)]
    assert overlap_s(host, dev) == pytest.approx(2.5 + 0.5 + 0.5)
    assert overlap_s(host, []) == 0.0 and overlap_s(dev, dev) == pytest.approx(2.5 + 5.0)
    pre = summarize([_span("ids", 0.0, 0.0, 512), *host, *dev])["phases"]["prefill"]
    assert pre["host_overlap_s"] == pytest.approx(3.5)
    assert pre["kinds"]["host"]["items"] == 97 and pre["kinds"]["group"]["items"] == 4


def test_ring_keeps_the_last_spans(tiny_model: Callable[..., Path]) -> None:
    """The same work recorded twice, once whole and once through a ring of 10 spans. lru from a
    warm cache repeats its work span for span (a prefetching policy's groups and waits depend on
    timing, and a cold cache copies more than a warm one)."""
    with Llama(str(tiny_model("q8_0")), policy="lru", cache_fraction=0.5, n_ctx=256,
               verbose=False) as llm:
        _record(llm)
        llm.reset()
        full, _, _ = _record(llm)
        llm.reset()
        kept, dropped, _ = _record(llm, capacity=10)
        cache = llm.expert_cache
        assert cache is not None
        # a drained, stopped timeline records nothing more
        generate(llm, PROMPT[:8], 2, SamplingParams(greedy=True), ignore_eos=True)
        assert cache.timeline() == ([], 0)
        with pytest.raises(ValueError, match="at least one span"):
            cache.start_timeline(0)
    assert len(kept) == 10 and dropped > 0
    # as many spans either way (waits for a copy may differ by a few), the ring keeping the newest
    assert abs((len(kept) + dropped) - len(full)) <= len(full) // 4
    assert kept == sorted(kept, key=lambda s: s.pass_id)
    assert kept[-1].pass_id == max(s.pass_id for s in kept)


def test_bench_reports_timelines(tiny_model: Callable[..., Path]) -> None:
    model = str(tiny_model("q8_0"))
    rep = run_cli_json("bench", "-m", model, "--policies", "offload,promoe", "--cache-fraction",
                       "0.5", "--prompt-len", "16", "--gen", "4", "--prompts", "1",
                       "--timeline")
    res = {r["policy"]: r for r in rep["results"]}
    assert res["offload"]["timeline"] is None  # no cache, no timeline
    tl = res["promoe"]["timeline"]
    assert tl["phases"]["prefill"]["passes"] == 1 and tl["phases"]["decode"]["passes"] == 3
    out = run_cli("bench", "-m", model, "--policies", "promoe", "--cache-fraction", "0.5",
                  "--prompt-len", "16", "--gen", "4", "--prompts", "1", "--timeline")
    assert "timeline of promoe" in out.stdout and "prefill: 1 passes" in out.stdout
    bad = run_cli("bench", "-m", model, "--timeline", "--rates", "0.5", check=False)
    assert bad.returncode == 2 and "--timeline" in bad.stderr

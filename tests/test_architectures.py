"""Every architecture make-model writes, end to end as a user runs it: a trace with router inputs,
learned predictors trained on it, then promoe prefetching with them; its greedy text is the
unpatched build's and its predictions reach the MoE layers (past deepseek2's dense first layer).
The lossless matrix itself is in test_lossless (every policy) and test_prefetch (promoe's
switches, the host split)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from cli_helpers import run_cli
from stock_runner import greedy

from forecache.gguf.header import read_model_file
from forecache.jobs.requests import Request
from forecache.llama import Llama
from forecache.placement.options import CacheConfig
from forecache.predictor.store import load_learned
from forecache.record import record_trace

if TYPE_CHECKING:
    from conftest import StockReference

PRESETS = ["tiny", "tiny-qwen3moe", "tiny-mixtral", "tiny-olmoe", "tiny-granitemoe",
           "tiny-deepseek2", "tiny-gpt-oss", "tiny-lfm2moe"]
TEXT = "Rivers carry water from the hills down to the sea, and the sea feeds the clouds. "


@pytest.mark.parametrize("preset", PRESETS)
def test_trace_train_and_prefetch(preset: str, tiny_model: Callable[..., Path],
                                  stock: StockReference, tmp_path: Path,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FORECACHE_CACHE_DIR", str(tmp_path / "cache"))
    model = tiny_model("q8_0", preset)
    mf = read_model_file(model)
    trace = tmp_path / "trace.npz"
    prompts = [Request(str(i), i, prompt=TEXT * (i + 1)) for i in range(6)]
    summary = record_trace(model, prompts, trace, n_gen=16, gate_input=True, n_batch=64)
    assert summary.requests == len(prompts)
    run_cli("train", "-m", str(model), "--trace", str(trace), "--window", "1", "--epochs", "5",
            check=True)
    learned = load_learned(mf, 1)
    n_moe = len(mf.moe_layers())
    assert sorted(learned.pairs) == [(0, 1)] + [(i - 1, i) for i in range(2, n_moe)]

    params = {"n_ctx": 1024, "n_batch": 256, "n_threads": 2}
    cfg = CacheConfig("promoe", cache_fraction=0.25, predictor="learned", window=1)
    with Llama(str(model), cache=cfg, verbose=False, **params) as llm:
        prompt = llm.tokenize((TEXT * 4).encode())
        tokens, logits = greedy(llm, prompt, 24)
        cache = llm.expert_cache
        assert cache is not None and cache.worker is not None
        cache.worker.drain()
        pol = cache.policy
        forecasts = pol.prefetch_loads + pol.prefetch_refreshed + pol.stale_predictions
        stats = cache.stats()
        # the predictor's layers are the model's MoE layers (deepseek2's start at block 1)
        assert cache.worker.forecaster.moe_layers == mf.moe_layers()
    (ref_tokens, ref_logits), = stock.run(model, [prompt], 24, **params)
    assert tokens == ref_tokens, preset
    if stock.backend == "cpu":
        assert (logits == ref_logits).all(), preset
    assert forecasts > 0 and stats["hits"] > 0, (preset, forecasts, stats["hits"])


@pytest.mark.parametrize("preset", PRESETS)
def test_parallel_batch_writes_the_texts_of_one_sequence(preset: str,
                                                         tiny_model: Callable[..., Path],
                                                         tmp_path: Path) -> None:
    """A batch job decoding three sequences at once (freed ids reused, the last sequence moved
    into a lower id: KV streams, gpt-oss's sliding window, lfm2moe's recurrent state) writes the
    texts it writes one sequence at a time."""
    import json

    model = tiny_model("q8_0", preset)
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"id": str(i), "prompt": TEXT[:20 + 13 * i],
                                       "max_tokens": 6 + 5 * (i % 3), "temperature": 0}) + "\n"
                           for i in range(7)))
    texts = []
    for parallel in ("1", "3"):
        out = tmp_path / f"out-{parallel}.jsonl"
        run_cli("batch", "-m", str(model), "--input", str(inp), "--output", str(out),
                "--parallel", parallel, "--policy", "promoe", "--cache-fraction", "0.5",
                check=True)
        texts.append({r["id"]: r["text"] for r in map(json.loads, out.read_text().splitlines())})
    assert len(texts[0]) == 7 and texts[0] == texts[1]


@pytest.mark.parametrize("flags", [["--draft", "self-little"], ["--mode", "mobile"]])
def test_recurrent_models_refuse_what_takes_tokens_back(tiny_model: Callable[..., Path],
                                                        flags: list[str]) -> None:
    """Speculative and MoBiLE decoding remove tokens from a sequence's cache, which llama.cpp
    cannot do to a recurrent state: one line says so, instead of wrong tokens."""
    model = tiny_model("q8_0", "tiny-lfm2moe")
    res = run_cli("generate", "-m", str(model), "-p", "Hello", "-n", "4", "--policy", "promoe",
                  "--cache-fraction", "0.5", "--predictor", "history", *flags)
    assert res.returncode != 0
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "recurrent state" in lines[0] and flags[0] in lines[0], lines

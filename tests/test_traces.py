"""Trace files (write, stream-read, damage) and recording traces from a real model."""

from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np
import pytest

from forecache.trace.format import TraceError, TraceFile, TraceWriter


def _random_requests(rng: np.random.Generator, n: int, L: int = 3, k: int = 2, d: int = 5):
    out = []
    for i in range(n):
        T = 4 + 3 * i
        out.append({
            "experts": rng.integers(0, 8, (T, L, k)).astype(np.int16),
            "token_ids": rng.integers(0, 100, T).astype(np.int32),
            "phase": (np.arange(T) >= 2).astype(np.int8),
            "weights": rng.random((T, L, k)).astype(np.float16),
            "gate_input": rng.standard_normal((T, L, d)).astype(np.float16),
        })
    return out


def test_round_trip_streams_and_matches(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    reqs = _random_requests(rng, 3)
    path = tmp_path / "t.npz"
    with TraceWriter(path, n_layers=3, top_k=2, n_embd=5, meta={"model_name": "m"}) as w:
        for r in reqs:
            w.add_request(r["experts"], token_ids=r["token_ids"], phase=r["phase"],
                          weights=r["weights"], gate_input=r["gate_input"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.npz"]  # no side files left
    with TraceFile(path) as tr:
        info = tr.info()
        assert (info.n_tokens, info.n_layers, info.top_k, info.n_requests) == (4 + 7 + 10, 3, 2, 3)
        assert info.has_gate_input and tr.meta["model_name"] == "m"
        assert isinstance(tr.array("gate_input"), np.memmap)  # read in place, not loaded
        for r, got in zip(reqs, tr.requests(), strict=True):
            for name in ("experts", "token_ids", "phase", "weights", "gate_input"):
                np.testing.assert_array_equal(np.asarray(getattr(got, name)), r[name])
        np.testing.assert_array_equal(tr.array("seq"), np.repeat([0, 1, 2], [4, 7, 10]))
        np.testing.assert_array_equal(tr.array("pos")[4:11], np.arange(7))
    # numpy reads it as an ordinary .npz
    with np.load(path) as z:
        np.testing.assert_array_equal(z["experts"][:4], reqs[0]["experts"])


def test_interrupted_writer_keeps_finished_requests_or_nothing(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    reqs = _random_requests(rng, 3)
    kept = tmp_path / "kept.npz"
    with pytest.raises(KeyboardInterrupt), TraceWriter(kept, n_layers=3, top_k=2) as w:
        w.keep_partial = True
        for r in reqs[:2]:
            w.add_request(r["experts"], token_ids=r["token_ids"], phase=r["phase"])
        raise KeyboardInterrupt
    with TraceFile(kept) as tr:
        assert tr.info().n_requests == 2 and not tr.has("gate_input")
    dropped = tmp_path / "dropped.npz"
    with pytest.raises(RuntimeError), TraceWriter(dropped, n_layers=3, top_k=2) as w:
        w.add_request(reqs[0]["experts"], token_ids=reqs[0]["token_ids"], phase=reqs[0]["phase"])
        raise RuntimeError("boom")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept.npz"]


def test_shared_format_is_read(tmp_path: Path) -> None:
    """A compressed npz in the shared traces' format (unknown requests grouped by step)."""
    path = tmp_path / "shared.npz"
    ex = np.arange(6 * 2 * 2, dtype=np.int16).reshape(6, 2, 2) % 5
    ex[5, 1] = -1
    np.savez_compressed(path, experts=ex, seq=np.array([0, 0, -1, -1, -1, -1], np.int32),
                        step=np.array([0, 0, 1, 1, 2, 2], np.int32),
                        pos=np.zeros(6, np.int32), phase=np.zeros(6, np.int8))
    with TraceFile(path) as tr:
        assert [u.tolist() for u in tr.units()] == [[0, 1], [2, 3], [4, 5]]
        assert tr.info().n_expert == 5 and not tr.info().has_gate_input


@pytest.mark.parametrize("kind", ["missing", "garbage", "no-experts", "ragged"])
def test_bad_trace_files_are_refused(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "bad.npz"
    if kind == "garbage":
        path.write_bytes(b"not a zip at all")
    elif kind == "no-experts":
        np.savez(path, seq=np.zeros(3, np.int32))
    elif kind == "ragged":
        np.savez(path, experts=np.zeros((4, 2, 2), np.int16), seq=np.zeros(3, np.int32))
    with pytest.raises(TraceError, match="trace|damaged|experts"):
        TraceFile(path)


def test_truncated_trace_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "t.npz"
    with TraceWriter(path, n_layers=2, top_k=2) as w:
        w.add_request(np.zeros((5, 2, 2), np.int16), token_ids=np.zeros(5), phase=np.zeros(5))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(TraceError):
        TraceFile(path)
    assert not zipfile.is_zipfile(path)


def _assert_same_choice(scores: np.ndarray, chosen: np.ndarray, where: str) -> None:
    """The top-k of ``scores`` are the ``chosen`` experts, but where the router input's float16
    rounding in the trace may have turned a near tie (scores within 0.2% of the k-th)."""
    k = chosen.shape[1]
    top = np.sort(np.argsort(-scores, axis=1, kind="stable")[:, :k], axis=1)
    rows = np.flatnonzero((top != np.sort(chosen, axis=1)).any(axis=1))
    assert len(rows) <= max(1, len(scores) // 50), f"{where}: {len(rows)} tokens routed otherwise"
    for r in rows:
        kth = np.sort(scores[r])[-k]
        got = scores[r, chosen[r].astype(np.int64)].min()
        assert kth - got <= 2e-3 * abs(kth), f"{where}: token {r} is no near tie"


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen3moe", "tiny-mixtral", "tiny-olmoe",
                                    "tiny-granitemoe", "tiny-deepseek2", "tiny-gpt-oss",
                                    "tiny-lfm2moe"])
def test_tracing_keeps_tokens_and_records_true_routing(preset: str, tiny_model,
                                                        tmp_path: Path) -> None:
    """The recorded trace: same greedy tokens as a plain run, one row per token fed to the model,
    and gate inputs/weights that reproduce each layer's routing through its own router, in each
    architecture's router form (deepseek2: sigmoid scores, a selection bias, groups; its dense
    first layer is not a trace layer)."""
    from forecache.generate import SamplingParams, generate, text_tokens
    from forecache.gguf.header import read_model_file
    from forecache.jobs.requests import Request
    from forecache.llama import Llama
    from forecache.placement.options import CacheConfig
    from forecache.predictor.skip import SkipPredictor
    from forecache.record import _render, record_trace

    model = tiny_model("q8_0", preset)
    prompts = [Request("a", 1, prompt="Tell me about rivers and the sea."),
               Request("b", 2, messages=[{"role": "user", "content": "Add 2 and 3."}]),
               Request("c", 3, prompt="word " * 40)]
    out = tmp_path / "tiny.npz"
    s = record_trace(model, prompts, out, n_gen=12, gate_input=True, n_batch=16)
    assert s.requests == 3 and not s.interrupted
    # the tracer's own placement (experts in host memory, not repacked), untraced: llama.cpp's
    # repacked kernels (AMX's tiles) may round otherwise and break a near-tie
    with Llama.open(model, cache=CacheConfig(policy="offload"), n_batch=16) as llm:
        plain = [generate(llm, _render(llm, p, True), 12, SamplingParams(greedy=True)).tokens
                 for p in prompts]
        prompt_tokens = [text_tokens(llm, _render(llm, p, True)) for p in prompts]
    assert s.outputs == plain
    mf = read_model_file(model)
    layers = mf.moe_layers()
    skip = SkipPredictor.from_model(mf, layers)
    with TraceFile(out) as tr:
        assert tr.meta["model_name"] == model.name and tr.meta["n_expert"] == mf.n_expert
        assert tr.meta["moe_layers"] == layers and tr.meta["n_layers"] == len(layers)
        for req, toks, gen in zip(tr.requests(), prompt_tokens, plain, strict=True):
            fed = toks + gen
            assert req.n_tokens in (len(fed) - 1, len(fed))
            np.testing.assert_array_equal(req.token_ids, fed[:req.n_tokens])
            np.testing.assert_array_equal(req.phase, np.arange(req.n_tokens) >= len(toks))
            for layer in range(len(layers)):
                x = np.asarray(req.gate_input[:, layer], np.float32)
                probs = skip.score_request(req, [(layer, layer)])[(layer, layer)]
                _assert_same_choice(probs, req.experts[:, layer], f"{preset} layer {layer}")
                weights = skip.form.probs(skip.logits(layer, layer, x))
                np.testing.assert_allclose(np.take_along_axis(
                    weights, req.experts[:, layer].astype(np.int64), axis=1),
                    req.weights[:, layer].astype(np.float32), atol=2e-3)

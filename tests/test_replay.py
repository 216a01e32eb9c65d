"""Routing replay: a trace's routing mapped onto a model, and real llama.cpp runs computing with it.

Every model test runs the tiny made models on one thread (fast on a small, busy machine). The
routing a run computes with is read back through the expert cache's gate hook, which sees the ids
each MoE layer's expert matmuls read, as ``forecache trace`` records them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pytest
from cli_helpers import run_cli, run_cli_json

from forecache.trace.format import TraceFile, TraceWriter
from forecache.trace.replay import ReplayError, Routing, map_routing
from forecache.trace.stats import routing_stats
from tests.conftest import assert_same_tokens

N_EXPERT, TOP_K, N_LAYERS = 16, 4, 4  # the "tiny" preset (qwen2moe)


# -- helpers ---------------------------------------------------------------------------------------
def _routing(rng: np.random.Generator, n: int, n_layers: int = N_LAYERS, k: int = TOP_K,
             n_expert: int = N_EXPERT) -> np.ndarray:
    """int16 [n, L, k]: k distinct valid ids a row, drawn from a skewed load per layer."""
    out = np.empty((n, n_layers, k), np.int16)
    for j in range(n_layers):
        p = rng.permutation(1.0 / np.arange(1, n_expert + 1))
        p /= p.sum()
        for t in range(n):
            out[t, j] = rng.choice(n_expert, k, replace=False, p=p)
    return out


def _write_trace(path: Path, experts: np.ndarray, phase: np.ndarray,
                 weights: np.ndarray | None = None) -> Path:
    """A one-request trace as ``forecache trace`` writes it (float16 weights)."""
    with TraceWriter(path, n_layers=experts.shape[1], top_k=experts.shape[2],
                     meta={"n_expert": N_EXPERT}) as w:
        w.add_request(experts.astype(np.int16), token_ids=np.arange(len(phase), dtype=np.int32),
                      phase=np.asarray(phase, np.int8), weights=weights)
    return path


def _prefill_decode_trace(path: Path, n_prefill: int, n_decode: int, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    n = n_prefill + n_decode
    w = rng.uniform(0.05, 1.0, (n, N_LAYERS, TOP_K)).astype(np.float16)
    return _write_trace(path, _routing(rng, n), np.arange(n) >= n_prefill, w)


class _Seen:
    """The ids the gate hook reports, per llama.cpp block, one array per gate call."""

    def __init__(self) -> None:
        self.calls: dict[int, list[np.ndarray]] = {}
        self.weights_given = 0

    def __call__(self, layer: int, ids: np.ndarray, w: object, _x: object) -> None:
        self.calls.setdefault(layer, []).append(ids.copy())
        self.weights_given += w is not None

    def rows(self, layer: int) -> np.ndarray:
        return np.concatenate(self.calls[layer])


def _open(model: Path, trace: Path | None, cache: object = "lru", **kw: object):
    from forecache.llama import Llama
    from forecache.placement.options import CacheConfig

    if cache == "lru":
        cache = CacheConfig(policy="lru", cache_fraction=0.5)
    kw.setdefault("n_ctx", 256)
    return Llama.open(model, cache=cache, routing_trace=trace, n_threads=1, **kw)


def _greedy(llm, prompt: Sequence[int], n_gen: int) -> list[int]:
    from forecache.generate import SamplingParams, generate

    return generate(llm, list(prompt), n_gen, SamplingParams(greedy=True), ignore_eos=True).tokens


def _stepped(llm, prompt: Sequence[int], n_gen: int) -> tuple[list[int], np.ndarray]:
    """Greedy decoding one row at a time: the tokens and each step's logits (the reference a
    verification's several rows, which some CPUs' kernels round otherwise, meet up to a near
    tie)."""
    llm.eval(list(prompt))
    tokens, rows = [], []
    for _ in range(n_gen):
        rows.append(_last_logits(llm))
        tokens.append(int(np.argmax(rows[-1])))
        llm.eval([tokens[-1]])
    return tokens, np.array(rows)


def _last_logits(llm) -> np.ndarray:
    from forecache.native import llama_cpp_module

    ptr = llama_cpp_module().llama_get_logits_ith(llm.ctx, -1)
    return np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),)).copy()


def _summary(path: Path) -> dict:
    with TraceFile(path) as tf:
        return routing_stats(tf).to_json()


# -- map_routing -----------------------------------------------------------------------------------
def _valid(r: Routing, n_expert: int, k: int) -> None:
    assert r.experts.dtype == np.int32 and r.weights.dtype == np.float32
    assert r.experts.shape[2] == k and r.weights.shape == r.experts.shape
    assert ((r.experts >= 0) & (r.experts < n_expert)).all()
    srt = np.sort(r.experts, axis=2)
    assert (np.diff(srt, axis=2) != 0).all(), "a token names an expert twice"


def test_map_routing_is_the_identity_when_shapes_match() -> None:
    rng = np.random.default_rng(0)
    ex = _routing(rng, 12, n_layers=3, k=2, n_expert=8)
    w = rng.uniform(0.1, 1.0, ex.shape).astype(np.float16)
    ph = (np.arange(12) >= 7).astype(np.int8)
    r = map_routing(ex, w, ph, n_layers=3, n_expert=8, top_k=2, source="t.npz")
    _valid(r, 8, 2)
    np.testing.assert_array_equal(r.experts, ex)
    np.testing.assert_array_equal(r.weights, w.astype(np.float32))
    np.testing.assert_array_equal(r.phase, ph)
    assert r.source == "t.npz"


@pytest.mark.parametrize(("lt", "lm"), [(2, 5), (6, 3), (3, 7)])
def test_map_routing_layers_read_proportional_trace_layers(lt: int, lm: int) -> None:
    """Model layer j reads trace layer j * L_trace // L_model (deeper and shallower models)."""
    n, k, n_expert = 6, 2, 2 * lt + 2
    ex = np.empty((n, lt, k), np.int16)
    for i in range(lt):  # trace layer i routes only experts 2i and 2i+1: each layer recognisable
        ex[:, i] = [2 * i, 2 * i + 1]
    ex[::2] = ex[::2, :, ::-1]
    w = np.broadcast_to(np.arange(1, lt + 1, dtype=np.float16)[None, :, None] / 10, ex.shape)
    r = map_routing(ex, w, None, n_layers=lm, n_expert=n_expert, top_k=k)
    _valid(r, n_expert, k)
    assert r.experts.shape == (n, lm, k)
    for j in range(lm):
        src = j * lt // lm
        np.testing.assert_array_equal(r.experts[:, j], ex[:, src], err_msg=f"layer {j}")
        np.testing.assert_allclose(r.weights[:, j], (src + 1) / 10, rtol=1e-3)


def test_map_routing_replaces_unknown_and_out_of_range_ids() -> None:
    """Ids -1 and >= n_expert (and repeats) give way to the latest earlier rows' experts of the
    same layer, then to the lowest free ids: k distinct valid ids in every row."""
    ex = np.array([[[1, 2, 3]], [[5, -1, 9]], [[4, 4, -1]], [[7, 6, 0]], [[-1, -1, -1]],
                   [[8, 12, 3]]], np.int16)
    r = map_routing(ex, None, None, n_layers=1, n_expert=8, top_k=3)
    _valid(r, 8, 3)
    assert r.experts[:, 0].tolist() == [[1, 2, 3], [5, 1, 2], [4, 5, 1], [7, 6, 0], [7, 6, 0],
                                        [3, 7, 6]]
    # nothing earlier: the lowest ids the row does not name
    first = map_routing(np.array([[[-1, 8, 3]]], np.int16), None, None, n_layers=1,
                        n_expert=8, top_k=3)
    assert first.experts[0, 0].tolist() == [3, 0, 1]
    # a trace routing more experts than the model: its next-ranked valid ids fill in
    wide = map_routing(np.array([[[9, 2, 3, 4]], [[1, 2, 3, 4]]], np.int16),
                       np.full((2, 1, 4), 0.25, np.float16), None, n_layers=1, n_expert=8,
                       top_k=2)
    assert wide.experts[:, 0].tolist() == [[2, 3], [1, 2]]
    # a whole random trace of junk still maps to valid rows, layer by layer
    rng = np.random.default_rng(3)
    junk = rng.integers(-1, 40, (50, 3, 6)).astype(np.int16)
    _valid(map_routing(junk, None, None, n_layers=4, n_expert=10, top_k=5), 10, 5)


def test_map_routing_completes_rows_with_fewer_experts() -> None:
    ex = np.array([[[1, 2]], [[5, 6]], [[1, 5]]], np.int16)
    w = np.array([[[0.6, 0.4]], [[0.7, 0.3]], [[0.5, 0.5]]], np.float16)
    r = map_routing(ex, w, None, n_layers=1, n_expert=8, top_k=4)
    _valid(r, 8, 4)
    assert r.experts[:, 0].tolist() == [[1, 2, 0, 3], [5, 6, 1, 2], [1, 5, 6, 2]]
    # the experts the trace lacks weigh 1/k
    np.testing.assert_array_equal(r.weights[:, 0, 2:], 0.25)


def test_map_routing_weights() -> None:
    """Given weights are kept; missing (no array) and zero ones are 1/k."""
    ex = np.array([[[1, 2, 3]], [[4, 5, 6]], [[0, 1, 2]]], np.int16)
    w = np.array([[[0.5, 0.3, 0.2]], [[0.6, 0.0, 0.1]], [[0.0, 0.0, 0.0]]], np.float16)
    r = map_routing(ex, w, None, n_layers=1, n_expert=8, top_k=3)
    f = w.astype(np.float32)[:, 0]
    np.testing.assert_array_equal(r.weights[:, 0], [[f[0, 0], f[0, 1], f[0, 2]],
                                                    [f[1, 0], np.float32(1 / 3), f[1, 2]],
                                                    [np.float32(1 / 3)] * 3])
    none = map_routing(ex, None, None, n_layers=1, n_expert=8, top_k=3)
    np.testing.assert_array_equal(none.weights, np.float32(1 / 3))
    # a trace routing more experts than the model keeps the weights of those the model routes
    wide = map_routing(np.array([[[1, 2, 3, 4]]], np.int16),
                       np.array([[[0.4, 0.3, 0.2, 0.1]]], np.float16), None, n_layers=1,
                       n_expert=8, top_k=2)
    np.testing.assert_allclose(wide.weights[0, 0], [0.4, 0.3], rtol=1e-3)


def test_routing_rows_by_phase() -> None:
    ex = np.zeros((5, 1, 1), np.int16)
    r = map_routing(ex, None, np.array([0, 0, 1, 0, 1]), n_layers=1, n_expert=2, top_k=1)
    assert r.rows(False).tolist() == [0, 1, 3] and r.rows(True).tolist() == [2, 4]
    # one phase serves both
    only_prefill = map_routing(ex, None, np.zeros(5), n_layers=1, n_expert=2, top_k=1)
    assert only_prefill.rows(True).tolist() == only_prefill.rows(False).tolist() == \
        list(range(5))
    only_decode = map_routing(ex, None, np.ones(5), n_layers=1, n_expert=2, top_k=1)
    assert only_decode.rows(False).tolist() == list(range(5))
    no_phase = map_routing(ex, None, None, n_layers=1, n_expert=2, top_k=1)
    assert no_phase.rows(True).tolist() == list(range(5))


def test_map_routing_refuses_an_empty_trace() -> None:
    with pytest.raises(ReplayError, match="e.npz has no routed rows"):
        map_routing(np.zeros((0, 2, 2), np.int16), None, None, n_layers=2, n_expert=4,
                    top_k=2, source="e.npz")


# -- the routing a replaying model computes with ---------------------------------------------------
def test_gate_hook_sees_the_replayed_rows(tiny_model: Callable[..., Path],
                                          tmp_path: Path) -> None:
    """Recorded as ``forecache trace`` records (every row of the last layer computed), a replayed
    run routes exactly the trace's rows: the prompt its prefill rows, generated tokens its decode
    rows, in order; a trace written from what the hook saw has the input's routing statistics,
    which differ from the model's own."""
    from forecache.record import RouteRecorder, all_rows_computed

    model = tiny_model("q8_0")
    n_prefill, n_decode = 24, 8
    trace = _prefill_decode_trace(tmp_path / "in.npz", n_prefill, n_decode)
    prompt = list(range(40, 40 + n_prefill))

    def record(replay: Path | None) -> tuple[np.ndarray, list[int], int]:
        with _open(model, replay) as llm:
            layers = llm.model_file.moe_layers()
            rec = RouteRecorder({il: i for i, il in enumerate(layers)}, gate_input=False)
            llm.expert_cache.on_route = rec
            with all_rows_computed(llm):
                tokens = _greedy(llm, prompt, n_decode + 1)
            n = llm.replay.check() if llm.replay is not None else 0
        experts, _, _ = rec.request_arrays()
        return experts, tokens, n

    seen, tokens, rewritten = record(trace)
    assert rewritten > 0
    with TraceFile(trace) as tf:
        want = np.asarray(tf.array("experts"))
        phase = np.asarray(tf.array("phase"))
    assert seen.shape == want.shape
    np.testing.assert_array_equal(seen, want)

    out = tmp_path / "seen.npz"
    _write_trace(out, seen, phase)
    got, ref = _summary(out), _summary(trace)
    for key in ("n_tokens", "n_layers", "n_expert", "top_k", "prefill_tokens", "decode_tokens",
                "summary"):
        assert got[key] == ref[key], key
    assert [x["load_entropy"] for x in got["layers"]] == \
        [x["load_entropy"] for x in ref["layers"]]

    # the same run without the replay routes otherwise, with other statistics and tokens
    own, own_tokens, _ = record(None)
    assert own.shape == want.shape and not np.array_equal(own, want)
    _write_trace(tmp_path / "own.npz", own, phase)
    own_summary = _summary(tmp_path / "own.npz")["summary"]
    assert own_summary["load_entropy"] != ref["summary"]["load_entropy"]
    assert own_tokens != tokens


def test_rows_are_read_in_order_across_requests(tiny_model: Callable[..., Path],
                                                tmp_path: Path) -> None:
    """Each phase's cursor runs on from request to request and wraps when used up; llama.cpp
    computes the last layer for a prompt batch's output row only, which reads the batch's last
    row."""
    from forecache.record import all_rows_computed

    model = tiny_model("q8_0")
    P, D = 16, 6
    trace = _prefill_decode_trace(tmp_path / "t.npz", P, D, seed=1)
    seen = _Seen()
    with _open(model, trace) as llm:
        layers = llm.model_file.moe_layers()
        llm.expert_cache.on_route = seen
        routing = llm.replay.routing
        _greedy(llm, range(100, 110), 4)  # prompt rows 0-9, decode rows 0-2
        llm.reset()
        with all_rows_computed(llm):
            _greedy(llm, range(300, 320), 6)  # prompt rows 10-15, 0-13; decode 3-5, 0, 1
        assert llm.replay.check() > 0
        assert llm.replay.tokens == 10 + 3 + 20 + 5
    with TraceFile(trace) as tf:
        ex = np.asarray(tf.array("experts"))
    np.testing.assert_array_equal(routing.experts, ex)  # valid ids: mapped as they are
    dec = list(range(P, P + D))
    first = list(range(10)) + dec[0:3]
    second = list(range(10, 16)) + list(range(14)) + dec[3:6] + dec[0:2]
    for i, il in enumerate(layers):
        rows = first + second
        if il == layers[-1]:
            # the first request's prompt batch computes its last row only
            rows = [9] + dec[0:3] + second
        np.testing.assert_array_equal(seen.rows(il), ex[rows, i], err_msg=f"layer {il}")
    assert [len(c) for c in seen.calls[layers[-1]]] == [1, 1, 1, 1, 20, 1, 1, 1, 1, 1]
    # the gate hook gets no router weights under the replay (see the report of this test file)
    assert seen.weights_given == 0


def test_replaying_a_models_own_routing_reproduces_it(tiny_model: Callable[..., Path],
                                                      tmp_path: Path) -> None:
    """The model's own routing (ids and float32 router weights), replayed over a prompt of
    several ubatches, gives bit-identical logits: both the ids and the weights the replay sets
    are what the expert matmuls and their weighting read, the last layer's output rows included.
    Without the weights (1/k) the logits change. qwen2moe multiplies the expert outputs by the
    router weights as the gate hook reports them (architectures that normalise them after the
    selection would not reproduce)."""
    from forecache.record import all_rows_computed

    model = tiny_model("q8_0")
    prompt, n_gen = list(range(200, 220)), 8  # ubatches of 8, 8 and 4 tokens
    with _open(model, None, n_batch=8) as llm:
        layers = llm.model_file.moe_layers()
        seen = _Seen()
        llm.expert_cache.on_route = seen
        with all_rows_computed(llm):
            _greedy(llm, prompt, n_gen)
    with _open(model, None, n_batch=8) as llm:  # the plain run, no hook
        ref_tokens = _greedy(llm, prompt, n_gen)
        ref_logits = _last_logits(llm)
    weights: dict[int, list[np.ndarray]] = {}

    def with_weights(layer: int, ids: np.ndarray, w: np.ndarray | None, _x: object) -> None:
        assert w is not None
        weights.setdefault(layer, []).append(w.copy())

    with _open(model, None, n_batch=8) as llm:
        llm.expert_cache.on_route = with_weights
        with all_rows_computed(llm):
            _greedy(llm, prompt, n_gen)
    ex = np.stack([seen.rows(il) for il in layers], axis=1)
    w = np.stack([np.concatenate(weights[il]) for il in layers], axis=1)
    n = len(prompt) + n_gen - 1
    assert ex.shape == (n, N_LAYERS, TOP_K)
    phase = (np.arange(n) >= len(prompt)).astype(np.int8)
    own = tmp_path / "own.npz"  # float32 weights: the shared traces' npz form, read as well
    np.savez(own, experts=ex.astype(np.int16), weights=w.astype(np.float32), phase=phase)
    no_w = tmp_path / "own-ids.npz"
    np.savez(no_w, experts=ex.astype(np.int16), phase=phase)

    with _open(model, own, n_batch=8) as llm:
        assert llm.n_batch == 8
        tokens = _greedy(llm, prompt, n_gen)
        logits = _last_logits(llm)
        assert llm.replay.check() > 0
    assert tokens == ref_tokens
    np.testing.assert_array_equal(logits, ref_logits)
    with _open(model, no_w, n_batch=8) as llm:
        _greedy(llm, prompt, n_gen)
        assert not np.array_equal(_last_logits(llm), ref_logits)


@pytest.mark.parametrize("preset", ["tiny-mixtral", "tiny-deepseek2"])
def test_replay_maps_a_trace_onto_another_model(preset: str, tiny_model: Callable[..., Path],
                                                tmp_path: Path) -> None:
    """A 2-layer, 16-expert top-4 trace on mixtral (4 MoE layers of 8 experts, top-2) and
    deepseek2 (a dense first block, then 3 MoE layers of 16, top-4): each MoE layer routes the
    mapped rows, with the trace's own ids wherever they fit."""
    from forecache.gguf.header import read_model_file
    from forecache.record import all_rows_computed

    model = tiny_model("q8_0", preset)
    mf = read_model_file(model)
    layers, k, n_expert = mf.moe_layers(), mf.n_expert_used, mf.n_expert
    rng = np.random.default_rng(5)
    n = 14
    ex = _routing(rng, n, n_layers=2, k=4, n_expert=16)
    trace = _write_trace(tmp_path / "t.npz", ex, np.arange(n) >= 10)
    mapped = map_routing(ex, None, np.arange(n) >= 10, n_layers=len(layers),
                         n_expert=n_expert, top_k=k)
    seen = _Seen()
    with _open(model, trace) as llm:
        llm.expert_cache.on_route = seen
        with all_rows_computed(llm):
            _greedy(llm, range(50, 60), 5)
        assert llm.replay.check() > 0
    assert sorted(seen.calls) == layers
    for j, il in enumerate(layers):
        got = seen.rows(il)
        assert got.shape == (n, k)
        np.testing.assert_array_equal(got, mapped.experts[:, j], err_msg=f"block {il}")
        src = ex[:, j * 2 // len(layers), :k]
        fits = ((src < n_expert).all(axis=1) &
                (np.sort(src, axis=1)[:, 1:] != np.sort(src, axis=1)[:, :-1]).all(axis=1))
        assert fits.any()
        np.testing.assert_array_equal(got[fits], src[fits])
        assert ((got >= 0) & (got < n_expert)).all()


# -- every placement -------------------------------------------------------------------------------
def test_every_placement_replays_the_same_routing(tiny_model: Callable[..., Path],
                                                  tmp_path: Path) -> None:
    """Stock placements, every cache policy and no cache: each rewrites its expert matmuls, and
    on the CPU build (the same kernels everywhere) all compute the same greedy tokens, which are
    not the model's own."""
    from forecache import build
    from forecache.placement.options import CacheConfig

    model = tiny_model("q8_0")
    trace = _prefill_decode_trace(tmp_path / "t.npz", 20, 10, seed=2)
    prompt = list(range(500, 520))
    configs: dict[str, CacheConfig | None] = {
        "none": None, "offload": CacheConfig(policy="offload"),
        "ncmoe": CacheConfig(policy="ncmoe", gpu_budget=1 << 30)}
    for policy in ("lru", "lfu", "static", "promoe", "infinity"):
        configs[policy] = CacheConfig(policy=policy, cache_fraction=0.5)
    tokens: dict[str, list[int]] = {}
    own: dict[str, list[int]] = {}
    for name, cfg in configs.items():
        with _open(model, trace, cache=cfg) as llm:
            assert (llm.expert_cache is not None) == (name not in ("none", "offload", "ncmoe"))
            tokens[name] = _greedy(llm, prompt, 8)
            assert llm.replay.check() > 0, name
        if name in ("none", "lru"):
            with _open(model, None, cache=cfg) as llm:
                own[name] = _greedy(llm, prompt, 8)
    cpu = (build.installed_build_info() or {}).get("backend", "cpu") == "cpu"
    if cpu:
        assert all(t == tokens["none"] for t in tokens.values()), tokens
        assert own["none"] == own["lru"]
    assert tokens["none"] != own["none"] and tokens["lru"] != own["lru"]


# -- one ubatch per batch --------------------------------------------------------------------------
def test_replay_makes_every_batch_one_ubatch(tiny_model: Callable[..., Path],
                                             tmp_path: Path) -> None:
    from forecache.record import all_rows_computed

    model = tiny_model("q8_0")
    P, D = 24, 4
    trace = _prefill_decode_trace(tmp_path / "t.npz", P, D, seed=3)
    with _open(model, None, n_batch=64, n_ubatch=16) as llm:
        assert (llm.n_batch, llm.context_params.n_ubatch) == (64, 16)
    seen = _Seen()
    with _open(model, trace, n_batch=64, n_ubatch=16) as llm:
        assert llm.n_batch == llm.context_params.n_batch == llm.context_params.n_ubatch == 16
        layers = llm.model_file.moe_layers()
        llm.expert_cache.on_route = seen
        with all_rows_computed(llm):
            _greedy(llm, range(600, 640), 3)  # ubatches of 16, 16 and 8 tokens
        assert llm.replay.check() > 0
        done = llm.replay.tokens
        with pytest.raises(ReplayError, match="more than one ubatch"):
            llm.replay.before_batch(17)
        assert llm.replay.tokens == done
    with TraceFile(trace) as tf:
        ex = np.asarray(tf.array("experts"))
    rows = [i % P for i in range(40)] + [P, P + 1]
    for i, il in enumerate(layers):
        assert [len(c) for c in seen.calls[il]] == [16, 16, 8, 1, 1]
        np.testing.assert_array_equal(seen.rows(il), ex[rows, i], err_msg=f"layer {il}")


def test_a_batch_of_sequences_replays_each_tokens_routing_where_it_lands(
        tiny_model: Callable[..., Path], tmp_path: Path) -> None:
    """With a KV stream per sequence llama.cpp splits a batch of several sequences into ubatches
    of its own (equal rows of each sequence), in another order than the batch's: every token
    still routes as set for its sequence and position, in whichever ubatch it lands."""
    from llama_cpp import llama_cpp as low

    from forecache.roofline.batch import split_batch

    model = tiny_model("q8_0")
    trace = _prefill_decode_trace(tmp_path / "t.npz", 40, 8, seed=4)
    with TraceFile(trace) as tf:
        ex = np.asarray(tf.array("experts"))
    seqs = [0] * 10 + [1] * 6  # two prompts of 10 and 6 tokens in one batch
    pos = list(range(10)) + list(range(6))
    picks = np.array([(7 * i + 3) % 40 for i in range(16)])  # a distinct row for each token
    seen = _Seen()
    with _open(model, trace, n_seq_max=2, n_batch=32, n_ubatch=8) as llm:
        assert (llm.n_batch, llm.context_params.n_ubatch) == (32, 8)
        layers = llm.model_file.moe_layers()
        llm.expert_cache.on_route = seen
        batch = low.llama_batch_init(32, 0, 1)
        try:
            for i, (q, p) in enumerate(zip(seqs, pos, strict=True)):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = 100 + i, p, 1
                batch.seq_id[i][0] = q
                batch.logits[i] = True  # the last layer too computes every row
            batch.n_tokens = len(seqs)
            llm.replay.before_rows(seqs, pos, picks.tolist())
            assert low.llama_decode(llm.ctx, batch) == 0
        finally:
            low.llama_batch_free(batch)
        assert llm.replay.check() > 0
        with pytest.raises(ReplayError, match="same position twice"):
            llm.replay.before_rows([0, 0], [3, 3], [1, 2])
    parts = split_batch(seqs, 8, "equal")
    assert [len(u) for u in parts] == [8, 4, 4]  # not the batch's order
    for i, il in enumerate(layers):
        assert [len(c) for c in seen.calls[il]] == [len(u) for u in parts], il
        for got, u in zip(seen.calls[il], parts, strict=True):
            np.testing.assert_array_equal(got, ex[picks[u], i], err_msg=f"layer {il}")


def test_a_batch_job_reads_each_requests_own_rows(tiny_model: Callable[..., Path],
                                                  tmp_path: Path) -> None:
    """In a batch job each request reads the prompt rows, then the decode rows, of the routing in
    order, from a start of its own (by the order it was admitted in), whichever requests share
    its steps; the gate sees every row fed."""
    from forecache.batch import decode_many
    from forecache.jobs.requests import Request
    from forecache.trace.replay import REQUEST_STRIDE

    model = tiny_model("q8_0")
    P, D = 30, 20
    trace = _prefill_decode_trace(tmp_path / "t.npz", P, D, seed=5)
    reqs = [Request(id=f"r{i}", line=i + 1, prompt=" ".join(["word"] * (3 + 4 * i)),
                    max_tokens=6) for i in range(5)]

    def run(n_parallel: int) -> tuple[list[list[int]], int, dict[str, dict]]:
        """Each request's routing rows in position order (requests in the order admitted), the
        rows the gate saw in the first MoE layer, and the records."""
        out: dict[str, dict] = {}
        fed: list[tuple[int, int, int]] = []
        with _open(model, trace, n_seq_max=n_parallel, n_batch=32, n_ubatch=8) as llm:
            seen = _Seen()
            llm.expert_cache.on_route = seen
            set_rows = llm.replay.before_rows

            def spy(seqs: Sequence[int], pos: Sequence[int], picks: Sequence[int]) -> None:
                fed.extend(zip(seqs, pos, picks, strict=True))
                set_rows(seqs, pos, picks)

            llm.replay.before_rows = spy
            # (sequences kept where admitted, so that a sequence id names one request at a time)
            decode_many(llm, reqs, n_parallel, lambda r: out.__setitem__(r["id"], r),
                        compact=False)
            n_seen = len(seen.rows(llm.model_file.moe_layers()[0]))
        requests: list[dict[int, int]] = []  # position -> row, a request's from its position 0
        current: dict[int, dict[int, int]] = {}
        for q, p, pick in fed:
            if p == 0:
                current[q] = {}
                requests.append(current[q])
            current[q][p] = pick
        return [[r[p] for p in sorted(r)] for r in requests], n_seen, out

    got = {}
    for n_parallel in (1, 3):
        rows, n_seen, out = run(n_parallel)
        assert sorted(out) == [r.id for r in reqs] and all("error" not in r for r in out.values())
        assert len(rows) == len(reqs) and n_seen == sum(map(len, rows))
        for k, picks in enumerate(rows):
            n_p = sum(1 for x in picks if x < P)  # the trace's prompt rows come first
            start = k * REQUEST_STRIDE
            assert picks[:n_p] == ((start + np.arange(n_p)) % P).tolist()
            assert picks[n_p:] == (P + (start + np.arange(len(picks) - n_p)) % D).tolist()
        assert len({r[0] for r in rows}) == len(rows)  # each request from a start of its own
        got[n_parallel] = rows
    # decoded alone or beside others, a request reads the same rows (its answer may be cut short
    # by another end of text: the shorter one's rows begin the longer one's)
    for a, b in zip(got[1], got[3], strict=True):
        n = min(len(a), len(b))
        assert a[:n] == b[:n] and n >= len(a) - 6
    # as forecache batch runs it: finished sequences' ids taken by the highest, their KV moved
    out: dict[str, dict] = {}
    with _open(model, trace, n_seq_max=3, n_batch=32, n_ubatch=8) as llm:
        decode_many(llm, reqs, 3, lambda r: out.__setitem__(r["id"], r))
        assert llm.replay.check() > 0
    assert sorted(out) == [r.id for r in reqs] and all("error" not in r for r in out.values())


# -- bad input -------------------------------------------------------------------------------------
def test_missing_or_unreadable_trace_is_refused(tiny_model: Callable[..., Path],
                                                tmp_path: Path) -> None:
    model = tiny_model("q8_0")
    missing = tmp_path / "nope.npz"
    with pytest.raises(ReplayError, match=f"routing trace {missing} does not exist"):
        _open(model, missing)
    garbage = tmp_path / "garbage.npz"
    garbage.write_text("not a trace\n")
    with pytest.raises(ReplayError, match=f"{garbage}: not a trace file"):
        _open(model, garbage)
    empty = tmp_path / "empty.npz"
    np.savez(empty, experts=np.zeros((0, N_LAYERS, TOP_K), np.int16))
    with pytest.raises(ReplayError, match="empty.npz has no routed rows"):
        _open(model, empty, cache=None)


def _bench_args(model: Path, *extra: str) -> list[str]:
    return ["bench", "-m", str(model), "--policies", "all-gpu,lru", "--cache-fraction", "0.5",
            "--prompt-len", "16", "--gen", "4", "--prompts", "1", "--threads", "1", *extra]


def test_bench_with_a_missing_trace_fails_in_one_line(tiny_model: Callable[..., Path],
                                                      tmp_path: Path) -> None:
    missing = tmp_path / "missing.npz"
    res = run_cli(*_bench_args(tiny_model("q8_0"), "--routing-trace", str(missing)))
    assert res.returncode != 0 and "Traceback" not in res.stderr, res.stderr
    errors = [line for line in res.stderr.splitlines() if "rror" in line]
    assert len(errors) == 1 and str(missing) in errors[0] and "does not exist" in errors[0], \
        res.stderr
    assert res.stdout == ""


def test_bench_with_an_unreadable_trace_fails_in_one_line(tiny_model: Callable[..., Path],
                                                          tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.npz"
    garbage.write_text("not a trace\n")
    res = run_cli(*_bench_args(tiny_model("q8_0"), "--routing-trace", str(garbage)))
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 1 and len(lines) == 1, res.stderr
    assert lines[0].startswith("forecache: error:") and str(garbage) in lines[0]


def test_bench_replays_a_trace(tiny_model: Callable[..., Path], tmp_path: Path) -> None:
    model = tiny_model("q8_0")
    trace = _prefill_decode_trace(tmp_path / "t.npz", 20, 6, seed=4)
    rep = run_cli_json(*_bench_args(model, "--routing-trace", str(trace)))
    assert rep["routing_trace"] == str(trace)
    assert rep["same_tokens"] is None
    assert [r["policy"] for r in rep["results"]] == ["all-gpu", "lru"]
    for r in rep["results"]:
        assert r["ttft_s"] > 0 and r["tpot_s"] > 0 and math.isfinite(r["tokens_per_s"])
    lru = rep["results"][1]
    assert lru["cache_slots"] == N_LAYERS * N_EXPERT // 2 and "lru" in rep["results"][0]["ratios"]
    plain = run_cli_json(*_bench_args(model))
    assert plain["routing_trace"] is None and plain["same_tokens"] is True
    table = run_cli(*_bench_args(model, "--routing-trace", str(trace)), check=True).stdout
    assert "replays the routing of t.npz" in table
    json.dumps(rep)  # plain JSON


def test_policy_bench_drafts_under_replay_beside_stock_with_the_draft(
        tiny_model: Callable[..., Path], tmp_path: Path) -> None:
    """The GPU check's speculation step on the CPU build: stock's best and forecache, each with
    and without the same draft model, on replayed routing and replayed acceptance; the drafted
    runs report their counters and a ratio to stock's best with the draft; +draft without a
    draft model is refused in one line."""
    import subprocess
    import sys

    model = tiny_model("q8_0")
    draft = tmp_path / "draft.gguf"
    from forecache.gguf.maker import make_model
    make_model(draft, "tiny", "q8_0", seed=3, workers=1)  # the same vocabulary, other weights
    trace = _prefill_decode_trace(tmp_path / "t.npz", 16, 40, seed=6)
    out = tmp_path / "rep.json"

    def bench(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "benchmarks/policy_bench.py", "-m", str(model),
                               "--gpu-budget", "1GiB", "--prompt-len", "8", "--gen", "16",
                               "--prompts", "1", "--threads", "2", "--routing-trace", str(trace),
                               *args], capture_output=True, text=True, timeout=300,
                              cwd=Path(__file__).resolve().parents[1])

    res = bench("--policies", "ncmoe,ncmoe+draft,lru,lru+draft", "--draft", str(draft),
                "--acceptance", "0.7", "--json", str(out))
    assert res.returncode == 0, res.stderr
    rep = json.loads(out.read_text())
    runs = {r["policy"]: r for r in rep["results"]}
    assert set(runs) == {"ncmoe", "ncmoe+draft", "lru", "lru+draft"}
    for name in ("ncmoe+draft", "lru+draft"):
        sp = runs[name]["spec"]
        assert sp["verify_passes"] > 0 and 0 < sp["accepted"] < sp["drafted"]
        assert sp["draft"] == "draft.gguf"
    assert runs["lru+draft"]["spec"]["spec_prefetch"] == "off: routing replayed"
    assert "ncmoe+draft" in runs["lru+draft"]["ratios"] and "ncmoe" in runs["lru+draft"]["ratios"]
    assert "ncmoe+draft" not in runs["ncmoe+draft"]["ratios"]
    assert "vs ncmoe+draft" in res.stdout and "acceptance replayed (0.70 a token)" in res.stdout
    res = bench("--policies", "lru+draft")
    assert res.returncode != 0 and "give one (--draft" in res.stderr


def test_replay_refuses_what_chooses_experts_or_rows(tiny_model: Callable[..., Path],
                                                    tmp_path: Path) -> None:
    """MoBiLE's little pass and speculative decoding pick experts or rows of their own: a replay
    fixes both, so they are refused in one line rather than silently measured wrong."""
    from forecache.llama import Llama
    from forecache.placement.options import CacheConfig

    model = tiny_model("q8_0")
    trace = _prefill_decode_trace(tmp_path / "t.npz", 20, 10, seed=2)
    little = CacheConfig(policy="lru", cache_fraction=0.5, little_k=1, gamma=0.0)
    with pytest.raises(ValueError, match="little pass"):
        Llama.open(model, cache=little, n_ctx=256, n_threads=1, routing_trace=trace)
    with pytest.raises(ValueError, match="self-little"):
        Llama.open(model, cache=CacheConfig(policy="lru", cache_fraction=0.5), n_ctx=256,
                   n_threads=1, routing_trace=trace, draft="self-little")


def _own_routing_trace(model: Path, path: Path, prompt: list[int], n_gen: int) -> Path:
    """The model's own routing (ids and router weights) over a greedy run of ``prompt``."""
    from forecache.record import all_rows_computed

    seen: dict[int, list[np.ndarray]] = {}
    weights: dict[int, list[np.ndarray]] = {}

    def both(layer: int, ids: np.ndarray, w: np.ndarray | None, _x: object) -> None:
        assert w is not None
        seen.setdefault(layer, []).append(ids.copy())
        weights.setdefault(layer, []).append(w.copy())

    with _open(model, None, n_batch=8) as llm:
        layers = llm.model_file.moe_layers()
        llm.expert_cache.on_route = both
        with all_rows_computed(llm):
            _greedy(llm, prompt, n_gen)
    ex = np.stack([np.concatenate(seen[il]) for il in layers], axis=1)
    w = np.stack([np.concatenate(weights[il]) for il in layers], axis=1)
    phase = (np.arange(len(ex)) >= len(prompt)).astype(np.int8)
    np.savez(path, experts=ex.astype(np.int16), weights=w.astype(np.float32), phase=phase)
    return path


@pytest.mark.parametrize("policy", ["lru", "ncmoe"])
def test_a_model_draft_under_replay_keeps_plain_decodings_routing(
        tiny_model: Callable[..., Path], tmp_path: Path, policy: str) -> None:
    """A verification's rows read the decode rows plain decoding gives the same positions (set
    by position, as a batch job's are), so a model draft keeps a replayed run exact: on a
    trace of other routing, where the unreplayed draft agrees with nothing, the same greedy
    tokens as without it; on the model's own routing, where the model drafting for itself is
    accepted, the model's own tokens. With an acceptance replay too (the GPU check's
    speculation runs) the rows' cursor follows the tokens kept."""
    from forecache.placement.options import CacheConfig

    model = tiny_model("q8_0")
    cfg = CacheConfig(policy="lru", cache_fraction=0.5) if policy == "lru" else \
        CacheConfig(policy="ncmoe", gpu_budget=1 << 30)
    prompt, n_gen = list(range(120, 132)), 24
    other = _prefill_decode_trace(tmp_path / "t.npz", 12, 40, seed=4)
    with _open(model, other, cache=cfg, n_batch=8) as llm:
        plain, plain_rows = _stepped(llm, prompt, n_gen)
    with _open(model, other, cache=cfg, n_batch=8, draft=str(model), draft_k=3) as llm:
        drafted = _greedy(llm, prompt, n_gen)
        s = llm.speculator.stats_json()
        assert llm.replay.check() > 0 and s["verify_passes"] > 0
        assert s["spec_prefetch"] in ("off: routing replayed", "off: no expert cache")
        assert llm.speculator.draft.ctx.capture is None  # no states captured for nothing
    # (k+1 rows in one pass: the same tokens where the CPU's kernels round both alike, as here,
    # else up to a near tie)
    assert_same_tokens(drafted, plain, plain_rows, "other routing")

    own = _own_routing_trace(model, tmp_path / "own.npz", prompt, n_gen)
    with _open(model, None, cache=cfg, n_batch=8) as llm:
        ref, ref_rows = _stepped(llm, prompt, n_gen)
    with _open(model, own, cache=cfg, n_batch=8, draft=str(model), draft_k=3) as llm:
        tokens = _greedy(llm, prompt, n_gen)
        s = llm.speculator.stats_json()
        assert s["accepted"] > s["verify_passes"]  # more than one draft kept a step
    assert_same_tokens(tokens, ref, ref_rows, "own routing")

    with _open(model, other, cache=cfg, n_batch=8, draft=str(model), draft_k=3,
               acceptance_replay="2,0,3") as llm:
        _greedy(llm, prompt, n_gen)
        s = llm.speculator.stats_json()
        assert s["accepted"] == sum((2, 0, 3)[i % 3] for i in range(s["verify_passes"]))
        kept = s["verify_passes"] + s["accepted"] + s["undrafted"]
        assert llm.replay._next[True] == kept


def test_static_under_replay_pins_the_replayed_routings_experts(
        tiny_model: Callable[..., Path], tmp_path: Path) -> None:
    """The static policy's profile is the replayed routing's expert counts, not a calibration
    run of the model's own router."""
    from forecache.llama import Llama
    from forecache.placement.options import CacheConfig

    model = tiny_model("q8_0")
    trace = _prefill_decode_trace(tmp_path / "t.npz", 30, 10, seed=5)
    with Llama.open(model, cache=CacheConfig(policy="static", cache_fraction=0.5), n_ctx=256,
                    n_threads=1, routing_trace=trace) as llm:
        profile = llm.cache_config.profile
        assert profile is not None
        want = llm.replay.routing.counts(llm.model_file.moe_layers(), llm.model_file.n_layer,
                                         llm.model_file.n_expert)
        np.testing.assert_array_equal(profile, want)
    with Llama.open(model, cache=CacheConfig(policy="static", cache_fraction=0.5), n_ctx=256,
                    n_threads=1) as llm:
        assert not np.array_equal(llm.cache_config.profile, want)


def test_default_guard_decides_from_the_replayed_routing(tiny_model: Callable[..., Path],
                                                         tmp_path: Path) -> None:
    """With no policy named, the default placement is estimated from the routing the run
    replays, not from what the model's own router did before."""
    from forecache.cache.budget import split_budget
    from forecache.gguf.header import read_model_file
    from forecache.llama import Llama
    from forecache.native.ggml_devices import cache_device
    from forecache.placement.options import Options

    model = tiny_model("q8_0")
    mf, dev = read_model_file(model), cache_device()
    budget = None
    for mib in range(200, 2048, 2):  # the smallest budget that holds some experts, not all
        try:
            plan = split_budget(mf, mib << 20, n_ctx=256, n_ubatch=512, device_name=dev.name,
                               device_total=dev.memory_total)
        except ValueError:
            continue
        if 0 < plan.ncmoe_cpu_layers() < len(mf.moe_layers()):
            budget = mib << 20
            break
    assert budget is not None
    n_pre, n_dec = 20, 40
    rng = np.random.default_rng(3)
    sticky = np.tile(rng.permutation(N_EXPERT)[:TOP_K].astype(np.int16), (n_pre + n_dec,
                                                                           N_LAYERS, 1))
    phase = np.arange(n_pre + n_dec) >= n_pre
    traces = {"sticky": _write_trace(tmp_path / "sticky.npz", sticky, phase),
              "spread": _prefill_decode_trace(tmp_path / "spread.npz", n_pre, n_dec, seed=4)}
    seen = {}
    for name, trace in traces.items():
        cfg = Options(gpu_budget=budget, machine="rtx4090").cache_config()
        with Llama.open(model, cache=cfg, n_ctx=256, n_threads=1, routing_trace=trace) as llm:
            choice = llm.policy_choice
            assert choice is not None and choice.evidence.source == "replay"
            assert choice.evidence.lookups == n_dec * N_LAYERS * TOP_K
            assert "measured by the routing replayed" in choice.reason()
            seen[name] = choice
    assert seen["sticky"].evidence.locality > seen["spread"].evidence.locality
    assert seen["sticky"].hit > seen["spread"].hit


def test_the_default_takes_prompt_banks_where_they_pay(tiny_model: Callable[[str], Path],
                                                       tmp_path: Path) -> None:
    """The default weighs promoe's placement with prompt banks besides its own (none on a CPU
    build): on a machine whose expert groups are dear and whose CPU is slow, promoe without
    banks would prefill slower than --n-cpu-moe (streamed misses as groups) and with them does
    not, so the run loads with banks and computes its prompt from them. Told no banks, it
    keeps stock's placement, and says the prompt decided."""
    from forecache.cache.budget import split_budget
    from forecache.gguf.header import read_model_file
    from forecache.llama import Llama
    from forecache.native.ggml_devices import cache_device
    from forecache.placement.before import default_choice
    from forecache.placement.options import Options

    base = json.loads((Path(__file__).parents[1] / "forecache" / "data" / "profiles" /
                       "h100-xeon.json").read_text())
    # no fixed costs but an expert group's (10 ms); a CPU at 0.5 GB/s
    base.update(name="dear-groups", gpu_launch_s=0.0, hook_s=0.0, prefetch_hook_s=0.0,
                decode_gate_s=0.0, token_s=0.0, chunk_latency_s=0.0, cpu_launch_s=0.0,
                thread_s=0.0, group_s=0.01, cpu_mem_gbps=0.5, cpu_gflops=1.0, source="a test")
    machine = tmp_path / "dear-groups.json"
    machine.write_text(json.dumps(base))
    model = tiny_model("q8_0")
    mf, dev = read_model_file(model), cache_device()
    n_pre, n_dec = 40, 24
    trace = _prefill_decode_trace(tmp_path / "spread.npz", n_pre, n_dec, seed=5)
    budget = None
    for mib in range(200, 2048, 2):  # the smallest budget at which banks decide
        try:
            plan = split_budget(mf, mib << 20, n_ctx=256, n_ubatch=512, device_name=dev.name,
                               device_total=dev.memory_total)
        except ValueError:
            continue
        if not 0 < plan.ncmoe_cpu_layers() < len(mf.moe_layers()):
            continue
        cfg = Options(gpu_budget=mib << 20, machine=str(machine)).cache_config()
        c = default_choice(mf, cfg, n_ctx=256, n_ubatch=512,
                           routing_hit=lambda n: (n / N_EXPERT, 1000))
        if c is not None and c.policy == "promoe" and c.alternative:
            budget = mib << 20
            break
    assert budget is not None
    cfg = Options(gpu_budget=budget, machine=str(machine)).cache_config()
    with Llama.open(model, cache=cfg, n_ctx=256, n_threads=1, routing_trace=trace) as llm:
        choice = llm.policy_choice
        assert choice is not None and choice.policy == "promoe" and choice.shape.bank
        assert choice.prompt_ratio() >= 1.0 and "with prompt banks" in choice.reason()
        assert llm.placement.bank and llm.cache_config.prompt_bank
        llm.eval(list(range(1, n_pre + 1)))
        assert llm.expert_stats()["banked"] > 0
    told = Options(gpu_budget=budget, machine=str(machine), prompt_bank=False).cache_config()
    with Llama.open(model, cache=told, n_ctx=256, n_threads=1, routing_trace=trace) as llm:
        choice = llm.policy_choice
        assert choice is not None and choice.policy == "ncmoe" and not choice.shape.bank
        assert "the prompt decides" in choice.reason()
        assert llm.placement.host_layers  # stock's placement: whole layers on the host

"""``forecache make-draft``: a MoE model's own first layers as a GGUF of its own, byte for byte; as
a draft for the model its states through the model's routers name exactly the experts the model
routes in those layers, and greedy output is the model's."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from cli_helpers import run_cli

from forecache.generate import SamplingParams, generate, last_logits, text_tokens
from forecache.gguf.header import ModelFile, read_model_file
from forecache.gguf.truncate import (
    FIRST_LAYERS_KEY,
    KEPT_EXPERTS_KEY,
    SOURCE_LAYERS_KEY,
    declared_first_layers,
    layer_of,
    make_draft,
)
from forecache.llama import Llama
from forecache.models.default import REFERENCE_MODEL
from forecache.placement.options import CacheConfig
from forecache.speculative.draft import CrossModelPredictor, DraftContext
from tests.conftest import assert_same_tokens

PROMPT = [7, 99, 23, 5, 301, 4, 1000, 42]
N_GEN = 24


def _bytes(mf: ModelFile, name: str) -> bytes:
    t = next(t for t in mf.tensors if t.name == name)
    path, offset = mf.locate(t)
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(t.nbytes)


def _greedy(model: Path, draft: str | None, prompt: list[int] | str = PROMPT
            ) -> tuple[list[int], dict]:
    cfg = CacheConfig("promoe", cache_fraction=0.5, predictor="history")
    with Llama.open(model, cache=cfg, n_ctx=256, n_threads=2, draft=draft, draft_k=3) as llm:
        res = generate(llm, prompt, N_GEN, SamplingParams(greedy=True), ignore_eos=True)
        return res.tokens, llm.expert_stats()


def _stepped(model: Path, prompt: list[int] | str = PROMPT) -> tuple[list[int], np.ndarray]:
    """The model alone, one row at a time: its greedy tokens and each step's logits (what a
    verification's several rows, which some CPUs' kernels round otherwise, meet up to a near
    tie)."""
    cfg = CacheConfig("promoe", cache_fraction=0.5, predictor="history")
    with Llama.open(model, cache=cfg, n_ctx=256, n_threads=2) as llm:
        llm.eval(text_tokens(llm, prompt) if isinstance(prompt, str) else list(prompt))
        tokens, rows = [], []
        for _ in range(N_GEN):
            rows.append(last_logits(llm))
            tokens.append(int(np.argmax(rows[-1])))
            llm.eval([tokens[-1]])
        return tokens, np.array(rows)


def test_the_copy_is_the_models_first_layers(tiny_model: Callable[..., Path],
                                             tmp_path: Path) -> None:
    """Every tensor outside the blocks and in the first N blocks, byte for byte; the same
    metadata but the layer count and the keys saying what it is; llama.cpp loads it and computes
    the model's own states in those layers."""
    src = tiny_model("q8_0")
    a = read_model_file(src)
    info = make_draft(src, tmp_path / "d.gguf", 2)
    b = read_model_file(info.path)
    assert (info.n_layer, info.source_n_layer, b.n_layer, b.arch) == (2, a.n_layer, 2, a.arch)
    assert declared_first_layers(b.kv) == (2, a.n_layer) == (b.kv[FIRST_LAYERS_KEY],
                                                            b.kv[SOURCE_LAYERS_KEY])
    assert b.moe_layers() == [0, 1] and b.n_expert == a.n_expert
    want = [t.name for t in a.tensors if (layer_of(t.name) or 0) < 2]
    assert [t.name for t in b.tensors] == want and len(want) < len(a.tensors)
    for t in b.tensors:
        s = next(x for x in a.tensors if x.name == t.name)
        assert (t.shape, t.type) == (s.shape, s.type)
        assert _bytes(b, t.name) == _bytes(a, t.name), t.name
    changed = {f"{a.arch}.block_count"}
    assert {k: v for k, v in a.kv.items() if k not in changed} == \
        {k: v for k, v in b.kv.items() if k not in changed and not k.startswith("forecache.draft")}
    assert a.array_lengths == b.array_lengths  # the vocabulary and merges, whole
    # llama.cpp: the draft's states are the model's, layer for layer
    states = []
    for path in (src, info.path):
        ctx = DraftContext(path, n_ctx=64, n_batch=16, n_threads=2, capture=True)
        try:
            ctx.sync(PROMPT)
            states.append([ctx.state(il) for il in range(2)])
            if path == info.path:
                assert ctx.n_layer == 2 and ctx.source_layers == a.n_layer
            else:
                assert ctx.source_layers is None
        finally:
            ctx.close()
    for x, y in zip(*states, strict=True):
        assert x is not None and np.array_equal(x, y)


def test_a_split_model_gives_the_same_draft(tmp_path: Path) -> None:
    """A split source (make-model's split files) gives the draft its one file gives."""
    from forecache.gguf.maker import make_model

    one = make_model(tmp_path / "m.gguf", "tiny", "q8_0", seed=3, workers=1).path
    split = make_model(tmp_path / "s.gguf", "tiny", "q8_0", seed=3, workers=1,
                       split_max_tensors=20).shards[0]
    assert read_model_file(split).is_split
    a = make_draft(one, tmp_path / "a.gguf", 3).path
    b = make_draft(split, tmp_path / "b.gguf", 3).path
    ma, mb = read_model_file(a), read_model_file(b)
    assert [t.name for t in ma.tensors] == [t.name for t in mb.tensors]
    assert all(_bytes(ma, t.name) == _bytes(mb, t.name) for t in ma.tensors)
    assert not any(k.startswith("split.") for k in mb.kv)


def test_the_predictor_maps_own_layers_one_to_one(tiny_model: Callable[..., Path]) -> None:
    """A draft declaring the model's first N layers is read layer for layer, the deeper layers
    from its last; one trained apart (or cut from a model of another depth) at relative depth."""
    mf = read_model_file(tiny_model("q8_0"))
    n, k = mf.n_layer, mf.n_expert_used

    def source(draft_layers: int, **kw: int) -> dict[int, int]:
        return CrossModelPredictor(mf, mf.moe_layers(), n, k, draft_layers, **kw).source

    assert source(1, source_layers=n) == {il: 0 for il in range(n)}
    assert source(2, source_layers=n) == {0: 0, 1: 1, 2: 1, 3: 1}
    relative = {il: min(round(il * 2 / n), 1) for il in range(n)}
    assert source(2) == relative and source(2, source_layers=2 * n) == relative


def test_the_drafts_states_name_the_experts_the_model_routes(
        tiny_model: Callable[..., Path], tmp_path: Path) -> None:
    """In the layers the draft covers, its states through the model's routers name exactly the
    experts the model routes (prefetch precision and recall 1.0 there), token after token."""
    src = tiny_model("q8_0")
    mf = read_model_file(src)
    draft = make_draft(src, tmp_path / "d.gguf", 2).path
    routed: dict[int, set[int]] = {}

    def on_route(layer: int, ids: np.ndarray, _w: object, _x: object) -> None:
        routed[layer] = {int(e) for e in ids[-1]}

    cfg = CacheConfig("promoe", cache_fraction=0.5, predictor="history", on_route=on_route)
    ctx = DraftContext(draft, n_ctx=64, n_batch=16, n_threads=2, capture=True)
    try:
        pred = CrossModelPredictor(mf, mf.moe_layers(), mf.n_layer, mf.n_expert_used,
                                   ctx.n_layer, source_layers=ctx.source_layers)
        assert pred.own_layers and pred.width() == ctx.n_embd
        with Llama.open(src, cache=cfg, n_ctx=64, n_threads=2) as llm:
            compared = differ = 0
            for i, t in enumerate(PROMPT * 2):
                routed.clear()
                llm.eval([t])
                if i:
                    ctx.step(t)
                else:
                    ctx.sync([t])
                for il in (0, 1):
                    state = ctx.state(pred.source[il])
                    assert state is not None
                    differ += set(pred.predict(il, state)) != routed[il]
                    compared += 1
        assert compared == 2 * 2 * len(PROMPT)
        # the same states through the same routers: every token's experts, but where a CPU's
        # kernels round the model's expert products (from slots) otherwise than the draft's
        # and flip a router's near tie (AMX's tiles), one at most
        assert differ <= 1, differ
    finally:
        ctx.close()


def test_as_a_draft_greedy_output_is_the_models(tiny_model: Callable[..., Path],
                                                tmp_path: Path) -> None:
    """Through ``--draft``: the same greedy tokens; the prefetch is as precise as the model
    drafting for itself with every layer, and better than chance with the first half."""
    src = tiny_model("q8_0")
    plain, rows = _stepped(src)
    n = read_model_file(src).n_layer
    precision = {}
    for layers in (n // 2, n):
        draft = make_draft(src, tmp_path / f"first{layers}.gguf", layers).path
        tokens, stats = _greedy(src, str(draft))
        # (k+1 rows in one pass: the same tokens where the CPU rounds both alike, as here, else
        # up to a near tie)
        assert_same_tokens(tokens, plain, rows, f"first {layers}")
        assert stats["draft"] == draft.name and stats["verify_passes"] > 0
        precision[layers] = stats["prefetch_precision"]
        assert precision[layers] > stats["prefetch_precision_chance"]
    assert precision[n] > 0.95  # a rounding flip of a router's near tie at most
    assert precision[n // 2] < precision[n]


@pytest.mark.skipif(not REFERENCE_MODEL.is_file(), reason="reference model not in this checkout")
def test_the_reference_models_first_layers_draft_for_it(tmp_path: Path) -> None:
    """On the trained reference model: the same greedy tokens, drafts accepted, and a prefetch
    well above chance (the trained draft made apart barely passes it)."""
    plain, rows = _stepped(REFERENCE_MODEL, "In the beginning God created the heaven")
    draft = make_draft(REFERENCE_MODEL, tmp_path / "ref-first4.gguf", 4).path
    tokens, stats = _greedy(REFERENCE_MODEL, str(draft), "In the beginning God created the heaven")
    assert_same_tokens(tokens, plain, rows, "reference, first 4")
    assert stats["prefetch_precision"] > stats["prefetch_precision_chance"] + 0.2


def test_experts_kept_by_the_routing_profile(tiny_model: Callable[..., Path],
                                             tmp_path: Path) -> None:
    """``--experts M``: each layer keeps M experts, its router rows and expert slices byte for
    byte; llama.cpp loads it and, as a draft, the output is still the model's."""
    src = tiny_model("q8_0")
    a = read_model_file(src)
    out = tmp_path / "e.gguf"
    res = run_cli("make-draft", str(src), str(out), "--layers", "2", "--experts", "6")
    assert res.returncode == 0, res.stderr
    b = read_model_file(out)
    assert b.n_expert == 6 and b.n_layer == 2 and b.n_expert_used == a.n_expert_used
    kept = np.array(b.kv[KEPT_EXPERTS_KEY]).reshape(2, 6)
    assert all(list(row) == sorted(set(row)) for row in kept)
    for il in range(2):
        for t in a.tensors:
            if not t.name.startswith(f"blk.{il}.") or t.shape[-1] != a.n_expert or \
                    "shexp" in t.name:
                continue
            per = t.nbytes // a.n_expert
            whole = _bytes(a, t.name)
            assert _bytes(b, t.name) == b"".join(whole[e * per:(e + 1) * per]
                                                 for e in kept[il]), t.name
    tokens, stats = _greedy(src, str(out))
    assert_same_tokens(tokens, *_stepped(src), "2 layers, 6 experts")
    assert stats["verify_passes"] > 0


def test_bad_input_is_one_line(tiny_model: Callable[..., Path], tmp_path: Path) -> None:
    import gguf

    src = str(tiny_model("q8_0"))
    dense = tmp_path / "dense.gguf"
    w = gguf.GGUFWriter(str(dense), "llama")
    w.add_block_count(1)
    w.add_embedding_length(8)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    exists = tmp_path / "exists.gguf"
    exists.write_bytes(b"x")
    cases = [
        ([str(dense), str(tmp_path / "o.gguf"), "--layers", "1"], "not a Mixture-of-Experts"),
        ([src, str(tmp_path / "o.gguf"), "--layers", "0"], "--layers 0: "),
        ([src, str(tmp_path / "o.gguf"), "--layers", "5"], "has 4 layers; give 1 to 4"),
        ([src, str(exists), "--layers", "1"], "exists; pass --force"),
        ([src, src, "--layers", "1", "--force"], "is the model itself"),
        ([src, str(tmp_path / "o.gguf"), "--layers", "1", "--experts", "2"], "keep 4 to 16"),
        ([str(tmp_path / "missing.gguf"), str(tmp_path / "o.gguf"), "--layers", "1"],
         "not found"),
    ]
    for args, want in cases:
        res = run_cli("make-draft", *args)
        assert res.returncode == 1 and want in res.stderr, (args, res.stderr)
        assert len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert exists.read_bytes() == b"x" and not (tmp_path / "o.gguf").exists()
    assert not list(tmp_path.glob(".*.partial"))


def test_a_draft_is_read_layer_for_layer_beside_its_own_model_only(
        tiny_model: Callable[..., Path], tmp_path: Path) -> None:
    """The draft carries its source's fingerprint: beside another model of the same shape and
    vocabulary (other weights) it is read as a draft trained apart, at relative depth, and the
    stats say why."""
    from forecache.gguf.maker import make_model

    src = tiny_model("q8_0")
    other = make_model(tmp_path / "other.gguf", "tiny", "q8_0", seed=7, workers=1).path
    draft = make_draft(src, tmp_path / "d.gguf", 2).path
    cfg = CacheConfig("promoe", cache_fraction=0.5, predictor="history")
    seen = {}
    for model in (src, other):
        with Llama.open(model, cache=cfg, n_ctx=64, n_threads=2, draft=str(draft),
                        draft_k=2) as llm:
            d = llm.speculator.draft
            assert d.predictor is not None
            seen[model] = (d.predictor.own_layers, d.prefetch_mode)
    assert seen[src] == (True, "cross-model")
    assert seen[other][0] is False and "cut from another model" in seen[other][1]

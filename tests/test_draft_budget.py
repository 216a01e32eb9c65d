"""A draft model's context is paid for out of the device budget, as the model's own buffers
are: stock's --n-cpu-moe placement and forecache's slots alike, so that a drafted run and its
baseline share the same memory."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from forecache.cache.budget import BudgetError, draft_device_bytes, draft_ubatch, kv_cache_bytes
from forecache.gguf.header import read_model_file
from forecache.llama import Llama
from forecache.placement.options import CacheConfig


@pytest.fixture(scope="module")
def draft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny preset with other weights: a draft with the tiny model's vocabulary."""
    from forecache.gguf.maker import make_model

    path = tmp_path_factory.mktemp("draft") / "tiny-seed2.gguf"
    make_model(path, "tiny", "q8_0", seed=2, workers=1)
    return path


def test_the_draft_is_weighed_whole(draft: Path) -> None:
    """Its weights, its KV cache and a ubatch's compute buffers, each growing with its own
    measure; its ubatch is small (it decodes a token at a time), whatever the model's."""
    mf = read_model_file(draft)
    small = draft_device_bytes(mf, 256, 32)
    assert small > mf.total_bytes() + kv_cache_bytes(mf, 256)
    assert draft_device_bytes(mf, 512, 32) - small == kv_cache_bytes(mf, 256)
    assert draft_device_bytes(mf, 256, 64) > small
    assert draft_ubatch(512) == draft_ubatch(4096) < 512 and draft_ubatch(8) == 8


@pytest.mark.parametrize("policy", ["lru", "ncmoe"])
def test_the_budget_pays_for_the_draft(tiny_model: Callable[[str], Path], draft: Path,
                                       policy: str) -> None:
    """With a draft model the same budget leaves fewer expert slots (lru) or more host layers
    (ncmoe); a budget the draft does not fit is refused in one line that names it."""
    model = tiny_model("q8_0")
    mf = read_model_file(model)
    n_ctx = 256
    need = draft_device_bytes(read_model_file(draft), n_ctx, draft_ubatch(512))
    plain = Llama.open(model, cache=CacheConfig(policy, gpu_budget=1 << 30), n_ctx=n_ctx,
                       n_threads=1)
    fixed = plain.placement.memory.fixed_bytes
    plain.close()
    # the budget that holds every expert without the draft, and about half of them with it
    budget = fixed + need + mf.total_expert_bytes() // 2
    runs = {}
    for d in (None, str(draft)):
        with Llama.open(model, cache=CacheConfig(policy, gpu_budget=budget), n_ctx=n_ctx,
                        n_threads=1, draft=d) as llm:
            mem = llm.placement.memory
            runs[d] = (mem, sum(llm.placement.n_slots), len(llm.placement.host_layers))
    (m0, slots0, host0), (m1, slots1, host1) = runs[None], runs[str(draft)]
    assert m0.draft_bytes == 0 and m1.draft_bytes == need
    assert m1.expert_budget == m0.expert_budget - need
    if policy == "lru":
        assert slots1 < slots0
    else:
        assert host1 > host0
    with pytest.raises(BudgetError, match="the draft model"):
        Llama.open(model, cache=CacheConfig(policy, gpu_budget=fixed + need // 2), n_ctx=n_ctx,
                   n_threads=1, draft=str(draft))


def test_a_dense_draft_is_weighed_by_its_rows(tmp_path: Path) -> None:
    """A dense draft (make-model's tiny-draft) holds a ubatch's logits and activation rows, not
    a MoE model's compute reserve: a few MiB at its 64-row ubatch."""
    from forecache.gguf.maker import make_model

    path = make_model(tmp_path / "d.gguf", "tiny-draft", "q8_0", workers=1).path
    mf = read_model_file(path)
    assert not mf.is_moe
    rows = draft_device_bytes(mf, 256, 64) - draft_device_bytes(mf, 256, 32)
    n_embd, n_ff = int(mf.arch_kv("embedding_length")), int(mf.arch_kv("feed_forward_length"))
    assert rows == 32 * (mf.n_vocab * 4 + max(n_ff, n_embd) * 8)
    assert draft_device_bytes(mf, 256, 64) < mf.total_bytes() + kv_cache_bytes(mf, 256) + (8 << 20)

"""Micro-batches over one expert cache (forecache.micro): contexts attached to the cache compute
their long ubatches' bank layers from its prompt banks, and a round's passes, each on a thread of
its own, share every bank fill. Counted and compared, not timed: they hold on every CPU."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest

from forecache.cache.runtime import CacheError
from forecache.generate import last_logits, text_tokens
from forecache.gguf.header import read_model_file
from forecache.llama import Llama
from forecache.micro import Sibling, run_round
from forecache.placement.options import CacheConfig

if TYPE_CHECKING:
    from conftest import StockReference

N_CTX, N_BATCH = 512, 128


def _decode(ctx: int, tokens: list[int]) -> Callable[[], int]:
    """A job for run_round: ``tokens`` as one batch from position 0 of sequence 0 of ``ctx``
    (its KV cleared first), logits for the last."""
    from llama_cpp import llama_cpp as low

    def job() -> int:
        low.llama_memory_clear(low.llama_get_memory(ctx), True)
        batch = low.llama_batch_init(len(tokens), 0, 1)
        try:
            for i, t in enumerate(tokens):
                batch.token[i] = t
                batch.pos[i] = i
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = i == len(tokens) - 1
            batch.n_tokens = len(tokens)
            return int(low.llama_decode(ctx, batch))
        finally:
            low.llama_batch_free(batch)

    return job


def _logits(ctx: int, n_vocab: int) -> np.ndarray:
    from llama_cpp import llama_cpp as low

    return np.ctypeslib.as_array(low.llama_get_logits_ith(ctx, -1), shape=(n_vocab,)).copy()


def _prompts(llm: Llama) -> list[list[int]]:
    texts = ["Pack my box with five dozen liquor jugs. " * 12,
             "The quick brown fox jumps over the lazy dog. " * 12]
    return [text_tokens(llm, t)[:96] for t in texts]


def test_a_round_shares_each_bank_fill(tiny_model: Callable[[str], Path],
                                       stock: StockReference) -> None:
    """Two contexts over one cache, each computing a prompt ubatch on its own thread, go through
    each bank layer together: every layer's bank is filled once for both (the other pass reads
    it: ``shared``), half the bytes of the same passes one after another, and each context's
    logits equal its prompt's computed alone, and the unpatched build's."""
    model = tiny_model("q8_0")
    mf = read_model_file(model)
    n_slots = mf.n_expert - 2
    cfg = CacheConfig("lru", slots_per_layer=n_slots, prompt_bank=True)
    with Llama.open(model, n_ctx=N_CTX, n_batch=N_BATCH, n_threads=2, cache=cfg) as llm:
        cache = llm.expert_cache
        assert cache is not None and cache.bank_tokens == 32
        prompts = _prompts(llm)
        assert all(len(p) == 96 for p in prompts)
        n_vocab = llm.n_vocab()
        alone = []
        for p in prompts:  # the first fills the empty slots; the second finds them full
            assert run_round(cache, [(llm.ctx, _decode(llm.ctx, p))]) == [0]
            alone.append(_logits(llm.ctx, n_vocab))
        last = max(cache.layers)  # computes the output row only: routed as in decode
        banked = [il for il in cache.layers if il != last]
        llm.reset_stats()
        assert run_round(cache, [(llm.ctx, _decode(llm.ctx, prompts[0]))]) == [0]
        one = {il: cache.stats(il) for il in banked}
        for il in banked:  # a pass fills each layer's bank with the experts its slots lack
            s = one[il]
            info = cache.layers[il]
            assert s["banked"] == 1 and s["shared"] == 0, (il, s)
            assert s["bank_bytes"] == (info.n_expert - n_slots) * info.expert_bytes, (il, s)
        with Sibling(llm) as sib:
            assert sib.ctx is not None
            for _ in range(2):  # the second round reuses the graphs
                llm.reset_stats()
                rcs = run_round(cache, [(llm.ctx, _decode(llm.ctx, prompts[0])),
                                        (sib.ctx, _decode(sib.ctx, prompts[1]))])
                assert rcs == [0, 0]
                assert np.array_equal(_logits(llm.ctx, n_vocab), alone[0])
                assert np.array_equal(_logits(sib.ctx, n_vocab), alone[1])
                for il in banked:
                    s = cache.stats(il)
                    assert s["banked"] == 1 and s["shared"] == 1, (il, s)
                    assert s["bank_bytes"] == one[il]["bank_bytes"], (il, s)
                    assert s["readbacks"] == 0 and s["hook_calls"] == 0, (il, s)
            # the other context's prompt alone, then the cache's, as the round had them
            llm.reset_stats()
            assert run_round(cache, [(sib.ctx, _decode(sib.ctx, prompts[0]))]) == [0]
            assert np.array_equal(_logits(sib.ctx, n_vocab), alone[0])
            assert run_round(cache, [(llm.ctx, _decode(llm.ctx, prompts[1]))]) == [0]
            assert np.array_equal(_logits(llm.ctx, n_vocab), alone[1])
            assert all(cache.stats(il)["banked"] == 2 for il in banked)
    ref = stock.run(model, prompts, 1, n_ctx=N_CTX, n_batch=N_BATCH, n_threads=2)
    if stock.backend == "cpu":
        for got, (_, ref_logits) in zip(alone, ref, strict=True):
            assert np.array_equal(got, ref_logits[0])


def test_a_short_ubatch_beside_a_round(tiny_model: Callable[[str], Path]) -> None:
    """A context's pass that banks nothing (fewer rows than the banks ask) takes its place in the
    round: an attached context's is stock llama.cpp's, beside the cache's bank pass; the cache's
    own waits for the round's bank passes to end. Both compute what they compute alone."""
    model = tiny_model("q8_0")
    mf = read_model_file(model)
    cfg = CacheConfig("lru", slots_per_layer=mf.n_expert - 2, prompt_bank=True)
    with Llama.open(model, n_ctx=N_CTX, n_batch=N_BATCH, n_threads=2, cache=cfg) as llm:
        cache = llm.expert_cache
        assert cache is not None
        long, short = _prompts(llm)[0], _prompts(llm)[1][:8]
        n_vocab = llm.n_vocab()
        alone = []
        for p in (long, short):
            assert run_round(cache, [(llm.ctx, _decode(llm.ctx, p))]) == [0]
            alone.append(_logits(llm.ctx, n_vocab))
        with Sibling(llm) as sib:
            assert sib.ctx is not None
            for a, b in ((llm.ctx, sib.ctx), (sib.ctx, llm.ctx)):
                llm.reset_stats()
                assert run_round(cache, [(a, _decode(a, long)), (b, _decode(b, short))]) == [0, 0]
                assert np.array_equal(_logits(a, n_vocab), alone[0])
                assert np.array_equal(_logits(b, n_vocab), alone[1])
                assert cache.stats()["shared"] == 0


def test_attach_refuses_what_it_cannot_serve(tiny_model: Callable[[str], Path]) -> None:
    """An attached context reads the banks only: a cache without them refuses it, with the fix."""
    model = tiny_model("q8_0")
    mf = read_model_file(model)
    cfg = CacheConfig("lru", slots_per_layer=mf.n_expert - 2, prompt_bank=False)
    with Llama.open(model, n_ctx=N_CTX, n_batch=N_BATCH, n_threads=2, cache=cfg) as llm:
        with pytest.raises(ValueError, match="prompt_bank=True"):
            Sibling(llm)
        cache = llm.expert_cache
        assert cache is not None
        with pytest.raises(CacheError, match="already reads this cache"):
            cache.attach(llm.ctx)
        from llama_cpp import llama_cpp as low

        other = low.llama_init_from_model(llm.model, llm.context_params)
        try:
            with pytest.raises(CacheError, match="set them first"):
                cache.attach(other)
        finally:
            low.llama_free(other)
        # a round of one context is a plain pass
        p = _prompts(llm)[0]
        assert run_round(cache, [(llm.ctx, _decode(llm.ctx, p))]) == [0]
        assert np.isfinite(last_logits(llm)).all()


def test_a_batch_job_in_micro_batches(tiny_model: Callable[[str], Path]) -> None:
    """decode_many(micro=M) feeds the prompts in M-1 contexts of their own and moves each
    sequence to the decoding context once its prompt is in: a step's prompt ubatches and
    decoding ubatch go through each layer together, one bank fill serving them, and every
    request's text is the one the job decodes in one context."""
    from forecache.batch import decode_many
    from forecache.generate import SamplingParams
    from forecache.jobs.requests import Request

    model = tiny_model("q8_0")
    mf = read_model_file(model)
    greedy = SamplingParams(greedy=True, temperature=0.0)
    words = ["pack", "my", "box", "with", "five", "dozen", "liquor", "jugs"]
    n_parallel = 48  # the decoding ubatch long enough for the banks (32 rows) beside a prompt
    reqs = [Request(id=f"r{i}", line=i + 1,
                    prompt=" ".join(words[(i + j) % 8] for j in range(30 + 5 * (i % 7))),
                    max_tokens=24 + 3 * (i % 5), sampling=greedy) for i in range(80)]
    cfg = CacheConfig("lru", slots_per_layer=mf.n_expert - 2, prompt_bank=True)
    texts = []
    with Llama.open(model, n_ctx=128, n_seq_max=n_parallel, n_batch=256, n_ubatch=128,
                    n_threads=2, cache=cfg, micro=3) as llm:
        cache = llm.expert_cache
        assert cache is not None
        for micro in (1, 2, 3):
            llm.reset_stats()
            done: list[dict] = []
            decode_many(llm, reqs, n_parallel, done.append, micro=micro)
            assert sorted(r["id"] for r in done) == sorted(r.id for r in reqs)
            assert all(r["finish_reason"] == "length" for r in done), done
            texts.append({r["id"]: r["text"] for r in done})
            shared = cache.stats()["shared"]
            assert (shared > 0) == (micro > 1), shared
        with pytest.raises(ValueError, match="micro=5"):
            decode_many(llm, reqs, n_parallel, done.append, micro=5)
        # a context the budget did not pay for
        with pytest.raises(ValueError, match="open it with micro=4"):
            decode_many(llm, reqs, n_parallel, done.append, micro=4)
    assert texts[0] == texts[1] == texts[2]


def test_a_job_with_a_micro_plan(tiny_model: Callable[[str], Path], tmp_path: Path) -> None:
    """run_job (forecache batch) runs a plan of micro=2 with the prompt banks it needs: the same
    records as the plan without it, and the summary names the plan."""
    import json

    from forecache.jobs.plan import plan_cache
    from forecache.jobs.run import run_job
    from forecache.roofline.batch import BatchPlan

    model = tiny_model("q8_0")
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": f"q{i}", "prompt": "five dozen jugs " * (12 + i % 8),
                                       "max_tokens": 20 + i, "temperature": 0}) + "\n"
                           for i in range(40)))
    texts = []
    for micro in (1, 2):
        plan = BatchPlan(36, 128, micro=micro)
        cfg = plan_cache(CacheConfig("lru", cache_fraction=0.75), plan)
        assert cfg is not None and (cfg.prompt_bank is True) == (micro == 2)
        out = tmp_path / f"out{micro}.jsonl"
        res = run_job(model, src, out, cache=cfg, plan=plan, ctx_per_seq=192, n_threads=2)
        assert res.done == 40 and res.failed == 0
        assert f"plan {plan.label(res.cpu_only)};" in res.summary()
        texts.append([json.loads(line)["text"] for line in out.read_text().splitlines()])
    assert texts[0] == texts[1]


def test_the_budget_pays_for_the_prompts_contexts(tiny_model: Callable[[str], Path]) -> None:
    """A model opened for micro-batches pays, out of its budget, each prompt context's compute
    buffers and its KV cache where the KV cache lives (on the device unless offload_kqv is
    off), as the roofline prices a micro plan: fewer slots than the same budget for one
    context."""
    from forecache.cache.budget import kv_cache_bytes, model_compute_bytes, split_budget
    from forecache.roofline.batch import prefill_seqs

    model = tiny_model("q8_0")
    mf = read_model_file(model)
    per_seq, n_seq = 64, 8
    q = prefill_seqs(n_seq, 3)
    fixed = split_budget(mf, 1 << 40, n_ctx=per_seq * n_seq, n_ubatch=64, device_name="x",
                         device_total=1 << 50, contexts=[per_seq * q] * 2).fixed_bytes
    budget = fixed + sum(mf.layer_expert_bytes()) * (mf.n_expert // 2)

    def memory(micro: int, offload_kqv: bool = True) -> object:
        cfg = CacheConfig("lru", gpu_budget=budget, prompt_bank=True)
        with Llama.open(model, cache=cfg, n_ctx=per_seq, n_seq_max=n_seq, n_batch=64,
                        n_ubatch=64, n_threads=2, micro=micro, offload_kqv=offload_kqv) as llm:
            assert llm.placement is not None and llm.placement.memory is not None
            return llm.placement.memory, sum(llm.placement.n_slots)

    (one, slots1), (three, slots3) = memory(1), memory(3)
    assert one.kv_bytes == kv_cache_bytes(mf, per_seq * n_seq)
    assert three.kv_bytes == one.kv_bytes + 2 * kv_cache_bytes(mf, per_seq * q)
    assert three.compute_bytes == 3 * one.compute_bytes == 3 * model_compute_bytes(mf, 64)
    assert slots3 < slots1
    host, _ = memory(3, offload_kqv=False)  # the KV caches in host memory
    assert host.kv_bytes == 0 and host.compute_bytes == three.compute_bytes

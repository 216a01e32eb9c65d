"""Lossless against the unpatched llama-cpp-python of the same sdist (``forecache build
--reference``), not against forecache's own build with its hooks off: every policy, six weight
types (llama.cpp's Q4_K_M mix, with experts of two sizes, among them), qwen2moe, qwen3moe, llama
(Mixtral), olmoe, granitemoe, deepseek2 (and its fused gate/up experts), gpt-oss and lfm2moe,
n_batch > n_ubatch, prompts longer than 512 tokens, and batch jobs. On a GPU build a run may
compute experts on the host (ncmoe's decode, a cache's host layers) with llama.cpp's CPU kernels,
so its logits may differ from the all-GPU reference by stock llama.cpp's own CPU-vs-GPU difference
for that prompt, which is measured (``_device_diffs``) and allowed.

The reference loads as forecache's policies do, with CPU weight repacking off (use_extra_bufts =
false); test_default_placement covers llama.cpp's default (repacking) placement. On a CPU build
tokens and logits are bit-identical; on a GPU build (the GPU check runs these tests there), where
the reference computes every expert on the GPU and offload on the CPU, equal up to rounding.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest
from cli_helpers import run_cli
from conftest import ROUNDING, assert_same_greedy
from stock_runner import greedy

from forecache.cache.budget import split_budget
from forecache.cache.prefetcher import Features
from forecache.gguf.header import read_model_file
from forecache.llama import Llama
from forecache.placement.options import CacheConfig

if TYPE_CHECKING:
    from conftest import StockReference

N_GEN = 12
# n_batch > n_ubatch: a 700-token prompt is one 700-token batch of three ubatches, the first two
# of which ask for no output (llama.cpp then routes no tokens through the last layer).
PARAMS = {"n_ctx": 2048, "n_batch": 1024, "n_ubatch": 256, "n_threads": 2}
PROMPT_LENS = (1, 300, 700)
TEXT = "The quick brown fox jumps over the lazy dog, again and again. "


def _prompts(llm: Llama) -> list[list[int]]:
    text = llm.tokenize((TEXT * 120).encode())
    assert len(text) >= max(PROMPT_LENS)
    return [text[:n] for n in PROMPT_LENS]


def _ncmoe(model: Path, host_layers: int, n_ubatch: int = PARAMS["n_ubatch"]) -> CacheConfig:
    """ncmoe with a budget that leaves ``host_layers`` MoE layers' experts on the host."""
    mf = read_model_file(model)
    plan = split_budget(mf, 1 << 40, n_ctx=PARAMS["n_ctx"], n_ubatch=n_ubatch,
                       device_name="x", device_total=1 << 50)
    return CacheConfig("ncmoe", gpu_budget=plan.ncmoe_budget(host_layers))


def _configs(model: Path) -> list[CacheConfig]:
    return [CacheConfig("offload"), _ncmoe(model, 2)] + [
        CacheConfig(pol, cache_fraction=0.5) for pol in ("lru", "static", "promoe")]


@pytest.mark.parametrize(("preset", "qtype"), [
    ("tiny", "f16"), ("tiny", "q4_0"), ("tiny", "q4_k"), ("tiny", "q8_0"), ("tiny", "q4_k_m"),
    ("tiny-qwen3moe", "q8_0"), ("tiny-qwen3moe", "q4_k"),
    ("tiny-mixtral", "q8_0"), ("tiny-mixtral", "q4_k_m"),
    ("tiny-olmoe", "q8_0"), ("tiny-olmoe", "q4_k"),
    ("tiny-granitemoe", "q8_0"), ("tiny-granitemoe", "q4_k"),
    ("tiny-deepseek2", "q8_0"), ("tiny-deepseek2", "q4_k"),
    ("tiny-gpt-oss", "q8_0"), ("tiny-gpt-oss", "mxfp4"),
    ("tiny-lfm2moe", "q8_0"), ("tiny-lfm2moe", "q4_k_m")])
def test_every_policy_equals_unpatched(preset: str, qtype: str,
                                       tiny_model: Callable[..., Path],
                                       stock: StockReference) -> None:
    _every_policy(tiny_model(qtype, preset), f"{preset} {qtype}", stock)


def test_fused_gate_up_experts_equal_unpatched(tiny_model: Callable[..., Path],
                                               stock: StockReference, tmp_path: Path) -> None:
    """Gate and up experts in one tensor (two projections an expert, not three): every policy,
    and promoe splitting layers between slots and host experts against a slow bus."""
    slow = json.loads((Path(__file__).parents[1] / "forecache" / "data" / "profiles" /
                       "rtx4090.json").read_text())
    machine = tmp_path / "slow-bus.json"
    machine.write_text(json.dumps(dict(slow, name="slow-bus", h2d_gbps=0.01, cpu_mem_gbps=0.1)))
    model = tiny_model("q8_0", "tiny-deepseek2", fuse_gate_up=True)
    assert len(read_model_file(model).expert_tensors(1)) == 2
    stats = _every_policy(model, "fused", stock, [CacheConfig(
        "promoe", cache_fraction=0.25, predictor="history", machine=str(machine))])
    assert stats["host_entries"] > 0 and stats["hits"] > 0


def _greedy_texts(model: Path, cfg: CacheConfig, requests: list[dict],
                  prompts: list[list[int]]) -> dict[str, str]:
    """Each request's 8 greedy tokens' text from forecache.Llama under ``cfg``, loaded as
    `forecache batch --parallel 1` loads it (n_batch = n_ubatch = 512, two threads)."""
    with Llama(str(model), cache=cfg, n_ctx=2048, n_batch=512, n_ubatch=512, n_threads=2,
               n_threads_batch=2, verbose=False) as llm:
        return {r["id"]: llm.detokenize(greedy(llm, p, 8)[0]).decode(errors="replace")
                for r, p in zip(requests, prompts, strict=True)}


def _assert_text_near_tie(text: str, steps: list[str], logits: np.ndarray, where: str) -> None:
    """``text`` is the reference's (``steps``: its text after each greedy step) up to the step
    at which it departs, which must be a near tie of the reference's logits there."""
    for i, ref in enumerate(steps):
        if not text.startswith(ref):
            top2 = np.sort(logits[i])[-2:]
            assert top2[1] - top2[0] <= ROUNDING * float(np.ptp(logits[i])), \
                f"{where}: departs from the unpatched text at step {i}, not a near tie"
            return
    assert text == steps[-1], f"{where}: {text!r} runs on past {steps[-1]!r}"


def _device_diffs(model: Path, prompts: list[list[int]],
                  ref: list[tuple[list[int], np.ndarray]]) -> list[float]:
    """Per prompt, how far stock llama.cpp's prompt logits move when it computes every expert on
    the CPU (host experts, op offload off, no forecache hook) instead of on the GPU as the
    reference does: the kernels' own difference, which a run computing experts on the host
    (ncmoe's decode, a cache's host layers) inherits. Tiny random models amplify it: 25% of the
    spread on tiny-mixtral q8_0 and 9% on tiny-gpt-oss q8_0 on an H200, under 1% elsewhere."""
    with Llama(str(model), cache=CacheConfig("offload"), verbose=False, op_offload=False,
               **PARAMS) as llm:
        return [float(np.max(np.abs(greedy(llm, p, 1)[1][0] - r[1][0])))
                for p, r in zip(prompts, ref, strict=True)]


def _every_policy(model: Path, where: str, stock: StockReference,
                  extra: list[CacheConfig] | None = None) -> dict:
    """Each policy's greedy tokens and logits are the unpatched build's; the last run's stats."""
    ref: list[tuple[list[int], np.ndarray]] | None = None
    device = [0.0] * len(PROMPT_LENS)
    stats: dict = {}
    for cfg in _configs(model) + (extra or []):
        with Llama(str(model), cache=cfg, verbose=False, **PARAMS) as llm:
            prompts = _prompts(llm)
            if ref is None:
                ref = stock.run(model, prompts, N_GEN, **PARAMS)
                if stock.backend != "cpu":
                    device = _device_diffs(model, prompts, ref)
            for n, p, (ref_tokens, ref_logits), dev in zip(PROMPT_LENS, prompts, ref, device,
                                                           strict=True):
                tokens, logits = greedy(llm, p, N_GEN)
                assert_same_greedy(tokens, logits, ref_tokens, ref_logits,
                                   f"{where} {cfg.policy} prompt={n}", stock.backend == "cpu",
                                   device_diff=dev)
            cache = llm.expert_cache
            stats = dict(llm.expert_stats(), **(cache.stats() if cache is not None else {}))
        if cfg.cache_fraction is not None:
            assert stats["cache_slots"] > 0 and stats["hits"] > 0, (where, cfg.policy)
    return stats


def test_gathered_prompt_groups_equal_unpatched(tiny_model: Callable[..., Path],
                                                stock: StockReference) -> None:
    """promoe whose prompt-sized ubatches compute experts in groups of at least 8 entries while
    more copies can land (Features.prompt_gather): the unpatched build's tokens and logits, with
    half the experts in slots and with a quarter (slots streamed within a ubatch, where a copy
    waits for a slot the group being gathered would free: the wait must end, not hang)."""
    model = tiny_model("q8_0")
    for fraction in (0.5, 0.25):
        cfg = CacheConfig("promoe", cache_fraction=fraction, features=Features(prompt_gather=8))
        with Llama(str(model), cache=cfg, verbose=False, **PARAMS) as llm:
            prompts = _prompts(llm)
            ref = stock.run(model, prompts, N_GEN, **PARAMS)
            for p, (ref_tokens, ref_logits) in zip(prompts, ref, strict=True):
                tokens, logits = greedy(llm, p, N_GEN)
                assert_same_greedy(tokens, logits, ref_tokens, ref_logits,
                                   f"gathered groups at {fraction}", stock.backend == "cpu")
            assert llm.expert_cache is not None
            st = llm.expert_cache.stats()
            assert st["n_groups"] > 0 and (fraction > 0.25 or st["streamed"] > 0), st


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen3moe", "tiny-mixtral", "tiny-olmoe",
                                    "tiny-granitemoe", "tiny-deepseek2", "tiny-gpt-oss",
                                    "tiny-lfm2moe"])
def test_batch_jobs_equal_unpatched(preset: str, tiny_model: Callable[..., Path],
                                    stock: StockReference, tmp_path: Path) -> None:
    """`forecache batch --parallel 1` under every policy, static included, with a prompt longer
    than 512 tokens: the texts are the unpatched build's greedy texts."""
    model = tiny_model("q8_0", preset)
    with Llama(str(model), cache=None, n_ctx=2048, verbose=False) as llm:
        long_prompt = llm.detokenize(llm.tokenize((TEXT * 120).encode())[:600]).decode()
        requests = [{"id": "short", "prompt": "The capital of France is"},
                    {"id": "long", "prompt": long_prompt}]
        prompts = [llm.tokenize(r["prompt"].encode(), add_bos=True, special=True)
                   for r in requests]
        assert len(prompts[1]) > 512
        # forecache batch loads with n_batch = n_ubatch = 512 and one sequence at --parallel 1
        ref = stock.run(model, prompts, 8, n_ctx=2048, n_batch=512, n_threads=2)
        want = {r["id"]: llm.detokenize(tokens).decode(errors="replace")
                for r, (tokens, _) in zip(requests, ref, strict=True)}
        # each reference step's text so far, to find the step at which a text departs from it
        steps = {r["id"]: [llm.detokenize(tokens[:i + 1]).decode(errors="replace")
                           for i in range(len(tokens))]
                 for r, (tokens, _) in zip(requests, ref, strict=True)}
        logits = {r["id"]: lg for r, (_, lg) in zip(requests, ref, strict=True)}
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({**r, "max_tokens": 8, "temperature": 0}) + "\n"
                           for r in requests))
    # promoe's host split and its expert groups follow which copies are still in flight, a
    # matter of timing. On a CPU build every row's result is the same whatever its group; on a
    # GPU build an expert sent to the CPU takes llama.cpp's CPU kernels, and a group's rows take
    # the kernel its size picks (an H100 parted tiny-mixtral, tiny-gpt-oss and tiny-lfm2moe's
    # batch texts from their own greedy runs with the split off). There the split is off and
    # promoe's texts follow the unpatched build's up to a near tie of its logits
    gpu = stock.backend != "cpu"
    for policy in ("offload", "ncmoe", "lru", "static", "promoe"):
        out = tmp_path / f"out-{policy}.jsonl"
        budget = str(_ncmoe(model, 2, n_ubatch=512).gpu_budget)
        size = ["--gpu-budget", budget] if policy == "ncmoe" else ["--cache-fraction", "0.5"]
        flags = ["--no-split"] if policy == "promoe" and gpu else []
        res = run_cli("batch", "-m", str(model), "--input", str(inp), "--output", str(out),
                      "--parallel", "1", "--threads", "2", "--policy", policy,
                      *([] if policy == "offload" else size), *flags)
        assert res.returncode == 0, f"{preset} {policy}: {res.stderr[-2000:]}"
        got = {r["id"]: r["text"] for r in map(json.loads, out.read_text().splitlines())}
        if flags:
            for rid, text in got.items():
                _assert_text_near_tie(text, steps[rid], logits[rid], f"{preset} {policy} {rid}")
            continue
        # the batch machinery: forecache's own greedy run of the policy, on every build
        cfg = (CacheConfig(policy) if policy == "offload" else
               CacheConfig(policy, gpu_budget=int(budget)) if policy == "ncmoe" else
               CacheConfig(policy, cache_fraction=0.5))
        assert got == _greedy_texts(model, cfg, requests, prompts), (preset, policy, "generate")
        # the unpatched build's texts: on a CPU build the same kernels, so the same texts; on a
        # GPU build experts computed on the host take llama.cpp's CPU kernels, which a tiny random
        # model's near ties turn into other texts (test_every_policy_equals_unpatched measures
        # that difference against stock's own)
        if stock.backend == "cpu":
            assert got == want, (preset, policy)

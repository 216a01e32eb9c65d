"""Batch plans and the roofline model that predicts them (roofline.batch, forecache plan)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from forecache.cache.choice import DecodeShape, ncmoe_decode_s, promoe_decode_s
from forecache.cache.cost import CostModel, Profile
from forecache.models.default import REFERENCE_MODEL
from forecache.roofline.batch import (
    BatchPlan,
    Workload,
    distinct_experts,
    estimate,
    layout,
    prompt_chunks,
    prompt_room,
    prompt_take,
    running_steps,
    search,
)
from forecache.roofline.shape import shape_of
from tests.cli_helpers import run_cli

TARGET = shape_of("qwen2-57b-a14b")
PROFILE = Profile.load("rtx4090")
GIB = 1 << 30
SHAREGPT = Workload(1000, 220, 190, 410)


def test_plan_text_round_trip_and_refusals() -> None:
    p = BatchPlan.parse("seq=16,ubatch=512,kv=host")
    assert p == BatchPlan(16, 512, True, "cache")
    assert BatchPlan.parse(p.label()) == p
    assert BatchPlan.parse("ubatch=64, seq=2, experts=ncmoe") == BatchPlan(2, 64, False, "ncmoe")
    micro = BatchPlan.parse("seq=16,ubatch=512,kv=host,micro=2")
    assert micro.micro == 2 and micro.label() == "seq=16,ubatch=512,kv=host,micro=2"
    assert BatchPlan.parse(micro.label()) == micro and p.micro == 1
    for bad in ("seq=16", "seq=x,ubatch=2", "seq=1,ubatch=2,kv=gpu", "seq=1,ubatch=2,foo=3",
                "seq=0,ubatch=2", "seq=1,ubatch=2,experts=lru", "seq=1,seq=2,ubatch=4",
                "seq=4,ubatch=2,micro=5", "seq=4,ubatch=2,micro=x",
                "seq=4,ubatch=2,experts=ncmoe,micro=2"):
        with pytest.raises(ValueError, match="plan|seq|experts|micro"):
            BatchPlan.parse(bad)


def test_distinct_experts() -> None:
    assert distinct_experts(1, 64, 8) == pytest.approx(8)
    assert distinct_experts(0, 64, 8) == 0
    assert 63.9 < distinct_experts(256, 64, 8) <= 64
    assert distinct_experts(4, 64, 8) < 4 * 8


def test_memory_split_and_budgets_that_do_not_fit() -> None:
    work = Workload(1000, 220, 190, 2048)
    dev = estimate(TARGET, PROFILE, 24 * GIB, work, BatchPlan(64, 512))
    host = estimate(TARGET, PROFILE, 24 * GIB, work, BatchPlan(64, 512, kv_host=True))
    assert dev is not None and host is not None
    # the KV cache on the host leaves its bytes to expert slots
    assert host.slots > dev.slots
    assert dev.device_bytes["kv"] == 64 * 2048 * TARGET.layers * TARGET.kv_bytes
    used = sum(dev.device_bytes.values())
    assert used <= 24 * GIB
    # the weights alone do not fit 4 GiB; 256 sequences' KV does not fit on a 24 GiB device
    assert estimate(TARGET, PROFILE, 4 * GIB, work, BatchPlan(1, 512)) is None
    assert estimate(TARGET, PROFILE, 24 * GIB, work, BatchPlan(256, 512)) is None
    assert estimate(TARGET, PROFILE, 24 * GIB, work, BatchPlan(256, 512, kv_host=True)) is not None
    # the host holds every expert the cache copies from, and a host KV cache
    experts = TARGET.layers * TARGET.experts * TARGET.expert_bytes
    one = BatchPlan(1, 512)
    assert estimate(TARGET, PROFILE, 24 * GIB, work, one, host_bytes=experts) is not None
    assert estimate(TARGET, PROFILE, 24 * GIB, work, one, host_bytes=experts - 1) is None
    assert estimate(TARGET, PROFILE, 24 * GIB, work, BatchPlan(256, 512, kv_host=True),
                    host_bytes=experts + 1) is None


def test_one_sequence_agrees_with_the_default_placements_estimates() -> None:
    """One performance model: a decode step of one sequence costs what cache.choice (the
    default placement's estimate, from the same cost primitives) says, but for attention."""
    work = Workload(1, 1, 64, 128)
    cost = CostModel.from_profile(PROFILE, TARGET.expert)
    for experts in ("ncmoe", "cache"):
        e = estimate(TARGET, PROFILE, 24 * GIB, work, BatchPlan(1, 512, experts=experts), cost=cost)
        assert e is not None
        shape = DecodeShape(n_moe=TARGET.layers, n_expert=TARGET.experts, top_k=TARGET.top_k,
                            n_slots=e.slots, ncmoe_host_layers=e.host_layers,
                            dense_bytes=TARGET.dense_bytes, n_layer=TARGET.layers)
        want = (ncmoe_decode_s(shape, PROFILE, cost) if experts == "ncmoe" else
                promoe_decode_s(shape, PROFILE, cost, e.slots / TARGET.experts))
        # the choice's estimate reads the dense weights in one launch; the plan's per layer,
        # and its promoe estimate averages the binomial misses: within 15%
        assert e.decode.seconds == pytest.approx(want, rel=0.15), experts


def test_bounds_follow_llama_cpps_rules() -> None:
    one = estimate(TARGET, PROFILE, 24 * GIB, SHAREGPT, BatchPlan(1, 512, experts="ncmoe"))
    many = estimate(TARGET, PROFILE, 24 * GIB, SHAREGPT, BatchPlan(64, 512, experts="ncmoe"))
    assert one is not None and many is not None
    # under 32 tokens llama.cpp computes host experts on the CPU; from 32 it copies them up
    assert "PCIe" not in one.decode.parts
    assert one.decode.bound in ("DRAM", "CPU compute")
    assert many.decode.parts["PCIe"] > 0
    assert many.decode.bound == "PCIe"
    # CPU attention is charged to the host
    host = estimate(TARGET, PROFILE, 24 * GIB, SHAREGPT, BatchPlan(64, 512, kv_host=True))
    dev = estimate(TARGET, PROFILE, 24 * GIB, SHAREGPT, BatchPlan(64, 512))
    assert host is not None and dev is not None
    assert host.decode.parts.get("DRAM", 0) > dev.decode.parts.get("DRAM", 0)


def test_bigger_batches_amortize_the_bus() -> None:
    rates = [estimate(TARGET, PROFILE, 24 * GIB, SHAREGPT, BatchPlan(n, 512, kv_host=True))
             for n in (1, 16, 64, 256)]
    tps = [e.tokens_per_s for e in rates if e is not None]
    assert len(tps) == 4 and tps == sorted(tps)
    assert tps[-1] > 5 * tps[0]


def test_search_orders_plans_and_respects_the_grid() -> None:
    got = search(TARGET, PROFILE, 24 * GIB, SHAREGPT, n_seqs=(1, 8, 64), n_ubatches=(256, 512))
    assert got
    assert [e.tokens_per_s for e in got] == sorted((e.tokens_per_s for e in got), reverse=True)
    assert {e.plan.n_seq for e in got} <= {1, 8, 64}
    assert {e.plan.n_ubatch for e in got} <= {256, 512}
    assert all(e.plan.experts == "cache" for e in got)
    # a job of 3 requests never plans more than 3 sequences
    few = search(TARGET, PROFILE, 24 * GIB, replace(SHAREGPT, n_requests=3))
    assert max(e.plan.n_seq for e in few) == 3
    # stock llama.cpp decodes at most 256 sequences in a context; forecache's cap is given
    wide = search(TARGET, PROFILE, 24 * GIB, SHAREGPT, experts=("cache", "ncmoe"),
                  kv=(True,), n_seqs=(512,), n_ubatches=(1024,), max_seq=1024)
    assert {(e.plan.experts, e.plan.n_seq) for e in wide} == {("cache", 512), ("ncmoe", 256)}


def test_search_breaks_ties_toward_the_larger_ubatch() -> None:
    """Prompts shorter than both ubatches predict alike; the larger one admits more prompts a
    step, so it goes first."""
    tiny = shape_of("tiny", "q8_0")
    got = search(tiny, PROFILE, 1 << 40, Workload(16, 30, 32, 128), experts=("ncmoe",),
                 kv=(False,), n_seqs=(4,), n_ubatches=(64, 512))
    assert [e.plan.n_ubatch for e in got] == [512, 64]
    assert got[0].tokens_per_s == got[1].tokens_per_s


def test_running_steps_follow_continuous_batching() -> None:
    """Longest first into the sequences, a freed one taking the next request at once: every
    answer token is one sequence's share of one step."""
    assert running_steps([5, 3, 2], 1) == {1: 10}
    assert running_steps([5, 3, 2], 2) == {2: 5}  # 5 and 3, then 2 where 3 ended
    assert running_steps([2, 5, 3], 3) == {3: 2, 2: 1, 1: 2}
    answers = list(range(1, 200, 7))
    for n in (1, 4, 16, 64):
        got = running_steps(answers, n)
        assert sum(k * v for k, v in got.items()) == sum(answers) and max(got) <= n


def test_a_jobs_tail_counts_where_answers_are_known() -> None:
    """Where the requests' answer lengths are known, the job's tail (a few long answers, with
    fewer sequences running each step) is counted step by step: a batch as large as the job
    gains little from its size, since the longest answer sets its steps; a batch of a quarter
    of it keeps full steps most of the job and is within a few percent of the mean model."""
    rng = np.random.default_rng(0)
    answers = tuple(int(a) for a in rng.lognormal(5.5, 0.85, 1000).clip(2, 1950))
    mean = sum(answers) / len(answers)
    plain = Workload(1000, 150, mean, 2048)
    known = replace(plain, answers=answers)
    whole, quarter = BatchPlan(1000, 512, True), BatchPlan(256, 1024, True)
    a, b = (estimate(TARGET, PROFILE, 24 * GIB, w, whole) for w in (plain, known))
    c, d = (estimate(TARGET, PROFILE, 24 * GIB, w, quarter) for w in (plain, known))
    assert a is not None and b is not None and c is not None and d is not None
    assert b.tokens_per_s < 0.8 * a.tokens_per_s
    assert abs(d.tokens_per_s / c.tokens_per_s - 1) < 0.1
    assert d.tokens_per_s > b.tokens_per_s  # the quarter batch ranks first once the tail counts


def test_plan_command(tmp_path: Path) -> None:
    out = tmp_path / "plans.json"
    res = run_cli("plan", "--shape", "qwen2-57b-a14b", "--gpu-budget", "24GiB", "--prompt-len",
                  "220", "--gen", "190", "--host-memory", "128GiB", "--top", "3", "--json",
                  str(out), check=True)
    lines = res.stdout.strip().splitlines()
    assert len(lines) == 1 + 3 + 1
    assert lines[1].startswith("plan seq=") and "tokens/s predicted" in lines[1]
    assert lines[-1].startswith("stock llama.cpp's best: plan") and "experts=ncmoe" in lines[-1]
    data = json.loads(out.read_text())
    assert data["plans"][0]["line"] == lines[1]
    assert all(p["plan"].endswith("experts=ncmoe") for p in data["stock"])
    # the lengths spread as ShareGPT's around the means by default; --spread none: all alike
    assert "spread as ShareGPT's" in lines[0]
    alike = run_cli("plan", "--shape", "qwen2-57b-a14b", "--gpu-budget", "24GiB",
                    "--prompt-len", "220", "--gen", "190", "--host-memory", "128GiB", "--top",
                    "1", "--spread", "none", check=True)
    assert "spread" not in alike.stdout.splitlines()[0] and "plan seq=" in alike.stdout
    # a GGUF file: its own sizes
    res = run_cli("plan", "-m", str(REFERENCE_MODEL), "--gpu-budget", "512MiB", "--prompt-len",
                  "64", "--gen", "64", "--requests", "32", check=True)
    assert "forecache-ref" in res.stdout and "seq=" in res.stdout


def test_spread_lengths_keep_the_means_and_the_context() -> None:
    """`forecache plan`'s job of lengths spread as ShareGPT's: the means given (within a few
    percent, the context's cut made up for), every request within its context, and a tail
    of long answers that a job of lengths all alike lacks."""
    from forecache.cli.plan_cmd import spread_workload

    work = spread_workload(1000, 220, 190, None)
    assert work.prompt_len == pytest.approx(220, rel=0.05)
    assert work.gen_len == pytest.approx(190, rel=0.05)
    assert len(work.prompts) == len(work.answers) == 1000
    assert max(p + a for p, a in zip(work.prompts, work.answers, strict=True)) \
        == work.ctx_per_seq <= 2048
    assert max(work.answers) > 4 * 190
    tight = spread_workload(64, 220, 190, 512)
    assert tight.ctx_per_seq == 512
    assert all(p + a <= 512 for p, a in zip(tight.prompts, tight.answers, strict=True))
    assert spread_workload(1000, 220, 190, None) == work  # drawn with a fixed seed


def test_plan_command_refusals() -> None:
    res = run_cli("plan", "--shape", "qwen2-57b-a14b", "--gpu-budget", "2GiB", "--prompt-len",
                  "220", "--gen", "190")
    assert res.returncode != 0 and "no plan fits 2GiB" in res.stderr
    res = run_cli("plan", "--shape", "qwen2-57b-a14b", "--gpu-budget", "24GiB", "--prompt-len",
                  "220", "--gen", "190", "--host-memory", "16GiB")
    assert res.returncode != 0 and "host memory" in res.stderr
    res = run_cli("plan", "--shape", "qwen2-57b-a14b", "--gpu-budget", "lots", "--prompt-len",
                  "220", "--gen", "190")
    assert res.returncode != 0 and "cannot read size" in res.stderr
    res = run_cli("plan", "--gpu-budget", "24GiB", "--prompt-len", "1", "--gen", "1")
    assert res.returncode != 0 and "-m FILE" in res.stderr
    res = run_cli("plan", "--shape", "qwen2-57b-a14b", "--gpu-budget", "24GiB", "--prompt-len",
                  "400", "--gen", "200", "--ctx-per-seq", "512")
    assert res.returncode != 0 and "hold less than the mean prompt and answer" in res.stderr


def test_overlap_bounds_what_a_pipeline_could_reach() -> None:
    e = estimate(TARGET, PROFILE, 24 * GIB, SHAREGPT, BatchPlan(256, 1024, kv_host=True))
    assert e is not None
    for st in (e.prefill, e.decode):
        # the busiest resource alone, never more than the ops one after another
        assert 0 < st.overlapped_s <= st.seconds
        assert st.overlapped_s >= max(st.parts.values())
    assert e.overlapped_tokens_per_s >= e.tokens_per_s


def test_a_step_feeds_a_prompt_whole_ubatches() -> None:
    """With a KV stream per sequence each prompt's rows make ubatches of their own, each a pass
    over every layer: a step feeds a prompt's rest, else whole ubatches of it."""
    assert prompt_take(40, 100, 16) == 40  # the whole rest
    assert prompt_take(100, 40, 16) == 32  # whole ubatches of it
    assert prompt_take(100, 10, 16) == 10  # room for less than one: what fits
    assert prompt_take(5, 0, 16) == 0
    # beside the other sequences' decoding rows, a batch of batch_tokens rows leaves a ubatch
    for n_seq, n_ubatch in ((256, 256), (256, 512), (256, 1024), (1000, 1024), (1, 512)):
        assert prompt_room(n_seq, n_ubatch) == n_ubatch


def test_prompts_priced_as_the_ubatches_they_make() -> None:
    """Given each request's prompt length, the model prices the ubatches llama.cpp cuts the
    prompts into, not the mean prompt's: prompts of the same mean cost more passes where some
    are longer than a ubatch."""
    assert prompt_chunks([20, 180, 300], 128) == {(20, 0): 1, (128, 0): 2, (52, 128): 1,
                                                  (128, 128): 1, (44, 256): 1}
    plan = BatchPlan(1, 128)
    even = Workload(64, 100, 32, 512, prompts=(100,) * 64)
    mixed = Workload(64, 100, 32, 512, prompts=(20, 180) * 32)
    got = [estimate(TARGET, PROFILE, 24 * GIB, w, plan) for w in (even, mixed)]
    assert got[0] is not None and got[1] is not None
    assert got[1].prefill_s > got[0].prefill_s * 1.2  # 96 passes against 64
    # a ubatch that holds every prompt whole makes one pass a prompt
    wide = estimate(TARGET, PROFILE, 24 * GIB, mixed, BatchPlan(1, 256))
    assert wide is not None and wide.prefill_s < got[1].prefill_s / 1.2


def test_prompt_banks_fill_a_layer_beside_the_layer_before() -> None:
    """Where the runtime places prompt banks (on a GPU), a ubatch of DEVICE_MIN_TOKENS rows or
    more computes each layer from its slots and its bank, filled with every expert the slots
    lack while the layer before computes: the banks' two regions come out of the slots, and
    the ubatch is bound below by the fills one after another."""
    plan = BatchPlan(256, 1024, kv_host=True)
    plain = layout(TARGET, 24 * GIB, SHAREGPT, plan)
    banked = layout(TARGET, 24 * GIB, SHAREGPT, plan, bank=True)
    assert plain is not None and banked is not None and plain.bank == 0
    assert banked.bank == TARGET.experts - banked.slots > 0 and banked.stage == 0
    assert banked.slots < plain.slots
    assert sum(v for k, v in banked.device_bytes.items() if k != "kv") <= 24 * GIB  # KV: host
    a = estimate(TARGET, PROFILE, 24 * GIB, SHAREGPT, plan)
    b = estimate(TARGET, PROFILE, 24 * GIB, SHAREGPT, plan, bank=True)
    assert a is not None and b is not None
    assert b.prefill.seconds < a.prefill.seconds and b.decode.seconds < a.decode.seconds
    cost = CostModel.from_profile(PROFILE, TARGET.expert)
    fills = TARGET.layers * banked.bank * TARGET.expert_bytes / (cost.copy_gbps * 1e9)
    assert b.prefill.seconds >= fills
    # a pipeline could not hide the fills: the bus is busy for all of them
    assert b.decode.bus_s >= fills and b.decode.overlapped_s >= min(b.decode.seconds, fills)
    # a budget that holds every expert leaves nothing to fill
    whole = layout(TARGET, 80 * GIB, SHAREGPT, plan, bank=True)
    assert whole is not None and whole.slots == TARGET.experts and whole.bank == 0


def test_running_steps_with_prompts_admitted_a_few_a_step() -> None:
    """Micro-batches feed prompts in contexts of their own, a few a step: sequences start
    decoding at that rate, so a job takes more steps, with fewer running at its start; every
    answer token is still one sequence's step."""
    assert running_steps([5, 3, 2], 2, admit=1) == {1: 2, 2: 4}
    answers = [40, 30, 30, 20, 10] * 8
    free = running_steps(answers, 16)
    slow = running_steps(answers, 16, admit=2)
    for got in (free, slow):
        assert sum(k * n for k, n in got.items()) == sum(answers)
    assert sum(slow.values()) > sum(free.values())
    assert max(slow) <= 16 and 0 not in slow


def test_a_decode_step_past_the_ubatch_is_several_passes() -> None:
    """llama.cpp splits a step of more sequences than a ubatch holds into ubatches, each a pass
    over every layer (and, with prompt banks, a fill of each layer's bank)."""
    one = estimate(TARGET, PROFILE, 24 * GIB, SHAREGPT, BatchPlan(512, 512, kv_host=True),
                   bank=True)
    two = estimate(TARGET, PROFILE, 24 * GIB, SHAREGPT, BatchPlan(512, 256, kv_host=True),
                   bank=True)
    assert one is not None and two is not None
    cost = CostModel.from_profile(PROFILE, TARGET.expert)
    fills = TARGET.layers * (TARGET.experts - two.slots) * TARGET.expert_bytes / \
        (cost.copy_gbps * 1e9)
    assert two.decode.bus_s >= 2 * fills * 0.99 and two.decode.seconds > one.decode.seconds


def test_micro_plans_pay_their_contexts_and_share_fills() -> None:
    """A plan of micro-batches pays, out of the budget, its prompt contexts' compute buffers
    (and KV caches on the device): fewer slots. Its prompts' passes that share a round with the
    decoding one read its fills, so its prompts cost less than the same plan's alone; its
    moves and extra passes are priced. The search offers micro plans only with prompt banks."""
    plain = BatchPlan(256, 512, kv_host=True)
    micro = BatchPlan(256, 512, kv_host=True, micro=3)
    work = replace(SHAREGPT, answers=tuple([190] * 1000), prompts=tuple([220] * 1000))
    a = estimate(TARGET, PROFILE, 24 * GIB, work, plain, bank=True)
    b = estimate(TARGET, PROFILE, 24 * GIB, work, micro, bank=True)
    assert a is not None and b is not None
    assert b.device_bytes["compute"] > 2 * a.device_bytes["compute"] and b.slots < a.slots
    assert b.device_bytes["kv"] > a.device_bytes["kv"]  # (in host memory: kv=host)
    assert b.prefill_s < a.prefill_s  # shared fills
    assert 0 < b.tokens_per_s <= b.overlapped_tokens_per_s
    on_device = layout(TARGET, 24 * GIB, work, BatchPlan(64, 512, micro=3), bank=True)
    alone = layout(TARGET, 24 * GIB, work, BatchPlan(64, 512), bank=True)
    assert on_device is not None and alone is not None
    assert on_device.device_bytes["kv"] > alone.device_bytes["kv"]
    grid = dict(n_seqs=(256,), n_ubatches=(512,), kv=(True,), micros=(1, 2, 3, 4))
    got = {e.plan.micro for e in search(TARGET, PROFILE, 24 * GIB, work, bank=True, **grid)}
    assert got == {1, 2, 3, 4}
    assert {e.plan.micro for e in search(TARGET, PROFILE, 24 * GIB, work, **grid)} == {1}
    # every expert in slots: no banks, nothing for micro-batches to share
    assert {e.plan.micro for e in search(TARGET, PROFILE, 200 * GIB, work, bank=True,
                                         **grid)} == {1}

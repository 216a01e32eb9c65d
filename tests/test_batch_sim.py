"""Batch jobs in the simulator: continuous batching of many requests, attention over each row's
context on the device or the CPU, stock llama.cpp's copy rule for ubatches of many rows; and
single-request replays left as they were."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from forecache.cache.cost import Profile
from forecache.predictor.history import HistoryPredictor
from forecache.roofline.batch import split_batch
from forecache.sim.batch import simulate_batch
from forecache.sim.run import SHAREGPT, window_requests
from forecache.sim.shapes import shape_of
from forecache.sim.simulate import SimConfig, Simulator, simulate
from forecache.trace.format import Request
from forecache.trace.synth import OLMOE_FIT, synthesize

SHAPE = shape_of("tiny", "q8_0")  # 4 layers, 16 experts, top-4
PROFILE = Profile.load("rtx4090")


def _requests(n: int = 24, seed: int = 0, decode: tuple[int, int] = (2, 40)) -> list[Request]:
    rng = np.random.default_rng(seed)
    prompts = rng.integers(4, 60, n)
    answers = rng.integers(*decode, n)
    return synthesize(OLMOE_FIT, n_layers=SHAPE.layers, n_expert=SHAPE.experts,
                      top_k=SHAPE.top_k, tokens=(prompts + answers).tolist(),
                      prefill=prompts.tolist(), seed=seed + 5)


def _of_lengths(prompts: np.ndarray, answers: np.ndarray, seed: int) -> list[Request]:
    """Requests of these prompt and answer lengths, routed as OLMoE's fit."""
    return synthesize(OLMOE_FIT, n_layers=SHAPE.layers, n_expert=SHAPE.experts,
                      top_k=SHAPE.top_k, tokens=(prompts + answers).tolist(),
                      prefill=prompts.tolist(), seed=seed)


def _answers(reqs: list[Request]) -> int:
    return sum(int((r.phase == 1).sum()) for r in reqs)


def test_single_request_replays_unchanged() -> None:
    """The figures one-request-at-a-time replays gave before batch jobs were modelled (with
    the layer's norms in its bytes, as make-model writes it; promoe's since prompt-sized
    ubatches stopped splitting experts to the CPU, 2026-11-26), on the hot path they were
    computed with (expert groups, every cached layer stopping)."""
    reqs = synthesize(OLMOE_FIT, n_layers=4, n_expert=16, top_k=4, tokens=[60, 50, 45],
                      prefill=[40, 34, 20], seed=5)
    want = {
        "promoe": (0.003149916413968258, 0.0008099084377829959, 825, 399, 69353472,
                   0.00028127616000000284, 82),
        "ncmoe": (0.0011777536304761894, 0.0005527399314285722, 613, 611, 12533760,
                  0.0006213504, 0),
        "lru": (0.001808388278857139, 0.0009557355975643955, 767, 457, 61833216,
                0.011353328639998737, 16),
    }
    for policy, (ttft, tpot, hits, misses, h2d, stall, host) in want.items():
        pred = HistoryPredictor(4, 16, 4) if policy == "promoe" else None
        r = simulate(reqs, SHAPE, PROFILE,
                     SimConfig(policy, n_slots=8, n_ubatch=32, hot_path="groups"), pred)
        assert (r.hits, r.misses, r.h2d_bytes, r.host_layers) == (hits, misses, h2d, host)
        assert r.ttft_s == pytest.approx(ttft, rel=1e-12)
        assert r.tpot_s == pytest.approx(tpot, rel=1e-12)
        assert r.stall_s == pytest.approx(stall, rel=1e-12, abs=1e-15)


@pytest.mark.parametrize("policy", ["promoe", "ncmoe"])
def test_every_row_fed_once_and_every_token_generated(policy: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Each request's rows go through the model once, prompt first, the last answer token
    never fed back; the job generates every answer token; the longest request is admitted
    first."""
    reqs = _requests()
    seen: list[np.ndarray] = []
    real = Simulator._ubatch

    def spy(self: Simulator, req: Request, rows: np.ndarray, *a: object) -> float:
        seen.append(np.array(rows))
        return real(self, req, rows, *a)

    monkeypatch.setattr(Simulator, "_ubatch", spy)
    starts = np.cumsum([0] + [r.n_tokens for r in reqs])
    for n_seq, n_ubatch, split in ((1, 16, "simple"), (5, 8, "simple"), (8, 64, "simple"),
                                   (5, 8, "equal")):
        seen.clear()
        cfg = SimConfig(policy, n_slots=8, n_ubatch=n_ubatch, n_seq=n_seq, split=split)
        r = simulate_batch(reqs, SHAPE, PROFILE, cfg)
        assert r.generated == _answers(reqs) and r.n_ubatches == len(seen)
        assert all(len(u) <= n_ubatch for u in seen)
        fed = np.concatenate(seen)
        want = np.concatenate([np.arange(a, b - 1)
                               for a, b in zip(starts[:-1], starts[1:], strict=True)])
        assert np.array_equal(np.sort(fed), want)  # each row once
        owner = np.searchsorted(starts, fed, side="right") - 1
        for i in range(len(reqs)):  # a request's rows in order
            assert (np.diff(fed[owner == i]) > 0).all()
        longest = max(range(len(reqs)), key=lambda i: (reqs[i].n_tokens, -i))
        assert owner[0] == longest


def test_split_batch_as_llama_cpp_splits() -> None:
    """llama.cpp's ubatches of a batch: consecutive rows with a unified KV cache; with a KV
    stream per sequence, sequences of consecutive ids, as many rows of each as all have."""
    assert [u.tolist() for u in split_batch([0, 1, 2, 3, 3], 2)] == [[0, 1], [2, 3], [4]]
    # sequence 3 (a new prompt) after 7: 0-3 go first, one row each, then 4-7, then 3's rest
    seqs = [0, 1, 2, 4, 5, 6, 7, 3, 3, 3, 3, 3]
    assert [u.tolist() for u in split_batch(seqs, 8, "equal")] == \
        [[0, 1, 2, 7], [3, 4, 5, 6], [8, 9, 10, 11]]
    seqs = [0, 1, 2, 3] + [4] * 10 + [5] * 3
    assert [u.tolist() for u in split_batch(seqs, 8, "equal")] == \
        [[0, 1, 2, 3, 4, 14], [5, 6, 15, 16], list(range(7, 14))]
    with pytest.raises(ValueError, match="unknown split"):
        split_batch([0], 4, "balanced")


def test_equal_split_fragments_prompts_not_decode_steps() -> None:
    """With a KV stream per sequence a new prompt's rows beside the decoding rows take
    ubatches of their own (llama.cpp's equal split); a step of decoding rows only stays one
    ubatch, also as the job drains (the sequences left moved down to free ids)."""
    reqs = _requests(32, seed=4, decode=(10, 60))
    cfg = SimConfig("ncmoe", [SHAPE.experts] * 2 + [0] * 2, n_ubatch=64, n_seq=8)
    simple = simulate_batch(reqs, SHAPE, PROFILE, cfg)
    equal = simulate_batch(reqs, SHAPE, PROFILE, replace(cfg, split="equal"))
    assert equal.generated == simple.generated
    assert equal.n_ubatches > simple.n_ubatches and equal.tokens_per_s < simple.tokens_per_s
    assert equal.extra["moves"] > 0 and simple.extra["moves"] == 0
    for r in (simple, equal):
        assert r.extra["decode_steps"] > 100
        assert r.extra["decode_step_ubatches"] == r.extra["decode_steps"]


def test_unified_cache_attends_over_every_cell() -> None:
    """With a unified KV cache (the simple split) each row attends over every sequence's cells:
    a step's attention computes n_seq times the products it computes with a stream per
    sequence, which binds once attention is bound by its compute (at hundreds of sequences at
    the target; here a slow device stands in)."""
    reqs = _requests(16, seed=5, decode=(40, 80))
    prof = replace(PROFILE, gpu_launch_s=0.0, gpu_tflops=PROFILE.gpu_tflops / 1e4)
    cfg = SimConfig("promoe", n_slots=16, n_ubatch=64, n_seq=8)
    simple = simulate_batch(reqs, SHAPE, prof, cfg)
    equal = simulate_batch(reqs, SHAPE, prof, replace(cfg, split="equal"))
    assert simple.attention_s > 3 * equal.attention_s


def test_steady_replay_stops_where_the_batch_drains() -> None:
    reqs = _requests(24)
    cfg = SimConfig("ncmoe", 8, n_ubatch=32, n_seq=4)
    whole = simulate_batch(reqs, SHAPE, PROFILE, cfg)
    steady = simulate_batch(reqs, SHAPE, PROFILE, cfg, steady=True)
    assert whole.complete and not steady.complete
    assert steady.generated < whole.generated and steady.job_s < whole.job_s


def test_throughput_grows_with_sequences() -> None:
    """Decoding more sequences together reads each layer's weights once for all of them."""
    reqs = _requests(32, seed=1, decode=(30, 60))
    for policy in ("promoe", "ncmoe"):
        tps = [simulate_batch(reqs, SHAPE, PROFILE,
                              SimConfig(policy, n_slots=10, n_ubatch=64, n_seq=n)).tokens_per_s
               for n in (1, 4, 16)]
        assert tps[0] < tps[1] < tps[2], (policy, tps)


def test_host_kv_cache_pays_cpu_attention() -> None:
    """With the KV cache in host memory the CPU computes attention: slower than on the device
    at the same slots, and the time shows as CPU and attention time."""
    reqs = _requests(16, seed=2, decode=(60, 120))
    cfg = SimConfig("promoe", n_slots=16, n_ubatch=64, n_seq=8)
    dev = simulate_batch(reqs, SHAPE, PROFILE, cfg)
    host = simulate_batch(reqs, SHAPE, PROFILE, replace(cfg, kv_host=True))
    assert host.tokens_per_s < dev.tokens_per_s
    assert host.attention_s > dev.attention_s > 0
    assert host.busy["CPU"] > dev.busy["CPU"]
    # routing and placement are the same: only time differs
    assert (host.hits, host.misses) == (dev.hits, dev.misses)


def test_overlapped_job_is_its_busiest_resource_a_step() -> None:
    """A pipeline of micro-batches runs a step's device, CPU and bus time side by side: the
    job then takes between its busiest resource and the serial replay; with every expert and
    the KV cache on the device nothing overlaps, and the figures agree."""
    reqs = _requests(16, seed=2, decode=(60, 120))
    host = simulate_batch(reqs, SHAPE, PROFILE,
                          SimConfig("promoe", n_slots=6, n_ubatch=64, n_seq=8, kv_host=True))
    busiest = max(host.busy[k] for k in ("GPU", "CPU", "PCIe")) + host.busy["runtime"]
    assert busiest - 1e-12 <= host.overlapped_s < host.job_s
    assert host.overlapped_tokens_per_s > host.tokens_per_s
    # the bus is busy for every byte it copies, also where the copies ran beside the ops
    assert host.overlapped_s >= host.h2d_bytes / (PROFILE.h2d_gbps * 1e9) - 1e-12
    resident = simulate_batch(reqs, SHAPE, PROFILE,
                              SimConfig("promoe", n_slots=SHAPE.experts, n_ubatch=64, n_seq=8))
    assert resident.busy["CPU"] == resident.busy["PCIe"] == 0
    assert resident.overlapped_s == pytest.approx(resident.job_s, rel=1e-9)


def test_prompts_get_a_ubatch_beside_the_decoding_rows() -> None:
    """With as many sequences as a ubatch has rows, a batch of max(n_ubatch, n_seq) tokens is
    full with decoding rows and a new prompt gets only the rows idle sequences leave; the job's
    batch (``batch_tokens``) holds a ubatch of prompt rows beside them: fewer steps, faster."""
    from forecache.roofline.batch import batch_tokens

    reqs = _requests(32, seed=6, decode=(20, 40))
    cfg = SimConfig("promoe", n_slots=8, n_ubatch=8, n_seq=8, split="equal")
    starved = simulate_batch(reqs, SHAPE, PROFILE, replace(cfg, n_batch=8))
    fed = simulate_batch(reqs, SHAPE, PROFILE, cfg)
    assert batch_tokens(8, 8) == 16 and batch_tokens(1, 512) == 512
    assert fed.extra["n_batch"] == 16 and fed.generated == starved.generated
    assert fed.n_steps < starved.n_steps and fed.tokens_per_s > starved.tokens_per_s


def test_ncmoe_copies_host_experts_for_ubatches_of_32() -> None:
    """Stock llama.cpp computes a host layer of a ubatch of 32 rows or more on the device after
    copying the experts it uses; a smaller ubatch computes it on the CPU."""
    reqs = _requests(48, seed=3, decode=(20, 40))
    half = [SHAPE.experts] * 2 + [0] * 2  # --n-cpu-moe 2
    big = simulate_batch(reqs, SHAPE, PROFILE, SimConfig("ncmoe", half, n_ubatch=64, n_seq=32))
    small = simulate_batch(reqs, SHAPE, PROFILE, SimConfig("ncmoe", half, n_ubatch=16, n_seq=8))
    assert big.h2d_bytes > 0 and small.h2d_bytes == 0
    assert small.busy["CPU"] > 0
    # every expert of the device layers hits, none of the host layers'
    assert 0 < big.hit_rate < 1 and 0 < small.hit_rate < 1


def test_batch_replay_refuses_what_it_cannot_model() -> None:
    reqs = _requests(4)
    with pytest.raises(ValueError, match="exactly"):
        simulate_batch(reqs, SHAPE, PROFILE, SimConfig("promoe", 8, little_k=2, n_seq=2))
    with pytest.raises(ValueError, match="cannot hold"):
        simulate_batch(reqs, SHAPE, PROFILE, SimConfig("promoe", 8, n_seq=8, n_batch=4))
    no_prompt = replace(reqs[0], phase=np.ones(reqs[0].n_tokens, np.int8))
    with pytest.raises(ValueError, match="prompt rows"):
        simulate_batch([no_prompt], SHAPE, PROFILE, SimConfig("ncmoe", 8, n_seq=2))


def test_sharegpt_lengths_and_windows() -> None:
    rng = np.random.default_rng(0)
    p, a = SHAREGPT.draw(4000, rng)
    assert p.min() >= 4 and a.min() >= 4 and p.max() <= 1024 and (p + a).max() <= 2048
    assert 140 < p.mean() < 180 and 310 < a.mean() < 370
    pool = synthesize(OLMOE_FIT, n_layers=2, n_expert=16, top_k=4, tokens=[64] * 2, seed=0)
    reqs = window_requests(pool, [5, 30], [7, 34], rng)
    assert [r.n_tokens for r in reqs] == [12, 64]
    assert [int((r.phase == 0).sum()) for r in reqs] == [5, 30]
    assert any(np.array_equal(reqs[1].experts, e.experts) for e in pool)
    with pytest.raises(ValueError, match="no pool entry"):
        window_requests(pool, [60], [10], rng)


def test_batch_sim_benchmark_quick(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import batch_sim

    out = tmp_path / "b.json"
    batch_sim.main(["--quick", "--shape", "tiny", "--budget", "282MiB", "--jobs", "1",
                    "--json", str(out)])
    text = capsys.readouterr().out
    assert "| plan | policy |" in text and "over the whole job" in text
    got = json.loads(out.read_text())
    assert {p["policy"] for p in got["plans"]} == {"ncmoe", "promoe"}
    # the best screened plan of each policy replays the whole job, and so does the HRM's
    # pick; the best whole job of each gives the ratio
    label = {p["policy"] + " " + f"seq={p['n_seq']},ubatch={p['n_ubatch']},kv="
             + ("host" if p["kv_host"] else "device"): p for p in got["plans"]}
    best: dict[str, float] = {}
    for policy in ("ncmoe", "promoe"):
        mine = [p for p in got["plans"] if p["policy"] == policy]
        top = max(mine, key=lambda p: p["screen"]["tokens_per_s"])
        assert top["job"] is not None
        pick = label[f"{policy} {got['hrm_pick'][policy]}"]
        assert pick["job"] is not None
        assert pick["hrm_tokens_per_s"] == max(p["hrm_tokens_per_s"] for p in mine)
        for p in mine:
            if p["job"] is not None:
                assert p["job"]["complete"] and p["job"]["n_requests"] == got["requests"]
        best[policy] = max(p["job"]["tokens_per_s"] for p in mine if p["job"] is not None)
    assert got["ratio"] == pytest.approx(best["promoe"] / best["ncmoe"])


def test_weights_paging_shares_a_layers_fill_between_a_steps_ubatches() -> None:
    """With prompt banks each ubatch of 32 rows or more fills every layer's bank; going through
    each layer with all of a step's ubatches before the next (MoE-Lightning's weights paging)
    one fill serves them all, which the paged figure counts: below the pipelined one where
    steps hold several banked ubatches and the bus binds (a slow one stands in for the
    target's large experts), equal to it where none is banked."""
    slow = replace(PROFILE, h2d_gbps=0.5)
    rng = np.random.default_rng(7)
    prompts = rng.integers(40, 90, 24)
    answers = rng.integers(4, 12, 24)
    reqs = _of_lengths(prompts, answers, seed=8)
    cfg = SimConfig("promoe", n_slots=12, n_ubatch=32, n_seq=64, kv_host=True, split="equal",
                    prompt_bank=True)
    banked = simulate_batch(reqs, SHAPE, slow, cfg)
    assert banked.extra["banked"] > 0 and banked.extra["bank_bytes"] > 0
    assert banked.paged_s < banked.overlapped_s <= banked.job_s
    assert banked.paged_tokens_per_s > banked.overlapped_tokens_per_s
    plain = simulate_batch(reqs, SHAPE, slow, replace(cfg, prompt_bank=False))
    assert plain.extra["banked"] == 0
    assert plain.paged_s == pytest.approx(plain.overlapped_s, rel=1e-12)


def test_micro_batches_pair_a_prompt_with_the_decoding_rows() -> None:
    """decode_many's micro=2 replayed: the prompts fed in a context of their own, each sequence
    moved to the decoding context once its first token is sampled; a step's prompt ubatch and
    decoding ubatch go through each layer together, the second reading the first's bank fills:
    every token is generated, fewer bytes fill the banks, the serial clock pays the moves, and
    each round's passes side by side are faster than the serial clock."""
    slow = replace(PROFILE, h2d_gbps=0.5)
    rng = np.random.default_rng(9)
    prompts = rng.integers(40, 90, 48)
    answers = rng.integers(40, 80, 48)
    reqs = _of_lengths(prompts, answers, seed=10)
    # a prompt is one ubatch, and the decoding rows are enough for the banks beside it
    cfg = SimConfig("promoe", n_slots=12, n_ubatch=128, n_seq=40, kv_host=True,
                    split="equal", prompt_bank=True)
    one = simulate_batch(reqs, SHAPE, slow, cfg)
    two = simulate_batch(reqs, SHAPE, slow, cfg, micro=2)
    assert two.generated == one.generated == int(answers.sum())
    assert two.prompt_tokens == one.prompt_tokens == int(prompts.sum())
    assert two.extra["micro"] == 2 and two.extra["migrated"] == len(reqs)
    assert two.extra["bank_bytes"] < one.extra["bank_bytes"]
    assert two.job_s < one.job_s and two.overlapped_s < two.job_s
    # more prompt contexts, a ubatch each a step in the decoding ubatch's round: fewer fills
    three = simulate_batch(reqs, SHAPE, slow, cfg, micro=3)
    assert three.generated == one.generated and three.extra["migrated"] == len(reqs)
    assert three.extra["bank_bytes"] < two.extra["bank_bytes"]
    with pytest.raises(ValueError, match="micro=5"):
        simulate_batch(reqs, SHAPE, slow, cfg, micro=5)
    with pytest.raises(ValueError, match="split='equal'"):
        simulate_batch(reqs, SHAPE, slow, replace(cfg, split="simple"), micro=2)



def test_the_roofline_prices_micro_plans_as_the_replay_runs_them() -> None:
    """The roofline (HRM) prices a plan of micro-batches as simulate_batch replays it: at the
    target shape on a short job, each plan within 20% of the replay (virtual time: the same on
    every CPU), and the plan it predicts fastest is the replay's fastest."""
    from forecache.roofline import batch as hrm

    shape = shape_of("qwen2-57b-a14b", "q4_k")
    rng = np.random.default_rng(0)
    prompts, answers = SHAREGPT.draw(120, rng)
    prompts = np.maximum((prompts * 0.3).astype(int), 2)
    answers = np.maximum((answers * 0.3).astype(int), 2)
    ctx = int(prompts.max() + answers.max())
    pool = synthesize(OLMOE_FIT, n_layers=shape.layers, n_expert=shape.experts,
                      top_k=shape.top_k, tokens=[ctx] * 2, seed=1)
    reqs = window_requests(pool, prompts, answers, rng)
    work = hrm.Workload(len(reqs), float(prompts.mean()), float(answers.mean()), ctx,
                        tuple(int(a) for a in answers), tuple(int(p) for p in prompts))
    predicted, replayed = {}, {}
    for n_seq, micro in ((32, 1), (32, 3), (64, 1), (64, 3)):
        plan = hrm.BatchPlan(n_seq, 128, kv_host=True, micro=micro)
        lay = hrm.layout(shape, 24 << 30, work, plan)  # the replay holds its banks back itself
        e = hrm.estimate(shape, PROFILE, 24 << 30, work, plan, bank=True)
        assert lay is not None and e is not None
        cfg = SimConfig("promoe", lay.slots, n_ubatch=128, n_seq=n_seq, kv_host=True,
                        split="equal")
        r = simulate_batch(reqs, shape, PROFILE, cfg, micro=micro)
        predicted[plan], replayed[plan] = e.tokens_per_s, r.tokens_per_s
        assert abs(e.tokens_per_s / r.tokens_per_s - 1) < 0.2, (plan, e.tokens_per_s,
                                                                 r.tokens_per_s)
    assert max(predicted, key=predicted.__getitem__) == max(replayed, key=replayed.__getitem__)

"""The batch plan's rates measured on the model (forecache.jobs.plan), on the reference model."""

from __future__ import annotations

from pathlib import Path

import pytest

from forecache.cache.cost import Profile
from forecache.cache.plans import Plan, estimate
from forecache.cache.setup import DEFAULT_MACHINE, CacheConfig
from forecache.cache.shape import model_shape
from forecache.jobs.plan import (
    StageSample,
    calibrate,
    job_workload,
    load_profile,
    measure_stages,
    measured_hooks,
    predict_stage,
    save_profile,
)
from forecache.llama import Llama
from forecache.models.default import REFERENCE_MODEL

STOCK = Plan(8, 256, False, "ncmoe")  # llama.cpp's own placement: every expert in place
BUDGET = 1 << 40


@pytest.fixture(scope="module")
def llm() -> Llama:
    with Llama.open(REFERENCE_MODEL, cache=None, n_ctx=256, n_seq_max=8, n_batch=256,
                    n_ubatch=256) as m:
        yield m


def test_stages_are_measured(llm: Llama) -> None:
    got = measure_stages(llm, decode_sizes=(1, 4, 8, 32), prefill_sizes=(32, 128, 512),
                         repeats=3)
    # sizes the context cannot run are left out: 32 sequences, a 512-token ubatch
    assert [(s.kind, s.n) for s in got] == [("decode", 1), ("decode", 4), ("decode", 8),
                                            ("prefill", 32), ("prefill", 128)]
    assert all(s.seconds > 0 and s.rows_s > 0 and s.pass_s >= 0 for s in got)
    dec = {s.n: s for s in got if s.kind == "decode"}
    pre = {s.n: s for s in got if s.kind == "prefill"}
    # more rows take longer, and eight sequences' rows are sampled eight times
    assert dec[8].seconds > dec[1].seconds
    assert pre[128].seconds > pre[32].seconds
    # (a pass's fixed costs are in both: 2.7x was measured on a quiet CI-class machine)
    assert dec[8].rows_s > 1.5 * dec[1].rows_s
    assert all(s.hit is None for s in got)  # no cache, no hit share


def test_cache_stages_carry_their_hit_share() -> None:
    """Stages run through a cache holding half the experts record the share of routed experts
    they found in slots, and the fit learns an expert group's cost from them."""
    cfg = CacheConfig("lru", cache_fraction=0.5)
    with Llama.open(REFERENCE_MODEL, cache=cfg, n_ctx=256, n_seq_max=8, n_batch=256,
                    n_ubatch=256) as m:
        got = measure_stages(m, decode_sizes=(1, 8), prefill_sizes=(128,), repeats=3)
        assert all(s.hit is not None and 0.0 <= s.hit < 1.0 for s in got), got
        assert all(s.hook_s is not None and 0.0 < s.hook_s < s.seconds for s in got), got
        pre = next(s for s in got if s.kind == "prefill")
        # a prompt ubatch routes nearly every expert: about the slots' share of them hits
        assert 0.3 < pre.hit < 0.8, pre  # type: ignore[operator]
        plan = Plan(8, 256, False, "cache")
        prof = calibrate(m, plan, BUDGET, samples=got)
    base = Profile.load(DEFAULT_MACHINE)
    assert prof.group_s != base.group_s  # fitted, not the base profile's
    assert prof.hook_s == measured_hooks(got, model_shape(m.model_file).layers)["hook_s"]
    shape = model_shape(m.model_file)
    ne = m.model_file.non_expert_bytes()
    for s in got:
        outside = prof.token_s + ((s.n if s.kind == "decode" else 1) - 1) * prof.sample_s
        inside = predict_stage(shape, prof, plan, BUDGET, s, ne) - outside
        assert 0.5 < inside / s.seconds < 2.0, s


def test_the_fit_reproduces_the_measured_stages(llm: Llama) -> None:
    samples = measure_stages(llm, repeats=3)
    prof = calibrate(llm, STOCK, BUDGET, samples=samples)
    shape = model_shape(llm.model_file)
    mf = llm.model_file
    ne = mf.non_expert_bytes()
    for s in samples:
        outside = prof.token_s + ((s.n if s.kind == "decode" else 1) - 1) * prof.sample_s
        inside = predict_stage(shape, prof, STOCK, BUDGET, s, ne) - outside
        # every pass the fit was made from within half of what the fit predicts (timings
        # taken again would add the machine's noise, which the benchmark reports)
        assert 0.5 < inside / s.seconds < 2.0, s
    # the CPU build: the device's rates are the host's
    assert prof.cpu_mem_gbps == prof.gpu_mem_gbps and prof.op_offload_min_batch == 0
    work = job_workload([30] * 16, [32] * 16, 128)
    assert work.prompt_len == 30 and work.gen_len == 32 and work.n_requests == 16
    e1 = estimate(shape, prof, BUDGET, work, Plan(1, 256, False, "ncmoe"), non_expert_bytes=ne)
    assert e1 is not None and e1.tokens_per_s > 0


def test_profiles_are_kept_per_model_and_device(llm: Llama, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FORECACHE_CACHE_DIR", str(tmp_path))
    mf = llm.model_file
    assert load_profile(mf, "cpu") is None
    prof = calibrate(llm, STOCK, BUDGET)
    save_profile(mf, "cpu", prof)
    assert load_profile(mf, "cpu") == prof
    assert load_profile(mf, "other device") is None


def test_gate_hooks_are_taken_as_measured() -> None:
    """A one-token step's hooks give the decode gate's cost; larger passes a line by rows."""
    def stage(kind: str, n: int, hook: float | None) -> StageSample:
        return StageSample(kind, n, 32.0, 0.01, hook_s=hook)

    layers = 4
    got = [stage("decode", 1, 4 * 20e-6)] + \
        [stage("decode", n, 4 * (100e-6 + 5e-6 * n)) for n in (2, 4, 8)] + \
        [stage("prefill", n, 4 * (100e-6 + 5e-6 * n)) for n in (32, 64)]
    h = measured_hooks(got, layers)
    assert h["decode_gate_s"] == pytest.approx(20e-6)
    assert h["hook_s"] == pytest.approx(100e-6) and h["hook_row_s"] == pytest.approx(5e-6)
    assert measured_hooks([stage("decode", 4, None)], layers) == {}  # no cache: none measured

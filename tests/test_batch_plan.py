"""The batch plan's rates measured on the model (forecache.jobs.plan), on the reference model."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest

from forecache.cache.cost import Profile
from forecache.jobs.plan import (
    StageSample,
    calibrate,
    job_workload,
    load_profile,
    measure_stages,
    measured_hooks,
    predict_stage,
    profile_with,
    save_profile,
)
from forecache.llama import Llama
from forecache.models.default import REFERENCE_MODEL
from forecache.placement.costs import DEFAULT_MACHINE
from forecache.placement.options import CacheConfig
from forecache.roofline.batch import BatchPlan, estimate
from forecache.roofline.shape import model_shape

STOCK = BatchPlan(8, 256, False, "ncmoe")  # llama.cpp's own placement: every expert in place
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
    # (that more rows take longer is the machine's to show when it is not busy: a step of the
    # tiny model takes milliseconds, and a loaded CPU can give any one of them a second;
    # benchmarks/batch_plans.py measures plans against what the fitted model predicts)
    assert all(s.hit is None for s in got)  # no cache, no hit share


def _as_predicted(llm: Llama, plan: BatchPlan, prof: Profile,
                  samples: list[StageSample]) -> list[StageSample]:
    """``samples`` (their sizes, hit shares, rows' and passes' costs as measured) timed as
    ``prof`` predicts them: stage times without the machine's noise, which a fit must
    reproduce whatever CPU measured them (how well the fit predicts the machine itself is
    benchmarks/batch_plans.py's question)."""
    shape, ne = model_shape(llm.model_file), llm.model_file.non_expert_bytes()
    out = []
    for s in samples:
        outside = prof.token_s + ((s.n if s.kind == "decode" else 1) - 1) * prof.sample_s
        out.append(replace(s, seconds=predict_stage(shape, prof, plan, BUDGET, s, ne) - outside))
    return out


# rates a machine could have, away from where the fit starts: stage times predicted with them are
# what the fit must find its way back to
TRUTH = {"launch_s": 6e-5, "mem_gbps": 9.0, "gflops": 45.0, "seq_s": 7e-6, "group_s": 4e-4}


def _assert_fit_reproduces(llm: Llama, plan: BatchPlan, samples: list[StageSample]) -> Profile:
    """The fit of stage times that known rates predict (``TRUTH``, with the rows', passes' and
    hooks' costs as measured) reproduces them: the fit finds a profile where one exists,
    whatever CPU measured the samples and however busy it was. Returns the profile fitted to
    ``samples`` themselves."""
    prof = calibrate(llm, plan, BUDGET, samples=samples)
    for rate in (prof.gpu_mem_gbps, prof.gpu_tflops, prof.gpu_launch_s, prof.token_s):
        assert math.isfinite(rate) and rate > 0, prof
    truth = profile_with(prof, {**TRUTH, "token_s": prof.token_s, "sample_s": prof.sample_s,
                                "hook_s": prof.hook_s}, on_cpu=True)
    timed = _as_predicted(llm, plan, truth, samples)
    again = calibrate(llm, plan, BUDGET, samples=timed)
    for want, got in zip(timed, _as_predicted(llm, plan, again, samples), strict=True):
        assert 0.9 < got.seconds / want.seconds < 1.1, (want, got)
    return prof


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
        prof = _assert_fit_reproduces(m, BatchPlan(8, 256, False, "cache"), got)
        base = Profile.load(DEFAULT_MACHINE)
        assert prof.group_s != base.group_s  # fitted, not the base profile's
        assert prof.hook_s == measured_hooks(got, model_shape(m.model_file).layers)["hook_s"]


def test_the_fit_reproduces_the_measured_stages(llm: Llama) -> None:
    samples = measure_stages(llm, repeats=3)
    prof = _assert_fit_reproduces(llm, STOCK, samples)
    shape = model_shape(llm.model_file)
    ne = llm.model_file.non_expert_bytes()
    # the CPU build: the device's rates are the host's
    assert prof.cpu_mem_gbps == prof.gpu_mem_gbps and prof.op_offload_min_batch == 0
    work = job_workload([30] * 16, [32] * 16, 128)
    assert work.prompt_len == 30 and work.gen_len == 32 and work.n_requests == 16
    e1 = estimate(shape, prof, BUDGET, work, BatchPlan(1, 256, False, "ncmoe"), non_expert_bytes=ne)
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

"""The simulator against measured runs on the CPU build: the validation's machinery. The figures,
and the 15% check against them, are benchmarks/sim_validate.py's (recorded in BENCHMARKS.md):
timings taken in a unit test on a shared machine are too noisy to hold to a tolerance."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from forecache.cache.cost import Profile
from forecache.gguf.header import read_model_file
from forecache.models.default import REFERENCE_MODEL
from forecache.sim.calibrate import Measured, fit_profile, model_shape, simulate_measured, validate
from forecache.sim.shapes import shape_of
from forecache.trace.format import Request


def test_model_shape_matches_the_preset() -> None:
    got = model_shape(read_model_file(REFERENCE_MODEL))
    want = shape_of("reference", "q8_0")
    assert (got.layers, got.experts, got.top_k, got.d_model, got.expert_ff) == \
        (want.layers, want.experts, want.top_k, want.d_model, want.expert_ff)
    assert got.proj_bytes == want.proj_bytes


def _requests(n: int, seed: int = 0) -> list[Request]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        ex = np.stack([np.stack([rng.choice(32, 4, replace=False) for _ in range(8)])
                       for _ in range(30)]).astype(np.int16)
        out.append(Request(experts=ex, phase=(np.arange(30) >= 20).astype(np.int8)))
    return out


def test_fit_recovers_a_known_machine() -> None:
    """'Measurements' simulated with a known profile: the fit finds times that match them."""
    shape = shape_of("reference", "q8_0")
    reqs = _requests(3)
    truth = replace(Profile.load("rtx4090"), gpu_launch_s=4e-5, cpu_launch_s=4e-5,
                    gpu_mem_gbps=30.0, cpu_mem_gbps=30.0, gpu_tflops=0.08, cpu_gflops=80.0,
                    hook_s=9e-5, prefetch_hook_s=2e-4, token_s=3e-4, chunk_latency_s=2e-5,
                    group_s=5e-5, h2d_gbps=12.0)
    runs = [Measured("offload", "offload", 1.0, 0, 0), Measured("lru", "lru", 1.0, 0, 0),
            Measured("promoe", "promoe", 1.0, 0, 0), Measured("lru 1/4", "lru", 0.25, 0, 0),
            Measured("promoe 1/4", "promoe", 0.25, 0, 0)]
    for m in runs:
        m.ttft_s, m.tpot_s = simulate_measured(m, shape, truth, reqs[0], reqs[1:])
    start = Profile.load("rtx4090")
    before = [simulate_measured(m, shape, start, reqs[0], reqs[1:]) for m in runs]
    fitted = fit_profile(start, shape, runs, reqs[0], reqs[1:], {"h2d_gbps": 12.0}, "t", "t",
                         iters=70)
    for m, b in zip(runs, before, strict=True):
        t1, t2 = simulate_measured(m, shape, fitted, reqs[0], reqs[1:])
        assert abs(t2 / m.tpot_s - 1) < 0.05, m.label
        assert abs(t1 / m.ttft_s - 1) < 0.1, m.label
        assert abs(b[1] / m.tpot_s - 1) > 0.1  # the starting profile was far off
    # predicts a run it was not fitted to
    other = Measured("lru 1/2", "lru", 0.5, 0, 0)
    want = simulate_measured(other, shape, truth, reqs[0], reqs[1:])
    got = simulate_measured(other, shape, fitted, reqs[0], reqs[1:])
    assert abs(got[1] / want[1] - 1) < 0.1


def test_validate_measures_fits_and_simulates() -> None:
    v = validate(REFERENCE_MODEL, prompt_len=32, n_gen=8, n_prompts=2, fraction=0.5,
                 calib_fraction=0.25, fit_iters=15)
    assert [m.label for m in v.calibration] == ["offload", "lru, all cached",
                                                "promoe, all cached", "lru, 0.25",
                                                "promoe, 0.25"]
    assert [m.label for m in v.validation] == ["lru, 0.5", "promoe, 0.5", "ncmoe, 0.5"]
    # ncmoe keeps half of the reference model's 8 MoE layers whole on the device
    assert v.validation[2].n_slots is not None and v.validation[2].n_slots * 8 // 32 == 4
    for m in v.calibration + v.validation:
        assert m.ttft_s > 0 and m.tpot_s > 0 and m.sim_ttft_s > 0 and m.sim_tpot_s > 0
        assert all(math.isfinite(e) for e in m.errors())
    assert v.validation[0].stats["hits"] > 0 and v.validation[0].stats["misses"] > 0
    p = v.profile
    assert p.gpu_launch_s == p.cpu_launch_s and p.h2d_gbps > 0 and p.prefetch_hook_s > 0
    out = v.to_json()
    assert out["worst_error"] == v.worst_error() and len(out["validation"]) == 3

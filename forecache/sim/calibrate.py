"""Checking the simulator against measured runs on this machine.

The routing of a workload is recorded once (it is the same under every policy: they are lossless),
a profile of this machine is fitted to measured runs of calibration policies, and the simulator,
with that profile, predicts the TTFT and TPOT of other policies, which are then measured.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from forecache.cache.cost import Profile
from forecache.cache.prefetcher import Features
from forecache.generate import SamplingParams, generate
from forecache.gguf.header import ModelFile
from forecache.jobs.fit import minimise
from forecache.llama import Llama
from forecache.placement.build import attach_observer
from forecache.placement.options import CacheConfig
from forecache.predictor.history import HistoryPredictor
from forecache.record import RouteRecorder, all_rows_computed
from forecache.sim.shapes import ModelShape, model_shape
from forecache.sim.simulate import SimConfig, Simulator
from forecache.trace.format import Request

# Profile fields fitted to the calibration runs: on a CPU build the "device" is the same CPU, so
# device and host share their rates.
FITTED = ("launch_s", "mem_gbps", "gflops", "hook_s", "prefetch_hook_s", "token_s",
          "chunk_latency_s", "group_s")


def record_routing(llm: Llama, prompts: Sequence[list[int]], n_gen: int) -> list[Request]:
    """The routing of every row of each prompt and its greedy continuation (one Request each)."""
    model = llm.model_file
    layers = model.moe_layers()
    rec = RouteRecorder({il: i for i, il in enumerate(layers)}, False)
    assert llm.placement is not None
    hook = attach_observer(llm.ctx, model, llm.placement.device.index, rec)
    out = []
    try:
        for tokens in prompts:
            rec.reset()
            llm.reset()
            with all_rows_computed(llm):
                res = generate(llm, tokens, n_gen, SamplingParams(greedy=True),
                               ignore_eos=True)
            experts, _, _ = rec.request_arrays()
            full = np.full((experts.shape[0], model.n_layer, experts.shape[2]), -1, np.int16)
            full[:, layers] = experts
            phase = (np.arange(experts.shape[0]) >= len(tokens)).astype(np.int8)
            fed = np.asarray((tokens + res.tokens)[:experts.shape[0]], dtype=np.int32)
            out.append(Request(experts=full, token_ids=fed, phase=phase))
    finally:
        hook.close()
    return out


@dataclass
class Measured:
    """One policy measured on the workload, and what the simulator makes of it."""

    label: str
    policy: str
    fraction: float
    ttft_s: float
    tpot_s: float
    sim_ttft_s: float = 0.0
    sim_tpot_s: float = 0.0
    stats: dict = field(default_factory=dict, repr=False)  # the expert cache's counters
    n_slots: int | None = None  # simulated slots per layer, when not ``fraction`` of the experts

    def errors(self) -> tuple[float, float]:
        """Relative errors of the simulated TTFT and TPOT."""
        return (self.sim_ttft_s / self.ttft_s - 1.0, self.sim_tpot_s / self.tpot_s - 1.0)


def cpu_profile(base: Profile, x: dict[str, float], name: str, device: str) -> Profile:
    """``base`` with the fitted CPU-build values ``x`` (device and host rates shared)."""
    return replace(base, name=name, device=device, op_offload_min_batch=0,
                   gpu_launch_s=x["launch_s"],
                   cpu_launch_s=x["launch_s"], gpu_mem_gbps=x["mem_gbps"],
                   cpu_mem_gbps=x["mem_gbps"], gpu_tflops=x["gflops"] / 1e3,
                   cpu_gflops=x["gflops"], hook_s=x["hook_s"],
                   prefetch_hook_s=x["prefetch_hook_s"], token_s=x["token_s"],
                   chunk_latency_s=x["chunk_latency_s"], group_s=x["group_s"])


def simulate_measured(m: Measured, shape: ModelShape, profile: Profile,
                      warmup: Request, requests: Sequence[Request]) -> tuple[float, float]:
    """TTFT and TPOT the simulator gives run ``m`` (after the same warm-up request), as the CPU
    build runs it: promoe predicts with history at window 1, does not split (device and host
    are the same cores) and has no stage slots."""
    n_slots = m.n_slots or max(1, math.ceil(m.fraction * shape.experts - 1e-9))
    cfg = SimConfig(policy=m.policy, n_slots=n_slots, window=1, n_ubatch=512,
                    features=Features(split=False), stage_slots=0)
    layers = [il for il in range(shape.layers) if (requests[0].experts[:, il] >= 0).any()]
    pred = HistoryPredictor(shape.layers, shape.experts, shape.top_k) \
        if m.policy == "promoe" else None
    sim = Simulator(shape, profile, cfg, layers, pred)
    sim.run_request(warmup)
    ttft, tpot = [], []
    for r in requests:
        p, d = sim.run_request(r)
        ttft.append(p)
        tpot.append(float(np.mean(d)) if d else 0.0)
    return float(np.median(ttft)), float(np.median(tpot))


def fit_profile(base: Profile, shape: ModelShape, runs: Sequence[Measured], warmup: Request,
                requests: Sequence[Request], fixed: dict[str, float], name: str,
                device: str, iters: int = 120) -> Profile:
    """The CPU-build profile whose simulation best matches ``runs`` (least squares of the log
    ratios of TTFT and TPOT); ``fixed`` holds the values measured directly (copy rate, the
    decode gate's time)."""
    start = {"launch_s": 2e-5, "mem_gbps": 10.0, "gflops": 50.0, "hook_s": 5e-5,
             "prefetch_hook_s": 1e-4, "token_s": 2e-4, "chunk_latency_s": 1e-5,
             "group_s": 5e-5}
    x0 = np.log([start[k] for k in FITTED])

    def profile_of(v: np.ndarray) -> Profile:
        p = cpu_profile(base, dict(zip(FITTED, np.exp(v).tolist(), strict=True)), name, device)
        return replace(p, **fixed)

    def loss(v: np.ndarray) -> float:
        p = profile_of(v)
        err = 0.0
        for m in runs:
            t1, t2 = simulate_measured(m, shape, p, warmup, requests)
            err += math.log(t1 / m.ttft_s) ** 2 + math.log(t2 / m.tpot_s) ** 2
        return err

    return profile_of(minimise(loss, x0, iters=iters, tol=1e-3, restarts=2))


@dataclass
class Validation:
    """Calibration and validation runs with the fitted profile."""

    shape: ModelShape
    profile: Profile
    calibration: list[Measured]
    validation: list[Measured]
    prompt_len: int
    n_gen: int
    n_prompts: int

    def worst_error(self) -> float:
        """Largest relative TTFT or TPOT error of the validation runs."""
        return max(abs(e) for m in self.validation for e in m.errors())

    def to_json(self) -> dict:
        def runs(ms: list[Measured]) -> list[dict]:
            return [{**{k: v for k, v in asdict(m).items() if k != "stats"},
                     "ttft_err": m.errors()[0], "tpot_err": m.errors()[1]} for m in ms]

        return {"shape": asdict(self.shape), "profile": asdict(self.profile),
                "prompt_len": self.prompt_len, "gen": self.n_gen, "prompts": self.n_prompts,
                "calibration": runs(self.calibration), "validation": runs(self.validation),
                "worst_error": self.worst_error()}


def _ncmoe_budget(model: ModelFile, fraction: float, n_ctx: int) -> tuple[int, int]:
    """A device budget whose ncmoe placement keeps ``fraction`` of the MoE layers' experts on
    the device (rounded to whole layers), and that number of layers."""
    from forecache.cache.budget import split_budget
    from forecache.native.ggml_devices import cache_device

    dev = cache_device()
    plan = split_budget(model, dev.memory_total, n_ctx=n_ctx, n_ubatch=512,
                       device_name=dev.name, device_total=dev.memory_total)
    on_gpu = round(fraction * len(plan.moe_layers))
    return plan.ncmoe_budget(len(plan.moe_layers) - on_gpu) + (1 << 20), on_gpu


def validate(model_path: Path, *, prompt_len: int = 128, n_gen: int = 32, n_prompts: int = 3,
             fraction: float = 0.5, calib_fraction: float = 0.25, repeats: int = 1,
             fit_iters: int = 120,
             n_threads: int | None = None, name: str = "cpu",
             device: str = "this machine (CPU build)",
             progress: Callable[[str], None] = lambda s: None) -> Validation:
    """Fit a profile of this machine (CPU build) to ``offload``, to ``lru`` and ``promoe`` with
    every expert cached, and to both at ``calib_fraction`` (the costs of a miss and of streamed
    expert groups), on one workload; then measure and simulate ``lru`` and ``promoe`` at
    ``fraction``, and ``ncmoe`` with that share of the MoE layers' experts on the device. The
    copy rate is this machine's memcpy rate (a CPU build's copies are memcpy). Every run is
    measured ``repeats`` times, the runs taking turns, and the medians over all prompts and
    repeats are kept: a machine whose speed drifts affects every run alike.
    """
    from forecache.bench import bench_prompts, run_policy
    from forecache.doctor import host_memory_bandwidth_gbps

    n_ctx = max(512, prompt_len + n_gen + 16)
    with Llama.open(model_path, cache=CacheConfig(policy="offload"), n_ctx=n_ctx,
                    n_threads=n_threads) as llm:
        prompts = bench_prompts(llm, n_prompts, prompt_len)
        progress("recording the workload's routing ...")
        warmup = record_routing(llm, [prompts[0][:8]], 2)[0]
        requests = record_routing(llm, prompts, n_gen)
        shape = model_shape(llm.model_file)
        ncmoe_budget, on_gpu = _ncmoe_budget(llm.model_file, fraction, n_ctx)

    runs = [("offload", "offload", 1.0), ("lru, all cached", "lru", 1.0),
            ("promoe, all cached", "promoe", 1.0),
            (f"lru, {calib_fraction:g}", "lru", calib_fraction),
            (f"promoe, {calib_fraction:g}", "promoe", calib_fraction),
            (f"lru, {fraction:g}", "lru", fraction), (f"promoe, {fraction:g}", "promoe", fraction),
            (f"ncmoe, {fraction:g}", "ncmoe", fraction)]
    samples: dict[str, list[tuple[float, float]]] = {label: [] for label, _, _ in runs}
    stats: dict[str, dict] = {}
    for rep in range(repeats):  # every run is measured before the fit, the runs taking turns
        for label, policy, frac in runs:
            progress(f"measuring {label} ({rep + 1}/{repeats}) ...")
            if policy == "ncmoe":
                cfg = CacheConfig(policy=policy, gpu_budget=ncmoe_budget)
            else:
                cfg = CacheConfig(policy=policy,
                                  cache_fraction=None if policy == "offload" else frac,
                                  predictor="history")
            r = run_policy(model_path, cfg, prompts, n_gen, n_ctx=n_ctx, n_threads=n_threads)
            samples[label] += r["per_prompt"]
            stats[label] = r["stats"]
    measured = []
    for label, policy, frac in runs:
        # medians: a prompt disturbed by another process moves a mean
        ttft, tpot = np.median(np.asarray(samples[label]), axis=0).tolist()
        # ncmoe keeps ``on_gpu`` whole layers on the device: as many slots per layer in all
        slots = math.ceil(on_gpu * shape.experts / shape.layers) if policy == "ncmoe" else None
        measured.append(Measured(label, policy, frac, ttft, tpot, stats=stats[label],
                                 n_slots=slots))
    calib, checks = measured[:5], measured[5:]
    fixed = {"h2d_gbps": host_memory_bandwidth_gbps() / 2}
    # the decode gate times itself: measured, not fitted
    gates = [m.stats for m in calib if m.policy == "promoe" and m.stats.get("decode_gates")]
    if gates:
        fixed["decode_gate_s"] = (sum(g["decode_gate_s"] for g in gates)
                                  / sum(g["decode_gates"] for g in gates))
    progress("fitting the profile ...")
    prof = fit_profile(Profile.load("rtx4090"), shape, calib, warmup, requests, fixed, name,
                       device, fit_iters)
    prof = replace(prof, source=f"fitted by forecache.sim.calibrate to offload, lru and promoe "
                                f"(every expert cached, and at {calib_fraction:g}) on "
                                f"{model_path.name}, {n_prompts} prompts of {prompt_len} "
                                f"tokens, {n_gen} generated; copies at the memcpy rate")
    for m in calib + checks:
        m.sim_ttft_s, m.sim_tpot_s = simulate_measured(m, shape, prof, warmup, requests)
    return Validation(shape, prof, calib, checks, prompt_len, n_gen, n_prompts)

"""A batch job's plan on this machine: the roofline model's rates measured on the loaded model,
and the plan it predicts fastest for the job's requests.

``roofline.batch`` predicts a plan from a machine profile. Here the profile's rates are fitted to
stage times measured on the model itself, as MoE-Lightning profiles peak rates rather than
trusting a datasheet: decode steps of a few sequences and prompt ubatches of a few sizes, each
timed around ``llama_decode`` with its rows' sampling. The fitted profile is kept per model and
device in the cache directory, so a job measures once.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import numpy as np

from forecache.cache.budget import format_size
from forecache.cache.cost import Profile
from forecache.errors import setting
from forecache.gguf.header import ModelFile
from forecache.gguf.identity import fingerprint
from forecache.jobs.fit import minimise
from forecache.llama import Llama
from forecache.native.libs import MAX_SEQUENCES
from forecache.paths import cache_dir, write_atomic
from forecache.placement.before import banks_asked
from forecache.placement.costs import DEFAULT_MACHINE
from forecache.placement.options import DEFAULT_POLICY, CacheConfig
from forecache.roofline.batch import (
    MICRO_MAX,
    BatchPlan,
    Estimate,
    Layout,
    Workload,
    layout,
    search,
    ubatch_stage,
)
from forecache.roofline.shape import ModelShape, model_shape

# what the fit moves: rates and the runtime's fixed costs (log-space)
FITTED = ("launch_s", "mem_gbps", "gflops", "seq_s", "token_s", "sample_s", "hook_s",
          "group_s")
# ^ the profile fields a calibration sets; the rows' sampling is measured, the rest fitted
DECODE_SIZES = (1, 2, 4, 8, 16)
PREFILL_SIZES = (32, 64, 128, 256)
CONTEXT = 32  # tokens each measured sequence holds before its decode steps
STOCK_BUDGET = 1 << 50  # llama.cpp's own placement: no budget binds


@dataclass(frozen=True)
class StageSample:
    """One measured stage: a decode step of ``n`` sequences, or a prompt ubatch of ``n``
    tokens, with ``context`` tokens of attention each (a prompt ubatch: its mean):
    ``seconds`` in ``llama_decode``, ``rows_s`` reading, sampling and detokenizing its rows,
    ``pass_s`` the rest of the pass in Python; ``hit`` the share of a layer's distinct routed
    experts the cache found in its slots (None without a cache)."""

    kind: str  # "decode" | "prefill"
    n: int
    context: float
    seconds: float
    rows_s: float = 0.0
    pass_s: float = 0.0  # building the batch and starting the pass, outside llama_decode
    hit: float | None = None
    hook_s: float | None = None  # the cache's gate hooks, a pass (mean)


def measure_stages(llm: Llama, *, decode_sizes: Sequence[int] = DECODE_SIZES,
                   prefill_sizes: Sequence[int] = PREFILL_SIZES, repeats: int = 5
                   ) -> list[StageSample]:
    """Median seconds of decode steps (one token of each of n sequences, every row's logits
    read and its token picked) and of prompt ubatches, on ``llm`` as loaded."""
    from llama_cpp import llama_cpp as low

    from forecache.batch import sample
    from forecache.generate import SamplingParams

    ctx = llm.ctx
    mem = low.llama_get_memory(ctx)
    n_vocab = llm.n_vocab()
    greedy = SamplingParams(greedy=True, temperature=0.0)
    rng = np.random.default_rng(0)
    most = max(max(decode_sizes, default=1), 1)
    batch = low.llama_batch_init(max(llm.n_batch, most, *prefill_sizes), 0, 1)
    cache = llm.expert_cache
    out: list[StageSample] = []
    tokens = np.random.default_rng(1).integers(100, min(n_vocab, 1000), 4096).tolist()

    def run(rows: list[tuple[int, int, int, bool]]) -> tuple[float, float, float]:
        """Decode rows of (token, pos, seq, logits): seconds in the pass, in its rows'
        sampling and detokenizing (as ``batch.decode_many`` handles them), and building it."""
        start = time.perf_counter()
        for i, (tok, pos, seq, want) in enumerate(rows):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos, 1
            batch.seq_id[i][0], batch.logits[i] = seq, want
        batch.n_tokens = len(rows)
        if cache is not None:
            cache.begin_ubatch(np.asarray([r[0] for r in rows], dtype=np.int32))
        t0 = time.perf_counter()
        rc = low.llama_decode(ctx, batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode failed ({rc}) while measuring this machine")
        t1 = time.perf_counter()
        for i, r in enumerate(rows):
            if r[3]:
                logits = np.ctypeslib.as_array(low.llama_get_logits_ith(ctx, i),
                                               shape=(n_vocab,))
                llm.detokenize([sample(logits, greedy, rng)], prev_tokens=[r[0]])
        return t1 - t0, time.perf_counter() - t1, t0 - start

    def counters() -> tuple[float, float, float]:
        """The cache's hits, misses and seconds in gate hooks (in Python or decided in C)."""
        if cache is None:
            return 0, 0, 0.0
        s = cache.stats()
        return s["hits"], s["misses"], s["hook_s"] + s["decode_gate_s"]

    def timed(passes: Callable[[int], list[tuple[int, int, int, bool]]]) -> dict:
        """``repeats`` passes after one that warms the graph: their median times, hit share
        and gate-hook seconds a pass."""
        run(passes(0))
        before = counters()
        times = np.median(np.array([run(passes(r)) for r in range(1, repeats + 1)]), axis=0)
        h, m, g = (a - b for a, b in zip(counters(), before, strict=True))
        cached = cache is not None and h + m > 0
        return {"seconds": float(times[0]), "rows_s": float(times[1]),
                "pass_s": float(times[2]), "hit": h / (h + m) if cached else None,
                "hook_s": g / repeats if cached else None}

    def prompt(u: int, r: int) -> list[tuple[int, int, int, bool]]:
        low.llama_memory_clear(mem, True)  # each prompt ubatch from an empty cache
        return [(tokens[(r + j) % 4096], j, 0, j == u - 1) for j in range(u)]

    try:
        for n in sorted(d for d in decode_sizes if d <= llm.n_seq_max):
            low.llama_memory_clear(mem, True)
            for s in range(n):  # each sequence's context, then steps of one token each
                run([(tokens[(s * 7 + j) % 4096], j, s, False) for j in range(CONTEXT)])
            out.append(StageSample("decode", n, CONTEXT + repeats / 2, **timed(
                lambda r, n=n: [(tokens[(s + r) % 4096], CONTEXT + r, s, True)
                                for s in range(n)])))
        for u in sorted(x for x in prefill_sizes if x <= llm.n_batch):
            out.append(StageSample("prefill", u, u / 2,
                                   **timed(lambda r, u=u: prompt(u, r))))
    finally:
        low.llama_memory_clear(mem, True)
        low.llama_batch_free(batch)
    return out


def profile_with(base: Profile, x: dict[str, float], on_cpu: bool) -> Profile:
    """``base`` with the fitted values ``x``: on a CPU build the device's rates are the host's."""
    p = replace(base, gpu_launch_s=x["launch_s"], gpu_mem_gbps=x["mem_gbps"],
                gpu_tflops=x["gflops"] / 1e3, token_s=x["token_s"], sample_s=x["sample_s"],
                hook_s=x["hook_s"], prefetch_hook_s=x["hook_s"], group_s=x["group_s"],
                seq_s=x["seq_s"])
    if "hook_row_s" in x:  # the gate hooks as measured
        p = replace(p, hook_row_s=x["hook_row_s"], decode_gate_s=x["decode_gate_s"])
    if on_cpu:
        p = replace(p, cpu_launch_s=x["launch_s"], cpu_mem_gbps=x["mem_gbps"],
                    cpu_gflops=x["gflops"], op_offload_min_batch=0)
    return p


def stage_layout(shape: ModelShape, plan: BatchPlan, budget: int,
                 non_expert_bytes: int | None = None, bank: bool = False) -> Layout:
    """The layout the measured stages ran under: ``plan`` at ``budget`` (``bank``: with the
    prompt banks the runtime placed)."""
    lay = layout(shape, budget, Workload(1, CONTEXT, 1, CONTEXT + 64), plan, non_expert_bytes,
                 bank=bank)
    if lay is None:
        raise ValueError(f"plan {plan.label()} does not fit {format_size(budget)}")
    return lay


def predict_stage(shape: ModelShape, profile: Profile, plan: BatchPlan, budget: int,
                  sample_: StageSample, non_expert_bytes: int | None = None,
                  lay: Layout | None = None) -> float:
    """The model's seconds for a measured stage under ``plan``'s layout (``lay``, when known),
    at the hit share the stage measured."""
    from forecache.cache.cost import CostModel

    lay = lay or stage_layout(shape, plan, budget, non_expert_bytes)
    cost = CostModel.from_profile(profile, shape.expert)
    rows = sample_.n if sample_.kind == "decode" else 1  # with logits; and sequences
    resident = lay.share if sample_.hit is None else sample_.hit
    return ubatch_stage(shape, profile, cost, plan, sample_.n, sample_.context, resident,
                        lay.host_layers, rows, lay.slots, lay.stage, rows, lay.bank).seconds


def measured_hooks(samples: Sequence[StageSample], layers: int) -> dict[str, float]:
    """The gate hooks' cost a layer as the stages measured it: a one-token decode step's
    (``decode_gate_s``), and a line through the larger passes' by the rows they route
    (``hook_s`` + rows x ``hook_row_s``). Empty where nothing was measured (no cache): the
    base profile's, measured by benchmarks/hook_cost.py, stand (fitted beside the rates they
    are ill-posed)."""
    got = [(s.n, s.hook_s / max(layers, 1)) for s in samples if s.hook_s is not None]
    many = [(n, h) for n, h in got if n > 1]
    if not many:
        return {}
    one = [h for n, h in got if n == 1]
    n = np.array([x for x, _ in many], np.float64)
    h = np.array([y for _, y in many], np.float64)
    slope = 0.0
    if len(set(n.tolist())) > 1:
        slope = max(float(np.polyfit(n, h, 1)[0]), 0.0)
    base = max(float(np.mean(h - slope * n)), 0.0)
    return {"hook_s": base, "hook_row_s": slope,
            "decode_gate_s": float(np.median(one)) if one else 0.0}


def fit_profile(shape: ModelShape, base: Profile, plan: BatchPlan, budget: int,
                samples: Sequence[StageSample], *, on_cpu: bool,
                non_expert_bytes: int | None = None, bank: bool = False) -> Profile:
    """The profile whose predictions best match ``samples``: the rows' sampling, the pass's
    Python and the cache's gate hooks are measured (``sample_s`` per row, ``token_s``,
    ``measured_hooks``), the passes' times are
    fitted (least squares of log ratios) by the device's launch cost, memory and compute rates
    and a sequence's KV stream, and, where the stages missed experts, an expert group's cost
    (each stage at the hit share it measured). ``bank``: the stages ran with prompt banks."""
    rows = [(s.rows_s, s.n if s.kind == "decode" else 1) for s in samples if s.rows_s > 0]
    per_row = sum(t for t, _ in rows) / max(sum(n for _, n in rows), 1)
    per_pass = float(np.median([s.pass_s for s in samples])) if samples else 0.0
    # token_s is what a pass costs outside llama_decode with one row sampled (each further
    # row's sampling is sample_s)
    start = {"launch_s": 2e-5, "mem_gbps": 20.0, "gflops": 100.0, "seq_s": 2e-5,
             "token_s": per_pass + per_row, "sample_s": per_row,
             "hook_s": base.prefetch_hook_s or base.hook_s, "group_s": base.group_s}
    start.update(measured_hooks(samples, shape.layers))
    names = ["launch_s", "mem_gbps", "gflops", "seq_s"]
    if any(s.hit is not None and s.hit < 1 for s in samples):
        # stages that streamed experts in measure what an expert group costs on this machine
        names.append("group_s")
    x0 = np.log([start[k] for k in names])
    outside = per_pass + per_row  # of a pass with one row sampled

    def of(v: np.ndarray) -> Profile:
        return profile_with(base, {**start, **dict(zip(names, np.exp(v).tolist(),
                                                       strict=True))}, on_cpu)

    lay = stage_layout(shape, plan, budget, non_expert_bytes, bank)

    def loss(v: np.ndarray) -> float:
        p = of(v)
        err = 0.0
        for s in samples:
            pred = predict_stage(shape, p, plan, budget, s, non_expert_bytes, lay)
            n_rows = s.n if s.kind == "decode" else 1
            # the measured pass is the prediction less what the runtime spends outside it
            inside = pred - outside - (n_rows - 1) * per_row
            err += math.log(max(inside, 1e-7) / s.seconds) ** 2
        # a weak pull to the start keeps parameters the samples barely constrain in range
        return err + 1e-3 * float(np.sum((v - x0) ** 2))

    return of(minimise(loss, x0))


def _record(model: ModelFile, device: str) -> Path:
    return cache_dir() / "measured" / f"plan-{fingerprint(model)[:32]}.json"


def load_profile(model: ModelFile, device: str) -> Profile | None:
    """The profile fitted for ``model`` on ``device`` by an earlier job, if any."""
    try:
        raw = json.loads(_record(model, device).read_text()).get(device)
        names = {f.name for f in fields(Profile)}
        return Profile(**{k: v for k, v in raw.items() if k in names}) if raw else None
    except (OSError, ValueError, TypeError, AttributeError):
        return None  # none yet, or unreadable: measured again


def save_profile(model: ModelFile, device: str, profile: Profile) -> None:
    """Keep ``profile`` for ``model`` on ``device``."""
    path = _record(model, device)
    try:
        data = json.loads(path.read_text())
        data = data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        data = {}
    data[device] = asdict(profile)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(data, indent=1).encode())


def calibrate(llm: Llama, plan: BatchPlan, budget: int, *,
              samples: Sequence[StageSample] | None = None,
              progress: Callable[[str], None] = lambda s: None) -> Profile:
    """Measure ``llm`` (loaded as ``plan`` places it, at ``budget``) and fit the profile;
    ``samples`` already measured on it are fitted instead of measuring again."""
    dev = llm.placement.device if llm.placement is not None else None
    on_cpu = dev is None or dev.type == "cpu"
    if samples is None:
        progress("measuring this machine for the batch plan (once per model) ...")
        samples = measure_stages(llm)
    shape = model_shape(llm.model_file)
    base = Profile.load(DEFAULT_MACHINE)
    if on_cpu:
        from forecache.doctor import host_memory_bandwidth_gbps

        base = replace(base, h2d_gbps=host_memory_bandwidth_gbps() / 2, dram_gbps=0.0,
                       name="measured", device="this machine (CPU build)")
    mf = llm.model_file
    return fit_profile(shape, base, plan, budget, samples, on_cpu=on_cpu,
                       non_expert_bytes=mf.non_expert_bytes(),
                       bank=llm.placement is not None and llm.placement.bank)


def job_workload(prompt_lens: Sequence[int], max_tokens: Sequence[int],
                 ctx_per_seq: int) -> Workload:
    """A job's workload from its requests' prompt lengths and answer limits."""
    n = max(len(prompt_lens), 1)
    return Workload(len(prompt_lens), sum(prompt_lens) / n, sum(max_tokens) / n, ctx_per_seq,
                    tuple(int(m) for m in max_tokens), tuple(int(p) for p in prompt_lens))


@dataclass(frozen=True)
class Chosen:
    """The plan a job runs, what the model predicts of it, and the placement it opens with."""

    plan: BatchPlan
    estimate: Estimate
    cache: CacheConfig | None  # None: llama.cpp's own placement (a CPU build given no size)
    cpu_only: bool = False  # no GPU: the device the plan was priced on is the CPU

    def line(self) -> str:
        """The plan's one line, as the job prints it (on a machine without a GPU, in the
        CPU's and host memory's words)."""
        return self.estimate.line("llama.cpp's own placement" if self.cache is None else None,
                                  cpu_only=self.cpu_only)


def plan_cache(cfg: CacheConfig | None, plan: BatchPlan) -> CacheConfig | None:
    """The placement ``plan`` asks of ``cfg``: its experts in forecache's cache (the policy
    asked for, promoe by default) or stock llama.cpp's ncmoe layers."""
    if cfg is None:
        return None
    if plan.experts == "ncmoe":
        if cfg.gpu_budget is None:
            raise ValueError(f"plan {plan.label()}: ncmoe places whole layers and needs "
                             f"{setting('gpu_budget')}")
        return replace(cfg, policy="ncmoe")
    if not cfg.spec.cached:
        raise ValueError(f"plan {plan.label()} caches experts, but {setting('policy')} is "
                         f"{cfg.policy}: add experts=ncmoe to the plan or name a cache policy")
    # micro-batches read the prompt banks
    return replace(cfg, policy=cfg.policy or DEFAULT_POLICY,
                   prompt_bank=True if plan.micro > 1 else cfg.prompt_bank)


def choose_plan(model_path: str | Path, cfg: CacheConfig | None, prompt_lens: Sequence[int],
                max_tokens: Sequence[int], ctx_per_seq: int, *, n_threads: int | None = None,
                max_seq: int = MAX_SEQUENCES,
                progress: Callable[[str], None] = lambda s: None) -> Chosen:
    """The plan predicted fastest for a job of these prompt lengths and answer limits, under
    the placement options ``cfg``: the sequences decoded together, the ubatch, where the KV
    cache lives (on a GPU), and, where no policy was named, forecache's cache or stock
    llama.cpp's ncmoe layers. This machine's rates come from an earlier job's measurement, or
    are measured now on the model (a few seconds) and kept."""
    from forecache.cache.budget import fraction_slots
    from forecache.gguf.header import require_moe
    from forecache.native.ggml_devices import cache_device

    mf = require_moe(model_path)
    shape = model_shape(mf)
    ne = mf.non_expert_bytes()
    dev = cache_device()
    on_cpu = dev.type == "cpu"
    work = job_workload(prompt_lens, max_tokens, ctx_per_seq)
    if cfg is None:  # llama.cpp's own placement: every expert where the weights are
        experts: tuple[str, ...] = ("ncmoe",)
        budget = STOCK_BUDGET
    elif cfg.spec.placement == "host":
        raise ValueError(f"{setting('policy')} offload has no plan to search: give "
                         f"{setting('n_parallel')} or a cache policy")
    else:
        experts = ("cache", "ncmoe") if cfg.policy is None and cfg.gpu_budget is not None else \
            ("ncmoe",) if cfg.spec.placement == "layers" else ("cache",)
        budget = cfg.gpu_budget if cfg.gpu_budget is not None else STOCK_BUDGET
    slots = fraction_slots(mf.n_expert, cfg.cache_fraction) \
        if cfg is not None and cfg.cache_fraction is not None else None
    key = f"{dev.name} ({dev.type})"
    profile = load_profile(mf, key)
    if profile is None:
        first = BatchPlan(min(16, max_seq, max(len(prompt_lens), 1)), 512, False, experts[0])
        with Llama.open(model_path, cache=plan_cache(cfg, first), n_ctx=ctx_per_seq,
                        n_seq_max=first.n_seq, n_threads=n_threads, n_batch=first.n_ubatch,
                        n_ubatch=first.n_ubatch) as llm:
            profile = calibrate(llm, first, budget, progress=progress)
        save_profile(mf, key, profile)
    # prompt banks where the runtime places them, for the cache plans (the others have none)
    bank = cfg is not None and "cache" in experts and \
        banks_asked(replace(cfg, policy=cfg.policy or DEFAULT_POLICY), dev.type)
    # with prompt banks, plans of micro-batches too (the banks are what they share)
    found = search(shape, profile, budget, work, experts=experts,
                   kv=(False,) if on_cpu else (False, True), non_expert_bytes=ne,
                   max_seq=max_seq, slots=slots, bank=bank, micros=range(1, MICRO_MAX + 1))
    if not found:
        raise ValueError(f"no batch plan fits {format_size(budget)} for {mf.path.name}: "
                         f"raise {setting('gpu_budget')} or lower {setting('ctx_per_seq')}")
    best = found[0]
    return Chosen(best.plan, best, plan_cache(cfg, best.plan), cpu_only=on_cpu)

"""Batch-job plans and what they are worth: the cost model's rooflines stage by stage, over the
whole job (MoE-Lightning's hierarchical roofline model, HRM, for llama.cpp's execution).

A plan is what a batch job can choose: how many sequences decode together, the ubatch size,
whether the KV cache sits in device memory or in host memory (llama.cpp's ``offload_kqv``; then
attention runs on the CPU), and where the experts live: forecache's slot cache, or stock
llama.cpp's ``--n-cpu-moe`` layers. The budget pays the non-expert weights, the KV cache when on
the device and the compute buffers first; what is left holds expert slots (or whole expert
layers).

Each op is a roofline on the resource that runs it (``cost.roofline_s``): device matmuls on GPU
memory or GPU compute, CPU expert and attention compute on DRAM or CPU compute, expert copies on
the bus. A layer's routed experts are planned as the runtime plans them (``CostModel.best_split``:
misses copied through the slots or computed on the CPU beside the device). llama.cpp runs a
ubatch's ops one after the other, so a stage's time is the sum of its ops; its bound is the
resource whose ops take the most of it. A job is its prompts' ubatches plus its decode steps:
every decode step computes one token of each of ``n_seq`` sequences at their mean context;
where the requests' answer lengths are known, the job's tail is counted step by step, each step
priced at the sequences still running.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, TypeVar

import numpy as np

from forecache.cache.budget import (
    BANK_REGIONS,
    BANK_SHARE_MAX,
    MICRO_MAX,
    format_size,
    prefill_seqs,
)
from forecache.cache.choice import distinct_experts, hit_at
from forecache.cache.cost import DEVICE_MIN_TOKENS, CostModel, Profile, roofline_s
from forecache.cache.prefetcher import stage_slots
from forecache.native.libs import STOCK_MAX_SEQUENCES

if TYPE_CHECKING:
    from forecache.roofline.shape import ModelShape

_V = TypeVar("_V", float, "Stage")

EXPERTS = ("cache", "ncmoe")
# the resources a stage can be bound by
RESOURCES = ("GPU compute", "GPU memory", "PCIe", "CPU compute", "DRAM")
# on a machine without a GPU the "device" is the CPU itself and its memory the host's (a CPU
# build's profile gives the device the host's rates): each resource as it really is there
CPU_ONLY_RESOURCES = {"GPU compute": "CPU compute", "GPU memory": "memory bandwidth",
                      "PCIe": "expert copies", "CPU compute": "CPU compute",
                      "DRAM": "memory bandwidth"}
# the grid ``search`` tries unless told otherwise
N_SEQS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
# sequences one stock llama.cpp context decodes together (LLAMA_MAX_SEQ, llama-cparams.h, as
# forecache's patch series finds it before raising it to forecache.native.libs.MAX_SEQUENCES)
STOCK_MAX_SEQ = STOCK_MAX_SEQUENCES
N_UBATCHES = (64, 128, 256, 512, 1024, 2048)


def batch_tokens(n_seq: int, n_ubatch: int) -> int:
    """The llama batch (``n_batch``) a job of ``n_seq`` sequences in ubatches of ``n_ubatch``
    loads with: a token of each decoding sequence and a ubatch of prompt rows beside them. (A
    batch of ``max(n_ubatch, n_seq)`` is full with decoding rows once ``n_ubatch`` is at most the
    sequences, and a new prompt then gets only the rows its idle neighbours leave, about one a
    step.) One sequence: a ubatch."""
    return n_ubatch + (n_seq if n_seq > 1 else 0)


def fill_rows(n_batch: int, n_ubatch: int) -> int:
    """The rows a job's llama batch is filled to with prompt chunks while its decoding rows
    leave room: whole ubatches (each ubatch is a pass over every layer, so a partial last one
    would cost a pass for a few rows), or the batch where it is smaller than a ubatch."""
    return n_batch - n_batch % n_ubatch if n_batch >= n_ubatch else n_batch


def prompt_take(left: int, room: int, n_ubatch: int) -> int:
    """The rows of a prompt with ``left`` rows to go that a step feeds where its batch has
    ``room`` rows free, with a KV stream per sequence (llama.cpp gives each prompt's rows
    ubatches of their own, each a pass over every layer): all of them, else whole ubatches of
    them, else (room for less than one) what fits."""
    take = min(left, room)
    if take < left and take >= n_ubatch:
        take -= take % n_ubatch
    return max(take, 0)


def admit_lane(free: Sequence[int], micro: int) -> int:
    """The context a new request is admitted into, ``free`` giving each context's free ids
    (the decoding one's first): with micro-batches the prefill context with the most (the
    first on a tie), else the one context."""
    if micro == 1:
        return 0
    return max(range(1, len(free)), key=lambda k: (free[k], -k))


SPLITS = ("simple", "equal")


def split_batch(seqs: Sequence[int], n_ubatch: int, split: str = "simple") -> list[np.ndarray]:
    """The ubatches llama.cpp makes of a batch whose rows belong to sequences ``seqs``: row
    indices, each ubatch's in the order it computes them. ``simple`` (a unified KV cache,
    llama_batch_allocr::split_simple): ``n_ubatch`` consecutive rows at a time. ``equal`` (a
    KV stream per sequence, as forecache batch loads the model; split_equal with sequential
    ids): from the first unused row, the sequences whose ids follow each other (in batch
    order), then as many rows of each as all of them have, within ``n_ubatch``, grouped by
    sequence; rows of sequences whose ids do not follow go to later ubatches."""
    n = len(seqs)
    if split == "simple":
        return [np.arange(a, min(a + n_ubatch, n)) for a in range(0, n, n_ubatch)]
    if split != "equal":
        raise ValueError(f"unknown split {split!r}; use one of {', '.join(SPLITS)}")
    rows_of: dict[int, list[int]] = {}
    for i, q in enumerate(seqs):
        rows_of.setdefault(q, []).append(i)
    taken = dict.fromkeys(rows_of, 0)  # a sequence's rows are taken in order
    used = [False] * n
    out = []
    start = 0
    while start < n:
        chain: list[int] = []
        for i in range(start, n):
            q = seqs[i]
            # a sequence already in the chain has q <= chain[-1]: only the next id joins
            if used[i] or (chain and q != chain[-1] + 1):
                continue
            chain.append(q)
            if len(chain) == n_ubatch:
                break
        per = min(len(rows_of[q]) - taken[q] for q in chain)
        per = max(1, min(per, n_ubatch // len(chain)))
        u = []
        for q in chain:
            got = rows_of[q][taken[q]:taken[q] + per]
            taken[q] += per
            u.extend(got)
            for i in got:
                used[i] = True
        out.append(np.array(u))
        while start < n and used[start]:
            start += 1
    return out


def prompt_room(n_seq: int, n_ubatch: int) -> int:
    """The most rows of one prompt a step of a job of ``n_seq`` sequences feeds beside the
    others' decoding rows (``batch_tokens``, ``prompt_take``); one sequence: a ubatch."""
    if n_seq <= 1:
        return n_ubatch
    room = batch_tokens(n_seq, n_ubatch) - (n_seq - 1)
    return max(room - room % n_ubatch if room >= n_ubatch else room, 1)


@dataclass(frozen=True)
class BatchPlan:
    """One way to run a batch job."""

    n_seq: int  # sequences decoded together
    n_ubatch: int  # tokens a ubatch (llama.cpp's n_ubatch; the batch is at least this)
    kv_host: bool = False  # KV cache in host memory, attention on the CPU (offload_kqv off)
    experts: str = "cache"  # "cache": forecache's slots; "ncmoe": stock --n-cpu-moe layers
    # micro-batches (MoE-Lightning's CGOPipe): 2 feeds the prompts in a context of their own,
    # each step's prompt ubatch going through each layer with the decoding one, one prompt-bank
    # fill serving both (batch.decode_many's micro)
    micro: int = 1

    def __post_init__(self) -> None:
        if self.n_seq < 1 or self.n_ubatch < 1:
            raise ValueError(f"a plan needs at least one sequence and one token a ubatch, not "
                             f"seq={self.n_seq}, ubatch={self.n_ubatch}")
        if self.experts not in EXPERTS:
            raise ValueError(f"experts={self.experts}: use one of {', '.join(EXPERTS)}")
        if not 1 <= self.micro <= MICRO_MAX:
            raise ValueError(f"micro={self.micro}: 1, or up to {MICRO_MAX} (the prompts in "
                             "contexts of their own)")
        if self.micro > 1 and self.experts != "cache":
            raise ValueError("micro-batches share forecache's prompt banks: a plan with micro "
                             "needs experts=cache")

    def label(self, cpu_only: bool = False) -> str:
        """The plan as ``--plan`` takes it; ``cpu_only`` (a machine without a GPU) leaves out
        the KV cache's place where it is llama.cpp's default (no device memory to name), as
        ``--plan`` reads it."""
        kv = "" if cpu_only and not self.kv_host else \
            f",kv={'host' if self.kv_host else 'device'}"
        return (f"seq={self.n_seq},ubatch={self.n_ubatch}{kv}"
                + ("" if self.experts == "cache" else f",experts={self.experts}")
                + ("" if self.micro == 1 else f",micro={self.micro}"))

    @classmethod
    def parse(cls, text: str) -> BatchPlan:
        """``seq=N,ubatch=U[,kv=device|host][,experts=cache|ncmoe][,micro=M]`` (seq and ubatch
        required)."""
        got: dict[str, str] = {}
        for part in text.split(","):
            key, eq, value = part.strip().partition("=")
            if not eq or key not in ("seq", "ubatch", "kv", "experts", "micro") or key in got:
                raise ValueError(f"cannot read plan {text!r}: give seq=N,ubatch=U and optionally "
                                 "kv=device|host, experts=cache|ncmoe and micro=M, e.g. "
                                 "seq=16,ubatch=512,kv=device")
            got[key] = value.strip()
        if "seq" not in got or "ubatch" not in got:
            raise ValueError(f"plan {text!r} needs seq=N and ubatch=U, e.g. seq=16,ubatch=512")
        if got.get("kv", "device") not in ("device", "host"):
            raise ValueError(f"plan {text!r}: kv is device or host, not {got['kv']!r}")
        try:
            n_seq, n_ubatch = int(got["seq"]), int(got["ubatch"])
            micro = int(got.get("micro", "1"))
        except ValueError:
            raise ValueError(f"plan {text!r}: seq, ubatch and micro are whole numbers") from None
        return cls(n_seq, n_ubatch, got.get("kv") == "host", got.get("experts", "cache"), micro)


@dataclass(frozen=True)
class Workload:
    """A batch job as the model sees it: mean prompt and answer lengths in tokens."""

    n_requests: int
    prompt_len: float
    gen_len: float
    ctx_per_seq: int  # each sequence's context (the longest prompt + answer the job needs)
    # each request's answer length where known (a job's answer limits): the job's tail, as its
    # sequences finish and fewer run a step, is then counted step by step (``running_steps``)
    answers: tuple[int, ...] = ()
    # each request's prompt length where known: its prompt is then priced as the ubatches
    # llama.cpp cuts it into (``prompt_chunks``), not as the mean prompt's
    prompts: tuple[int, ...] = ()


def prompt_chunks(prompts: Sequence[int], n_ubatch: int) -> dict[tuple[int, int], int]:
    """The prompt ubatches a job's ``prompts`` make, counted by (tokens, tokens before them):
    with a KV stream per sequence llama.cpp cuts each prompt into ubatches of its own,
    ``n_ubatch`` tokens each but the last (``n_ubatch``: the chunk a step takes of a prompt)."""
    out: dict[tuple[int, int], int] = {}
    for n in prompts:
        for start in range(0, max(int(n), 1), n_ubatch):
            key = (min(n_ubatch, max(int(n), 1) - start), start)
            out[key] = out.get(key, 0) + 1
    return out


def running_steps(answers: Sequence[int], n_seq: int,
                  admit: float | None = None) -> dict[int, int]:
    """Decode steps a job takes with ``k`` sequences running, for each ``k``: requests admitted
    longest first into ``n_seq`` sequences, a freed sequence taking the next at once, each
    running a step for each token of its answer (as ``batch.decode_many`` runs a job).
    ``admit``: the most sequences a step can start decoding (prompts fed in contexts of their
    own, a few a step: micro-batches); a step with none running waits for the next."""
    order = sorted((max(int(a), 1) for a in answers), reverse=True)
    running: list[int] = []  # the steps at which the running sequences finish
    out: dict[int, int] = {}
    t = nxt = 0
    credit, last = 0.0, -1  # admissions the steps so far have room for, as of step last
    while nxt < len(order) or running:
        if admit is None:
            while nxt < len(order) and len(running) < n_seq:
                heapq.heappush(running, t + order[nxt])
                nxt += 1
            end = running[0]
        else:  # a step at a time, each admitting what its prompts' passes finish
            credit = min(credit + admit * (t - last), max(admit, 1.0))
            last = t
            while nxt < len(order) and len(running) < n_seq and credit >= 1.0:
                heapq.heappush(running, t + order[nxt])
                nxt += 1
                credit -= 1.0
            # (a full batch admits nothing until a sequence finishes)
            waiting = nxt < len(order) and len(running) < n_seq
            end = t + 1 if waiting or not running else running[0]
        out[len(running)] = out.get(len(running), 0) + end - t
        t = end
        while running and running[0] <= t:
            heapq.heappop(running)
    out.pop(0, None)  # steps with nothing decoding: the prompts' passes, priced apart
    return out


@dataclass(frozen=True)
class Stage:
    """A stage's seconds, split by the resource each op ran on."""

    seconds: float
    parts: dict[str, float] = field(default_factory=dict)
    # the bus's busy time, where copies overlap the ops (prompt banks' fills): more than its
    # part of the ops one after another, which counts only the waits for them
    bus_s: float = 0.0

    @property
    def bound(self) -> str:
        """The resource whose ops take most of the stage."""
        return max(self.parts, key=lambda k: self.parts[k]) if self.parts else "GPU memory"

    def bound_as(self, names: Mapping[str, str]) -> str:
        """The bound where resources are ``names`` (several may be one: on a machine without a
        GPU the device's memory is the host's), their ops' seconds added."""
        merged: dict[str, float] = {}
        for k, v in self.parts.items():
            name = names.get(k, k)
            merged[name] = merged.get(name, 0.0) + v
        return Stage(self.seconds, merged).bound if merged else names.get(self.bound, self.bound)

    @property
    def overlapped_s(self) -> float:
        """The stage if the device, the bus and the CPU each ran their ops alongside the
        others (MoE-Lightning's CGOPipe across micro-batches), instead of llama.cpp's one op
        after another: the busiest of the three (the bus busy for every copy, also those that
        already ran beside the ops), never more than the ops one after another."""
        p = self.parts
        return min(self.seconds, max(p.get("GPU compute", 0.0) + p.get("GPU memory", 0.0),
                                     max(p.get("PCIe", 0.0), self.bus_s),
                                     p.get("CPU compute", 0.0) + p.get("DRAM", 0.0)))

    def __add__(self, other: Stage) -> Stage:
        """Both stages, one after the other (a round's passes, a step's ubatches)."""
        parts = dict(self.parts)
        for k, v in other.parts.items():
            parts[k] = parts.get(k, 0.0) + v
        return Stage(self.seconds + other.seconds, parts, self.bus_s + other.bus_s)

    def times(self, n: float) -> Stage:
        """``n`` of this stage (``n`` may be a fraction: a mean over stages)."""
        return Stage(self.seconds * n, {k: v * n for k, v in self.parts.items()},
                     self.bus_s * n)


class _Clock:
    """Adds ops' seconds and charges each to its resource."""

    def __init__(self) -> None:
        self.parts = dict.fromkeys(RESOURCES, 0.0)
        self.seconds = 0.0
        self.bus = 0.0  # copies beside the ops (prompt banks' fills)

    def op(self, seconds: float, resource: str) -> None:
        self.seconds += seconds
        self.parts[resource] += seconds

    def roof(self, launch_s: float, nbytes: float, gbps: float, flops: float, rate: float,
             where: str, times: float = 1.0) -> None:
        """A roofline op on the GPU or the CPU, charged to memory or compute, ``times`` over."""
        t = roofline_s(launch_s, nbytes, gbps, flops, rate) * times
        mem = nbytes / (gbps * 1e9) >= flops / rate
        self.op(t, ("GPU memory" if mem else "GPU compute") if where == "gpu" else
                ("DRAM" if mem else "CPU compute"))

    def stage(self) -> Stage:
        return Stage(self.seconds, {k: v for k, v in self.parts.items() if v > 0},
                     self.bus + self.parts["PCIe"])


@dataclass(frozen=True)
class Estimate:
    """What the model predicts of a plan."""

    plan: BatchPlan
    slots: int  # expert slots a MoE layer ("cache")
    host_layers: int  # MoE layers whose experts stay in host memory ("ncmoe")
    device_bytes: dict[str, int]  # weights, KV cache, compute buffers, experts
    prefill: Stage  # one full ubatch of prompt tokens
    decode: Stage  # one decode step: a token of each of n_seq sequences
    prefill_s: float  # the job's prompts
    job_s: float
    tokens_per_s: float  # generated tokens a second over the job
    # micro-batches: the job with each step's passes side by side (else worked out from the
    # stages: ``overlapped_tokens_per_s``)
    overlapped_s: float | None = None

    @property
    def overlapped_tokens_per_s(self) -> float:
        """The job's throughput with every stage overlapped (``Stage.overlapped_s``): what a
        pipeline across micro-batches could reach at this plan."""
        gen = self.tokens_per_s * self.job_s
        if self.overlapped_s is not None:
            return gen / self.overlapped_s if self.overlapped_s > 0 else 0.0
        pre = self.prefill_s * self.prefill.overlapped_s / max(self.prefill.seconds, 1e-12)
        dec = (self.job_s - self.prefill_s) * self.decode.overlapped_s / \
            max(self.decode.seconds, 1e-12)
        return gen / (pre + dec) if pre + dec > 0 else 0.0

    @property
    def bound(self) -> str:
        """The bound of the stage that takes most of the job."""
        return self.decode.bound if self.prefill_s <= self.job_s / 2 else self.prefill.bound

    def experts_text(self) -> str:
        if self.plan.experts == "ncmoe":
            return f"--n-cpu-moe {self.host_layers}"
        return f"{self.slots} slots a layer"

    def line(self, placement: str | None = None, cpu_only: bool = False) -> str:
        """One line: the plan, its predicted throughput and what bounds it (``placement``
        names the experts' placement instead of the slots or layers). ``cpu_only``: on a
        machine without a GPU, where the device is the CPU, it names no GPU and no device
        memory (``CPU_ONLY_RESOURCES``)."""
        p = self.plan
        names = CPU_ONLY_RESOURCES if cpu_only else {}
        where = "in host memory" if cpu_only else f"on the {'host' if p.kv_host else 'device'}"
        return (f"plan {p.label(cpu_only)} ({placement or self.experts_text()}, KV "
                f"{format_size(self.device_bytes['kv'])} {where}): {self.tokens_per_s:.1f} "
                f"tokens/s predicted; decode {self.decode.seconds * 1e3:.1f} ms a step, bound "
                f"by {self.decode.bound_as(names)}; prefill bound by "
                f"{self.prefill.bound_as(names)}")


def _memory(shape: ModelShape, budget: int, work: Workload, plan: BatchPlan,
            non_expert_bytes: int | None, host_bytes: int | None, slots_given: int | None = None,
            bank: bool = False) -> tuple[dict[str, int], int, int, int] | None:
    """The device bytes of a plan, its slots a layer, ncmoe host layers and the experts a
    prompt bank's region holds (0: no banks); None when the fixed needs do not fit, or the
    host's (``host_bytes``: experts kept in host memory and a host KV cache) do not. ``bank``:
    banks where the runtime places them (``placement.before.held_back``: some expert misses a
    slot and they take at most ``BANK_SHARE_MAX`` of the experts' budget)."""
    mem = shape.memory(budget, n_ctx=work.ctx_per_seq, n_ubatch=plan.n_ubatch, n_seq=plan.n_seq,
                       kv_on_device=not plan.kv_host, non_expert_bytes=non_expert_bytes)
    kv = shape.kv_cache_bytes(work.ctx_per_seq, plan.n_seq)
    if plan.micro > 1:
        # the prompts' contexts: compute buffers and a KV cache each (``micro.Sibling``)
        q = prefill_seqs(plan.n_seq, plan.micro)
        more_kv = (plan.micro - 1) * shape.kv_cache_bytes(work.ctx_per_seq, q)
        kv += more_kv
        mem = replace(mem, kv_bytes=mem.kv_bytes + (0 if plan.kv_host else more_kv),
                      compute_bytes=mem.compute_bytes + (plan.micro - 1) *
                      shape.compute_bytes(plan.n_ubatch, q))
    dense, compute = mem.non_expert_bytes, mem.compute_bytes
    per_layer = shape.expert_bytes
    if mem.expert_budget < per_layer * shape.layers:  # not even one slot a layer
        return None
    slots = min(mem.slots_per_layer())
    region = 0
    if slots_given is not None:  # a cache sized by a share of the experts, not by the budget
        slots = min(shape.experts, slots_given)
        if bank and plan.experts == "cache" and slots < shape.experts:  # beside the slots
            region = shape.experts - slots
    elif bank and plan.experts == "cache" and slots < shape.experts:
        held = mem.bank_held()
        if held * mem.largest_expert_bytes <= mem.expert_budget * BANK_SHARE_MAX:
            slots = min(mem.slots_per_layer(held=held))
            region = shape.experts - slots
    host_layers = mem.ncmoe_cpu_layers()
    experts = (slots * shape.layers + BANK_REGIONS * region if plan.experts == "cache"
               else (shape.layers - host_layers) * shape.experts) * per_layer
    if host_bytes is not None:
        # the cache copies from every expert in host memory; ncmoe keeps its host layers there
        held = shape.layers if plan.experts == "cache" else host_layers
        if held * shape.experts * per_layer + (kv if plan.kv_host else 0) > host_bytes:
            return None
    return ({"weights": dense, "kv": kv, "compute": compute, "experts": experts}, slots,
            host_layers, region)


@dataclass(frozen=True)
class Layout:
    """Where a plan's budget goes, and what the experts get of it."""

    device_bytes: dict[str, int]  # weights, KV cache, compute buffers, experts
    slots: int  # expert slots a MoE layer
    host_layers: int  # ncmoe: MoE layers whose experts stay in host memory
    stage: int  # cache: stage slots, out of the slots
    share: float  # of a layer's experts resident (cache) on average
    bank: int = 0  # cache: experts a prompt bank's region holds (0: no banks)


def layout(shape: ModelShape, budget: int, work: Workload, plan: BatchPlan,
           non_expert_bytes: int | None = None, host_bytes: int | None = None,
           slots: int | None = None, bank: bool = False) -> Layout | None:
    """The device memory of ``plan`` at ``budget``; None when its fixed needs do not fit
    (or its host memory exceeds ``host_bytes``). ``slots``: a layer's slots as given (a cache
    sized by a share of the experts) instead of what the budget leaves. ``bank``: prompt banks
    where the runtime places them (on a GPU, by default), in place of stage slots."""
    mem = _memory(shape, budget, work, plan, non_expert_bytes, host_bytes, slots, bank)
    if mem is None:
        return None
    device, slots, host_layers, region = mem
    # the stage slots' memory comes out of the slots, as the runtime takes it
    stage = 0 if region else stage_slots(shape.experts, [slots] * shape.layers,
                                         streams=plan.experts == "cache")
    share = (slots * shape.layers - stage) / (shape.layers * shape.experts)
    return Layout(device, slots, host_layers, stage, share, region)


def _layer_experts(clock: _Clock, shape: ModelShape, p: Profile, cost: CostModel, n_tokens: float,
                   resident: float, host_layer: bool | None, slots: int = 0,
                   ahead_s: float = 0.0, splits: dict | None = None) -> None:
    """One layer's routed experts for ``n_tokens`` rows: forecache's plan over ``resident`` of
    the distinct experts in slots (``host_layer`` None), or stock llama.cpp's layer, its
    experts in host memory (``host_layer`` True) or on the device. A layer that routes more
    experts than its ``slots`` streams them, and the layer before it has copied up to
    ``ahead_s`` seconds of its misses into stage slots meanwhile (``Prefetcher._stage_next``).
    ``splits``: the host/device splits chosen so far for layers alike (the same rows, the same
    hits), reused."""
    k, e = shape.top_k, shape.experts
    d = max(1, round(distinct_experts(n_tokens, e, k)))
    pairs = max(d, round(n_tokens * k))
    nproj = len(shape.expert.proj_bytes)
    if host_layer is not None:
        if not host_layer:
            clock.roof(p.gpu_launch_s, d * shape.expert_bytes / nproj, p.gpu_mem_gbps,
                       pairs * shape.proj_flops, p.gpu_tflops * 1e12, "gpu", nproj)
        elif 0 < p.op_offload_min_batch <= n_tokens:
            # llama.cpp copies the used experts up, then computes them on the device
            clock.op(d * cost.copy_s(), "PCIe")
            clock.roof(p.gpu_launch_s, d * shape.expert_bytes / nproj, p.gpu_mem_gbps,
                       pairs * shape.proj_flops, p.gpu_tflops * 1e12, "gpu", nproj)
        else:
            clock.roof(p.cpu_launch_s, d * shape.expert_bytes / nproj, p.cpu_mem_gbps,
                       pairs * shape.proj_flops, p.cpu_gflops * 1e9, "cpu", nproj)
        return
    hits = min(d, round(d * resident))
    per = pairs / d
    splits = {} if splits is None else splits
    key = (d, hits, max(1, round(per)), n_tokens)
    if key not in splits:
        rows = [(i, max(1, round(per)), i < hits) for i in range(d)]
        splits[key] = cost.best_split(rows, 0, n_tokens)
    split, t = splits[key]
    n_host = d if split.whole_layer else len(split.host)
    host_pairs = pairs if split.whole_layer else n_host * per
    dev = cost.dev_s(d - n_host, pairs - host_pairs) if not split.whole_layer else 0.0
    copies = 0.0 if split.whole_layer else cost.copy_s() * (d - hits - n_host)
    if copies > 0 and d > slots:
        # the staged copies ran under the attention before this layer's experts
        fixed = t - max(dev, copies, split.host_s)  # the host rows' merge
        copies -= min(ahead_s, copies)
        t = max(dev, copies, split.host_s) + fixed
    # the layer takes ``t`` (its sides overlap): charged to the longest side's resource
    side = max(dev, copies, split.host_s)
    if side == split.host_s and n_host:
        where = "DRAM" if _host_memory_bound(shape, p, host_pairs / max(n_host, 1)) \
            else "CPU compute"
    elif side == copies and copies > 0:
        where = "PCIe"
    else:
        mem = (d - n_host) * shape.expert_bytes / (p.gpu_mem_gbps * 1e9) >= \
            (pairs - host_pairs) * shape.proj_flops * nproj / (p.gpu_tflops * 1e12)
        where = "GPU memory" if mem else "GPU compute"
    clock.op(t, where)
    # the runtime's own costs: the gate (a one-token gate decided in C), and expert groups
    # when experts stream in (the hits in one, then each streamed expert as its copy lands)
    clock.op(p.decode_gate_s if n_tokens == 1 and p.decode_gate_s > 0 else
             (p.prefetch_hook_s or p.hook_s) + n_tokens * p.hook_row_s, "CPU compute")
    # expected, not rounded: a layer of one token misses a fraction of an expert on average.
    # Streamed experts are computed in groups as their copies land: one group each where a
    # copy takes longer than an expert's compute, else together once the copies are in
    streamed = 0.0 if split.whole_layer else max(0.0, d * (1 - resident) - n_host)
    if streamed > 0:
        one = cost.dev_s(1, max(1, round(per)))
        groups = streamed if cost.copy_s() > one else min(1.0, streamed)
        clock.op(nproj * p.group_s * (min(1.0, d * resident) + groups), "CPU compute")


def _host_memory_bound(shape: ModelShape, p: Profile, pairs: float) -> bool:
    """CPU compute of an expert's ``pairs`` rows is bound by reading it from DRAM."""
    return shape.expert_bytes / (p.cpu_mem_gbps * 1e9) >= \
        pairs * shape.proj_flops * len(shape.expert.proj_bytes) / (p.cpu_gflops * 1e9)


def ubatch_stage(shape: ModelShape, p: Profile, cost: CostModel, plan: BatchPlan, n_tokens: float,
            context: float, resident: float, host_layers: int, logits: float, slots: int = 0,
            stage: int = 0, n_seqs: float = 1.0, bank: int = 0, shared: bool = False) -> Stage:
    """One ubatch of ``n_tokens`` rows whose attention reads ``context`` tokens each, ``logits``
    of them sampled, from ``n_seqs`` sequences: ``resident`` of a layer's routed experts in
    slots (a cache plan, whose
    ``stage`` slots take the next layer's misses while a streaming layer computes), or the
    first ``host_layers`` layers' experts in host memory (ncmoe). A cache plan with prompt
    banks of ``bank`` experts a region computes a ubatch of ``DEVICE_MIN_TOKENS`` rows or more
    from them (``choice.promoe_prompt_s``): each layer's bank is filled with every expert its
    slots lack on a stream of its own, issued as the layer before computes its experts, and a
    layer's experts start once their fill is done; nothing reads the routing. ``shared``: a
    later pass of a round of micro-batches, reading the banks its first pass filled (no waits,
    no copies)."""
    clock = _Clock()
    splits: dict = {}  # every layer routes alike: one split for all of them
    banked = bank > 0 and plan.experts == "cache" and n_tokens >= DEVICE_MIN_TOKENS
    fill = cost.fill_s(bank)
    filled = fill  # the first layer's fill begins with the pass
    attn_bytes = n_tokens * context * shape.kv_bytes
    attn_flops = 4.0 * n_tokens * context * shape.d_model
    if shape.lead_bytes:  # leading dense layers (deepseek2)
        clock.roof(p.gpu_launch_s, shape.lead_bytes, p.gpu_mem_gbps,
                   2.0 * n_tokens * shape.lead_bytes / shape.bytes_per_weight,
                   p.gpu_tflops * 1e12, "gpu")
    for il in range(shape.layers):
        before = clock.seconds
        clock.roof(p.gpu_launch_s, shape.layer_bytes, p.gpu_mem_gbps,
                   n_tokens * shape.layer_flops, p.gpu_tflops * 1e12, "gpu")
        if plan.kv_host:
            # q, k, v down and the attention's output back up, beside the CPU's attention
            act = 4.0 * n_tokens * shape.d_model * 4
            clock.op(2 * p.chunk_latency_s + act / (p.h2d_gbps * 1e9), "PCIe")
            clock.roof(p.cpu_launch_s, attn_bytes, p.cpu_mem_gbps, attn_flops,
                       p.cpu_gflops * 1e9, "cpu")
        else:
            clock.roof(p.gpu_launch_s, attn_bytes, p.gpu_mem_gbps, attn_flops,
                       p.gpu_tflops * 1e12, "gpu")
        if banked and shared:
            _layer_experts(clock, shape, p, cost, n_tokens, 1.0, False)
            continue
        if banked:
            wait = max(filled - clock.seconds, 0.0)
            clock.op(wait, "PCIe")  # waiting for its fill
            clock.bus += fill - wait  # the rest of its fill ran beside the ops
            filled = max(clock.seconds, filled) + fill  # the next layer's, behind it
            # then every routed expert on the device, as a layer whose experts all live there
            _layer_experts(clock, shape, p, cost, n_tokens, 1.0, False)
            continue
        host = None if plan.experts == "cache" else il < host_layers
        # half the stage slots take the next layer's misses (the other half serve this one)
        ahead = min((stage + 1) // 2 * cost.copy_s(), clock.seconds - before) if il else 0.0
        _layer_experts(clock, shape, p, cost, n_tokens, resident, host, slots, ahead, splits)
    clock.roof(p.gpu_launch_s, shape.head_bytes, p.gpu_mem_gbps,
               2.0 * logits * shape.head_bytes / shape.bytes_per_weight, p.gpu_tflops * 1e12,
               "gpu")
    # each further sequence's KV stream, where its attention runs
    clock.op(max(n_seqs - 1.0, 0.0) * p.seq_s, "CPU compute" if plan.kv_host else "GPU compute")
    # outside the graph: the pass's Python, and sampling each row with logits
    clock.op(p.token_s + max(logits - 1.0, 0.0) * p.sample_s, "CPU compute")
    return clock.stage()


def estimate(shape: ModelShape, profile: Profile, budget: int, work: Workload, plan: BatchPlan, *,
             locality: float = 0.0, non_expert_bytes: int | None = None,
             cost: CostModel | None = None, host_bytes: int | None = None,
             slots: int | None = None, bank: bool = False) -> Estimate | None:
    """The predicted throughput of ``plan`` for ``work`` at ``budget`` bytes of device memory;
    None when the plan does not fit (the device, or ``host_bytes`` of host memory).
    ``locality`` is the model's measured decode locality (``cache.choice``), which raises a
    single sequence's hit rate above the slots' share; ``cost`` carries measured copy and CPU
    rates; ``slots`` fixes a layer's slots (``layout``); ``bank``: prompt banks where the
    runtime places them (``layout``; on a GPU by default)."""
    lay = layout(shape, budget, work, plan, non_expert_bytes, host_bytes, slots, bank)
    if lay is None:
        return None
    slots, host_layers, stage, share = lay.slots, lay.host_layers, lay.stage, lay.share
    cost = cost or CostModel.from_profile(profile, shape.expert)
    # a prompt's tokens route all over: its ubatches hit at the slots' share; decode steps of
    # one sequence keep the locality the cache was measured at
    n_seq = min(plan.n_seq, max(work.n_requests, 1))
    decode_hit = hit_at(share, locality if n_seq == 1 else 0.0)
    # llama.cpp keeps a KV stream per sequence and splits a batch into ubatches with as many
    # tokens of each sequence: prompts are not packed together, a ubatch holds (a chunk of) one,
    # at most what a step leaves beside the decoding rows
    chunk = min(plan.n_ubatch, prompt_room(n_seq, plan.n_ubatch))
    u = max(min(float(chunk), work.prompt_len), 1.0)
    region = lay.bank
    prefill = ubatch_stage(shape, profile, cost, plan, u, work.prompt_len / 2, share,
                           host_layers, u / max(work.prompt_len, 1), slots, stage, 1.0, region)

    def decode_at(k: int) -> Stage:
        """A decode step of ``k`` running sequences, a row each, at their mean context: as many
        ubatches as llama.cpp splits it into, each a pass over every layer."""
        n_pass = max(1, math.ceil(k / plan.n_ubatch))
        rows = k / n_pass
        return ubatch_stage(shape, profile, cost, plan, rows, work.prompt_len + work.gen_len / 2,
                            decode_hit, host_layers, rows, slots, stage, rows,
                            region).times(n_pass)

    decode = decode_at(n_seq)
    if plan.micro > 1:
        def prompt_of(shared: bool) -> Callable[[float, float], Stage]:
            return lambda t, ctx: ubatch_stage(shape, profile, cost, plan, t, ctx, share,
                                               host_layers, 1.0, slots, stage, 1.0, region,
                                               shared)
        prefill_s, job, ovl, generated = _micro_job(shape, profile, plan, work, decode_at,
                                                    prompt_of(False), prompt_of(True))
        return Estimate(plan, slots, 0, lay.device_bytes, prefill, decode, prefill_s, job,
                        generated / job if job > 0 else 0.0, ovl)
    prompt_tokens = work.prompt_len * work.n_requests
    generated = work.gen_len * work.n_requests
    if work.prompts:
        prefill_s = _prompts_stage(work.prompts, chunk, lambda t, ctx: ubatch_stage(
            shape, profile, cost, plan, t, ctx, share, host_layers, 1.0, slots, stage,
            1.0, region))[0].seconds
    else:
        prefill_s = work.n_requests * math.ceil(work.prompt_len / u) * prefill.seconds \
            if prompt_tokens else 0.0
    if work.answers:
        # step by step: a step of k running sequences costs a k-row ubatch (worked out at the
        # powers of two up to n_seq, in between by the line through the two around k)
        at = {k: decode_at(k).seconds
              for k in [1 << i for i in range(n_seq.bit_length())] if k < n_seq}
        at[n_seq] = decode.seconds
        decode_s = sum(n * _between(at, k) for k, n in running_steps(work.answers, n_seq).items())
        generated = float(sum(work.answers))
    else:
        # every step decodes a token of each running sequence; fewer run at the job's tail
        steps = generated / n_seq + (work.gen_len if work.n_requests > n_seq else 0) / 2
        decode_s = steps * decode.seconds
    job = prefill_s + decode_s
    return Estimate(plan, slots if plan.experts == "cache" else 0,
                    host_layers if plan.experts == "ncmoe" else 0, lay.device_bytes, prefill,
                    decode, prefill_s, job, generated / job if job > 0 else 0.0)


def _micro_job(shape: ModelShape, profile: Profile, plan: BatchPlan, work: Workload,
               decode_at: Callable[[int], Stage], alone: Callable[[float, float], Stage],
               shared: Callable[[float, float], Stage]) -> tuple[float, float, float, float]:
    """A job of ``plan``'s micro-batches (``batch.decode_many``'s micro), as the replay runs it:
    its prompts' seconds, the job's, the job's with each step's passes side by side, and the
    tokens it generates. The prompts are fed in ``micro - 1`` contexts of ``prefill_seqs``
    sequences each, a ubatch of each prompt a step as the context's rows allow (with one
    context, the batch's; with more, a ubatch's), so a step starts decoding a few of them
    (``running_steps``' ``admit``) and the decoding context holds what they leave of the
    sequences. A step's k-th ubatches of every context go through each layer in one round: its
    first pass (the decoding one, where it has rows) fills each layer's bank, the others read
    it (``shared``: priced without the fills). A sequence moves to the decoding context once
    its prompt is in, its KV read out and written in."""
    m = plan.micro
    n_seq = min(plan.n_seq, max(work.n_requests, 1))
    q = prefill_seqs(n_seq, m)
    room = batch_tokens(n_seq, plan.n_ubatch) if m == 2 else plan.n_ubatch
    prompts = work.prompts or (max(round(work.prompt_len), 1),) * max(work.n_requests, 1)
    answers = work.answers or (max(round(work.gen_len), 1),) * max(work.n_requests, 1)
    mean = max(sum(prompts) / len(prompts), 1.0)
    # each prompt in a context is a ubatch of its own (a KV stream each), as its rows fit
    per_ctx = max(1.0, min(q, room / min(mean, plan.n_ubatch)))
    admit = (m - 1) * max(min(q, room / mean), 1.0 / math.ceil(mean / room))
    n_dec = max(1, n_seq - (m - 1) * q)
    steps = running_steps(answers, n_dec, admit)
    n_steps = max(sum(steps.values()), 1)
    # of a context's ubatches in a step, the first goes beside the decoding pass, which fills
    # the banks for them where it banks (its rows are enough: all but the first few prompts,
    # admitted while few sequences decode), else the first of them fills; the rest lead rounds
    # of their own, whose first pass fills (a job admits about a prompt a step as its
    # sequences finish: the other contexts seldom have a ubatch to share those rounds with)
    banked = 0.0 if n_dec < DEVICE_MIN_TOKENS else \
        max(0.0, 1.0 - DEVICE_MIN_TOKENS / max(len(answers), 1))
    priced: dict[tuple[float, float], Stage] = {}

    def once(t: float, ctx: float) -> Stage:
        if (t, ctx) not in priced:
            priced[t, ctx] = alone(t, ctx)
        return priced[t, ctx]

    first, n_ub = _prompts_stage(prompts, plan.n_ubatch, once)
    # (a ubatch too short for the banks reads none: priced as alone)
    rest, _ = _prompts_stage(prompts, plan.n_ubatch, lambda t, ctx: once(t, ctx)
                             if t < DEVICE_MIN_TOKENS else shared(t, ctx))
    first_round = max(1.0, min(m - 1.0, n_ub / (n_steps * per_ctx)))
    beside = (1.0 - (1.0 - banked) / first_round) / per_ctx
    prompt = first.times(1.0 - beside) + rest.times(beside)
    at = {k: decode_at(k) for k in [1 << i for i in range(n_dec.bit_length())] if k < n_dec}
    at[n_dec] = decode_at(n_dec)
    mean_prompt = prompt.times(1.0 / max(n_ub, 1))
    per_step = n_ub / n_steps  # prompt ubatches beside each step's decoding pass
    with_step = min(per_step, m - 1.0)
    decode_s = overlapped = 0.0
    for k, n in steps.items():
        d = _between(at, k)
        decode_s += n * d.seconds
        overlapped += n * (d + mean_prompt.times(with_step)).overlapped_s
    # prompt ubatches past the context count: rounds of their own
    overlapped += n_steps * (per_step - with_step) * mean_prompt.overlapped_s
    # the moves: each prompt's KV read out of its context and written into the decoding one;
    # and, as sequences finish, the decoding context's highest one copied down into the hole
    # (its KV stream read and written where the KV cache lives)
    rate = profile.cpu_mem_gbps if plan.kv_host else profile.h2d_gbps
    moves = 2.0 * sum(prompts) * shape.layers * shape.kv_bytes / (rate * 1e9)
    moves += len(answers) * 2.0 * work.ctx_per_seq * shape.layers * shape.kv_bytes / \
        ((profile.cpu_mem_gbps if plan.kv_host else profile.gpu_mem_gbps) * 1e9)
    job = decode_s + prompt.seconds + moves
    return prompt.seconds, job, min(overlapped + moves, job), float(sum(answers))


def _lerp(a: _V, b: _V, f: float) -> _V:
    """The point ``f`` of the way from ``a`` to ``b`` (seconds, or stages part by part)."""
    if isinstance(a, Stage) and isinstance(b, Stage):
        return a.times(1.0 - f) + b.times(f)  # type: ignore[return-value]
    return a + (b - a) * f  # type: ignore[operator,return-value]


def _between(table: Mapping[int, _V], x: float) -> _V:
    """``table``'s value at ``x``: on the line through its two keys around ``x``."""
    keys = sorted(table)
    hi = next(k for k in keys if k >= x)
    lo = max(k for k in keys if k <= x)
    return table[lo] if hi == lo else _lerp(table[lo], table[hi], (x - lo) / (hi - lo))


def _prompts_stage(prompts: Sequence[int], n_ubatch: int,
                   stage_of: Callable[[float, float], Stage]) -> tuple[Stage, int]:
    """A job's prompt ubatches (``prompt_chunks``), ``stage_of(tokens, context)`` pricing one,
    added up, and how many they are: worked out at the powers of two up to ``n_ubatch``
    tokens, in between by the line through the two around; the attention's share, which grows
    with the tokens before a ubatch, by the line through a ubatch at the start of its prompt
    and one a ubatch in."""
    chunks = prompt_chunks(prompts, n_ubatch)
    top = max(t for t, _ in chunks)
    points = {1 << i for i in range(top.bit_length())} | {top}
    first = {t: stage_of(t, t / 2) for t in points}
    later = {t: stage_of(t, n_ubatch + t / 2) for t in points}
    total = Stage(0.0)
    for (t, start), n in chunks.items():
        total = total + _lerp(_between(first, t), _between(later, t), start / n_ubatch).times(n)
    return total, sum(chunks.values())


def search(shape: ModelShape, profile: Profile, budget: int, work: Workload, *,
           experts: Sequence[str] = ("cache",), kv: Sequence[bool] = (False, True),
           n_seqs: Iterable[int] | None = None, n_ubatches: Iterable[int] | None = None,
           locality: float = 0.0, non_expert_bytes: int | None = None,
           cost: CostModel | None = None, host_bytes: int | None = None,
           max_seq: int = STOCK_MAX_SEQ, slots: int | None = None,
           bank: bool = False, micros: Iterable[int] = (1,)) -> list[Estimate]:
    """Every plan of the grid that fits, best predicted throughput first (ties: the larger
    ubatch first, then fewer micro-batches): forecache's up to ``max_seq`` sequences, stock
    llama.cpp's (ncmoe) up to its ``STOCK_MAX_SEQ``; ``bank``: forecache's with prompt banks
    (``estimate``), and then in each of ``micros`` micro-batches a step (those need the
    banks)."""
    out = []
    for x in experts:
        cap = min(max_seq, STOCK_MAX_SEQ) if x == "ncmoe" else max_seq
        seqs = sorted({min(s, cap, max(work.n_requests, 1)) for s in (n_seqs or N_SEQS)})
        for host in kv:
            for s in seqs:
                for u in n_ubatches or N_UBATCHES:
                    for m in micros if x == "cache" and bank else (1,):
                        e = estimate(shape, profile, budget, work, BatchPlan(s, u, host, x, m),
                                     locality=locality, non_expert_bytes=non_expert_bytes,
                                     cost=cost, host_bytes=host_bytes, slots=slots, bank=bank)
                        # (micro-batches share the banks: none where every expert fits)
                        if e is not None and (m == 1 or e.slots < shape.experts):
                            out.append(e)
    # plans predicted alike (a ubatch past the prompts changes nothing here) go larger ubatch
    # first: a llama batch of more tokens admits more prompts a step, which the model leaves out
    out.sort(key=lambda e: (-e.tokens_per_s, -e.plan.n_ubatch, e.plan.micro))
    return out

"""The default placement: promoe where the cost model expects it to be at least as fast as stock
llama.cpp's ``--n-cpu-moe`` for this model, budget and machine in both phases of a request, the
prompt and the decode, ncmoe where it does not.

One placement serves both phases: switching between them per phase would hold both in device
memory, or move the difference (gigabytes of experts) at every turn of a chat. So the choice
weighs the two phases and takes the cache only where neither is expected to lose.

Decode (one token a pass) is what a chat waits on. Per token, both placements read the
non-expert weights on the device; they differ in the routed experts:

- ncmoe keeps whole layers' experts in device memory and computes the other layers' experts on
  the CPU (llama.cpp does so for ubatches under 32 tokens), one layer after the other;
- promoe keeps ``n_slots`` of every layer's experts in device slots; a routed expert is a hit
  with probability ``hit`` (prefetched experts that arrive in time count as hits), and each miss
  is copied or computed on the CPU as ``CostModel.best_split`` decides, for the gate (decided in
  C, or the Python hook when the layer goes wholly to the CPU) and expert groups per projection
  on top when a layer misses.

``hit`` comes from the model's decode routing locality as a promoe run or a recorded trace
measured it (``cache.measured``), else from uniform routing (``PRIOR_LOCALITY``); measured
copy and CPU rates correct the machine profile.

A prompt ubatch (``n_ubatch`` rows, 32 or more: llama.cpp's op-offload rule) routes nearly every
expert of a layer, whatever the routing's locality:

- ncmoe copies each host layer's used experts up before each projection's product, on the
  compute stream (stock's op offload), and computes the other layers from device memory;
- promoe with prompt banks copies every expert a layer's slots lack into a bank while the layer
  before computes (one stream of fills beside the compute); without banks (no room for them) each
  layer's missing experts stream through the slots as its routing asks for them, computed as
  expert groups while they land.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from math import comb

from forecache.cache.cost import DEVICE_MIN_TOKENS, CostModel, Profile, roofline_s

# The locality assumed of a model nobody has measured: none (uniform routing). Real models range
# from about none (FLAME-MoE-290M, teacher-forced: 0.05-0.25; Mixtral-8x7B 0.17-0.39) to 0.9
# (OLMoE at a share of 0.85): benchmarks/default_guard.py, BENCHMARKS.md. Anything above the
# lowest could choose promoe where it loses.
PRIOR_LOCALITY = 0.0
# How much faster promoe's estimate must be to be chosen. Against the simulator the estimate was
# optimistic only on the Mixtral-8x7B trace, whose 99 MB experts make the cache's fills dear:
# 1.01x estimated from a trace's locality where the simulator gives 0.91x (1.11x optimistic, with
# the fills charged; 1.34x without). Elsewhere it was pessimistic (benchmarks/default_guard.py).
MARGIN = 1.2
# How much faster promoe's prompt estimate must be: at least as fast. The decode margin would
# refuse a large decode gain for a prompt estimated a little faster (a PCIe card's banks gain
# little on copy-bound prompts); a prompt estimated slower keeps stock's placement.
PROMPT_MARGIN = 1.0
# A prompt ubatch's rows where the run's n_ubatch is not known (llama.cpp's default)
PROMPT_ROWS = 512


def locality(hit: float, share: float) -> float:
    """The share of uniform routing's misses that were hits (0: uniform or worse, 1: no
    misses)."""
    return 0.0 if share >= 1 else max(0.0, min(1.0, (hit - share) / (1 - share)))


def hit_at(share: float, loc: float) -> float:
    """The hit rate of a cache holding ``share`` of a layer's experts, at locality ``loc``."""
    return share + (1 - share) * loc


@dataclass(frozen=True)
class Evidence:
    """What the estimate knows of this model's routing and this machine's rates."""

    locality: float
    source: str  # "prior", or what measured it: "run", "trace" or both ("run+trace"); "replay"
    lookups: int = 0  # decode expert lookups measured
    copy_gbps: float | None = None  # measured host-to-device rate of expert copies
    host_scale: float = 1.0  # measured / modelled CPU expert compute time
    share: float | None = None  # the slot share the locality was measured at


PRIOR = Evidence(PRIOR_LOCALITY, "prior")


@dataclass(frozen=True)
class DecodeShape:
    """Per-pass facts of one model at one budget: what both placements pay and what differs."""

    n_moe: int  # MoE layers
    n_expert: int
    top_k: int
    n_slots: int  # promoe: slots per MoE layer
    ncmoe_host_layers: int  # ncmoe: MoE layers whose experts stay in host memory
    dense_bytes: int  # non-expert weights read once a token on the device
    n_layer: int
    prompt_rows: int = PROMPT_ROWS  # a prompt ubatch's rows (the run's n_ubatch)
    bank: bool = False  # promoe computes prompt ubatches from prompt banks (setup.held_back)


def _dense_s(shape: DecodeShape, p: Profile) -> float:
    return (roofline_s(p.gpu_launch_s * shape.n_layer, shape.dense_bytes, p.gpu_mem_gbps, 0.0, 1.0)
            + p.token_s)


def ncmoe_decode_s(shape: DecodeShape, p: Profile, cost: CostModel) -> float:
    """Seconds a token under ``--n-cpu-moe``: device layers, then host layers on the CPU."""
    k = shape.top_k
    host = shape.ncmoe_host_layers
    return (_dense_s(shape, p) + (shape.n_moe - host) * cost.dev_s(k, k)
            + host * cost.host_s(k, k))


def promoe_layer_s(shape: DecodeShape, p: Profile, cost: CostModel, hit: float) -> float:
    """Expected seconds of one MoE layer's routed experts under promoe, misses binomial."""
    k = shape.top_k
    n_proj = len(cost.expert.proj_bytes)
    hook = p.prefetch_hook_s or p.hook_s
    # one-token gates are decided in C (the decode gate) unless the layer goes wholly to the CPU
    gate = p.decode_gate_s or hook
    total = 0.0
    for m in range(k + 1):
        pm = comb(k, m) * (1 - hit) ** m * hit ** (k - m)
        rows = [(e, 1, e >= m) for e in range(k)]  # experts 0..m-1 missing
        split, t = cost.best_split(rows, 0)
        if split.whole_layer:
            t += hook
        else:
            t += gate
            streamed = m - len(split.host)
            # every expert in its slot, or the host entries computed whole: each projection one
            # product; else the hits in one group, then each streamed expert in its own as its
            # copy lands
            if m and not cost.whole():
                t += n_proj * p.group_s * ((k - m > 0) + streamed)
        total += pm * t
    return total


def promoe_decode_s(shape: DecodeShape, p: Profile, cost: CostModel, hit: float) -> float:
    """Seconds a token under promoe at hit rate ``hit``."""
    return _dense_s(shape, p) + shape.n_moe * promoe_layer_s(shape, p, cost, hit)


def distinct_experts(n_tokens: float, n_expert: int, top_k: int) -> float:
    """Expected distinct experts ``n_tokens`` route to, each to ``top_k`` of ``n_expert`` at
    random (a prompt's rows spread over nearly all: 512 rows of top-8 of 64 leave none)."""
    if n_tokens <= 0:
        return 0.0
    return n_expert * (1.0 - (1.0 - top_k / n_expert) ** n_tokens)


def _dense_prompt_s(shape: DecodeShape, p: Profile, cost: CostModel) -> float:
    """The non-expert weights' share of a prompt ubatch, on the device (the same in both
    placements): every row through every dense weight, at the experts' bytes a weight."""
    e = cost.expert
    per_weight = e.nbytes / (3.0 * e.d_model * e.expert_ff)
    flops = 2.0 * shape.prompt_rows * shape.dense_bytes / per_weight
    return (roofline_s(p.gpu_launch_s * shape.n_layer, shape.dense_bytes, p.gpu_mem_gbps, flops,
                       p.gpu_tflops * 1e12) + p.token_s)


def ncmoe_prompt_s(shape: DecodeShape, p: Profile, cost: CostModel) -> float:
    """Seconds of a prompt ubatch under ``--n-cpu-moe`` (``--no-mmap``): the device layers'
    experts from device memory; each host layer's used experts copied up before each of its
    projections, on the compute stream (op offload), or, for a ubatch under llama.cpp's offload
    rule, computed on the CPU."""
    n, e = shape.prompt_rows, cost.expert
    used, pairs = distinct_experts(n, shape.n_expert, shape.top_k), n * shape.top_k
    dev = cost.dev_s(round(used), pairs)
    if 0 < p.op_offload_min_batch <= n:
        host = dev + sum(cost.chunk_latency_s + used * nb / (cost.copy_gbps * 1e9)
                         for nb in e.proj_bytes)
    else:
        host = cost.host_s(round(used), pairs)
    h = shape.ncmoe_host_layers
    return _dense_prompt_s(shape, p, cost) + (shape.n_moe - h) * dev + h * host


def promoe_prompt_s(shape: DecodeShape, p: Profile, cost: CostModel) -> float:
    """Seconds of a prompt ubatch (``DEVICE_MIN_TOKENS`` rows or more) under promoe, its slots
    holding ``n_slots`` of each layer's experts (a prompt's misses hardly depend on locality: it
    routes nearly every expert).

    With prompt banks, each layer's bank is filled with every expert its slots lack, on a stream
    of its own, issued as the layer before computes its experts: a layer's experts start when
    they and its fill are done. Without them, a layer's missing experts stream through its slots
    once its routing is read, computed as expert groups (the hits' group, then about one a
    streamed expert a projection) while they land."""
    n, e = shape.prompt_rows, cost.expert
    used, pairs = distinct_experts(n, shape.n_expert, shape.top_k), n * shape.top_k
    dense = _dense_prompt_s(shape, p, cost) / shape.n_moe  # a layer's share, before its experts
    dev = cost.dev_s(round(used), pairs) + p.gpu_launch_s * len(e.proj_bytes)
    lack = shape.n_expert - shape.n_slots
    if not shape.bank:
        missing = used * lack / shape.n_expert
        groups = len(e.proj_bytes) * (1 + missing) * (p.gpu_launch_s + p.group_s)
        layer = max(missing * cost.copy_s(), dev) + groups + (p.prefetch_hook_s or p.hook_s)
        return shape.n_moe * (dense + layer)
    fill = cost.fill_s(lack)
    t, filled = 0.0, fill  # the first layer's fill begins with the pass
    for _ in range(shape.n_moe):
        start = max(t + dense, filled)
        filled = max(start, filled) + fill  # the next layer's, behind the fills before it
        t = start + dev
    return t


# rounds of the fill estimate's fixed point (token time <-> misses admitted)
FILL_ROUNDS = 6


def promoe_filled_s(shape: DecodeShape, p: Profile, cost: CostModel, share: float,
                    loc: float) -> tuple[float, float]:
    """Seconds a token under promoe and its hit rate, with the copies that keep the cache
    following the routing: a hit rate measured by LRU replay holds only if every miss enters
    the cache, so per token the misses' bytes cross the bus besides the critical path (cache
    fills and prefetches, at low priority). The bus carries at most a token's time of them: the
    rest are not admitted and their reuse is lost (locality scaled by the share admitted), and
    while they copy, the CPU's expert compute shares DRAM with them."""
    hit = hit_at(share, loc)
    t = promoe_decode_s(shape, p, cost, hit)
    for _ in range(FILL_ROUNDS):
        fill = shape.n_moe * shape.top_k * (1 - hit) * cost.copy_s()
        if fill <= 0 or t <= 0:
            break
        busy = min(1.0, fill / t)
        slowed = replace(cost, host_scale=cost.host_scale
                         * (1 + busy * (1 / max(cost.dram_factor, 1e-9) - 1)))
        hit = hit_at(share, loc * min(1.0, t / fill))
        t = promoe_decode_s(shape, p, slowed, hit)
    return t, hit


@dataclass(frozen=True)
class Choice:
    """The default placement and why."""

    policy: str
    promoe_s: float  # decode: seconds a token
    ncmoe_s: float
    hit: float
    evidence: Evidence
    shape: DecodeShape
    # a prompt ubatch of shape.prompt_rows (None: one under llama.cpp's offload rule, or nothing
    # to choose: decode decides)
    prompt_promoe_s: float | None = None
    prompt_ncmoe_s: float | None = None
    # promoe's placement is not the runtime's own (``choose_among``): prompt banks the other
    # way than by default
    alternative: bool = False

    def prompt_ratio(self) -> float | None:
        """promoe's estimated prompt speed over ncmoe's (above 1: promoe faster)."""
        if self.prompt_promoe_s is None or self.prompt_ncmoe_s is None or \
                self.prompt_promoe_s <= 0:
            return None
        return self.prompt_ncmoe_s / self.prompt_promoe_s

    def reason(self) -> str:
        """One line: what was chosen, the two estimates of each phase, and where the routing
        figure came from."""
        s, e = self.shape, self.evidence
        if s.ncmoe_host_layers == 0:
            return ("policy ncmoe: every routed expert fits the budget, so llama.cpp's own "
                    "placement (every layer on the device, no expert cache to pay for)")
        ratio = self.ncmoe_s / self.promoe_s if self.promoe_s > 0 else 0.0
        by = {"run": "a promoe run", "trace": "a trace",
              "replay": "the routing replayed"}.get(e.source, "promoe runs and traces")
        where = ("prior: uniform routing" if e.source == "prior" else
                 f"measured by {by}, {e.lookups} decode lookups"
                 f"{f' at share {e.share:.2f}' if e.share is not None else ''}")
        head = (f"policy {self.policy}: promoe estimated at {ratio:.2f}x --n-cpu-moe's decode "
                f"({self.promoe_s * 1e3:.1f} vs {self.ncmoe_s * 1e3:.1f} ms a token; "
                f"{s.n_slots}/{s.n_expert} slots a layer, hit rate {self.hit:.0%} {where})")
        prompt = self.prompt_ratio()
        if prompt is not None:
            assert self.prompt_promoe_s is not None and self.prompt_ncmoe_s is not None
            head += (f" and {prompt:.2f}x its prompt ({self.prompt_promoe_s * 1e3:.0f} vs "
                     f"{self.prompt_ncmoe_s * 1e3:.0f} ms a {s.prompt_rows}-token ubatch, "
                     f"{'with' if s.bank else 'without'} prompt banks)")
            if self.policy == "ncmoe" and ratio >= MARGIN and prompt < PROMPT_MARGIN:
                head += "; the prompt decides"
        if self.alternative and self.policy == "promoe":
            head += ("; prompt banks beyond their default share of the budget, which promoe "
                     "without them would lose" if s.bank else
                     "; without prompt banks, which promoe with them would lose")
        if self.policy == "ncmoe" and e.source == "prior":
            head += ("; a run with --policy promoe (or `forecache trace`) measures this model's "
                     "routing for the next choice")
        return head


def choose(shape: DecodeShape, profile: Profile, cost: CostModel,
           evidence: Evidence = PRIOR) -> Choice:
    """promoe when its estimated decode beats ncmoe's by ``MARGIN`` and its estimated prompt
    ubatch is no slower (``PROMPT_MARGIN``), else ncmoe; always ncmoe when every expert fits
    (nothing would miss: the cache's hooks would be its only effect). Measured rates in
    ``evidence`` correct ``cost`` (copy bandwidth, CPU compute time)."""
    cost = replace(cost, host_scale=evidence.host_scale,
                   copy_gbps=evidence.copy_gbps or cost.copy_gbps)
    nc = ncmoe_decode_s(shape, profile, cost)
    # best_split charges a layer's own copies and CPU compute their shared-DRAM rates; the
    # cache's fills are charged by promoe_filled_s
    pm, hit = promoe_filled_s(shape, profile, cost, shape.n_slots / shape.n_expert,
                              evidence.locality)
    prompt_pm = prompt_nc = None
    if shape.prompt_rows >= DEVICE_MIN_TOKENS and shape.ncmoe_host_layers > 0:
        prompt_pm = promoe_prompt_s(shape, profile, cost)
        prompt_nc = ncmoe_prompt_s(shape, profile, cost)
    prompt_ok = prompt_pm is None or prompt_nc is None or prompt_pm * PROMPT_MARGIN <= prompt_nc
    promoe = pm * MARGIN <= nc and prompt_ok and shape.ncmoe_host_layers > 0
    return Choice("promoe" if promoe else "ncmoe", pm, nc, hit, evidence, shape, prompt_pm,
                  prompt_nc)


def choose_among(options: Sequence[tuple[DecodeShape, Evidence]], profile: Profile,
                 cost: CostModel) -> Choice:
    """``choose`` over promoe's placements at one budget (the runtime's own first, then one with
    or without prompt banks), each with the routing evidence at its slots: the first that
    ``choose`` takes promoe for, else the first's choice (ncmoe)."""
    choices = [choose(shape, profile, cost, ev) for shape, ev in options]
    i = next((i for i, c in enumerate(choices) if c.policy == "promoe"), 0)
    return replace(choices[i], alternative=i > 0)

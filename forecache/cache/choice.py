"""The default placement: promoe where the cost model expects it to decode at least as fast as
stock llama.cpp's ``--n-cpu-moe`` for this model, budget and machine, ncmoe where it does not.

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
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from math import comb

from forecache.cache.cost import CostModel, Profile, roofline_s

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
    """Per-token facts of one model at one budget: what both placements pay and what differs."""

    n_moe: int  # MoE layers
    n_expert: int
    top_k: int
    n_slots: int  # promoe: slots per MoE layer
    ncmoe_host_layers: int  # ncmoe: MoE layers whose experts stay in host memory
    dense_bytes: int  # non-expert weights read once a token on the device
    n_layer: int


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
    promoe_s: float
    ncmoe_s: float
    hit: float
    evidence: Evidence
    shape: DecodeShape

    def reason(self) -> str:
        """One line: what was chosen, the two estimates, and where the routing figure came
        from."""
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
        if self.policy == "ncmoe" and e.source == "prior":
            head += ("; a run with --policy promoe (or `forecache trace`) measures this model's "
                     "routing for the next choice")
        return head


def choose(shape: DecodeShape, profile: Profile, cost: CostModel,
           evidence: Evidence = PRIOR) -> Choice:
    """promoe when its estimated decode beats ncmoe's by ``MARGIN``, else ncmoe; always ncmoe when
    every expert fits (nothing would miss: the cache's hooks would be its only effect). Measured
    rates in ``evidence`` correct ``cost`` (copy bandwidth, CPU compute time)."""
    cost = replace(cost, host_scale=evidence.host_scale,
                   copy_gbps=evidence.copy_gbps or cost.copy_gbps)
    nc = ncmoe_decode_s(shape, profile, cost)
    # best_split charges a layer's own copies and CPU compute their shared-DRAM rates; the
    # cache's fills are charged by promoe_filled_s
    pm, hit = promoe_filled_s(shape, profile, cost, shape.n_slots / shape.n_expert,
                              evidence.locality)
    promoe = pm * MARGIN <= nc and shape.ncmoe_host_layers > 0
    return Choice("promoe" if promoe else "ncmoe", pm, nc, hit, evidence, shape)

"""Trace-driven simulation of an expert-cache policy on a modelled machine.

A trace is replayed ubatch by ubatch (prefill rows in ubatches of ``n_ubatch``, decode rows one
at a time) through the SAME policy (``cache.policies`` / ``cache.prefetcher``) and predictor
(``cache.forecast``) code the runtime runs. What is modelled is what the runtime leaves to
llama.cpp and the C expert cache: compute time (the ``cache.cost`` roofline) and the copy engine
(``sim.engine.SimEngine``). Virtual time only:
the result depends on the trace, shape, profile and options, never on this machine.

``simulate`` replays requests one at a time; ``sim.batch.simulate_batch`` replays them as one
batch job.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from forecache.cache.budget import BANK_SHARE_MAX, settle_bank
from forecache.cache.cost import DEVICE_MIN_TOKENS, CostModel, Profile, roofline_s
from forecache.cache.forecast import Forecaster
from forecache.cache.infinity import InfinityPolicy
from forecache.cache.policies import Policy, PolicyInputs, first_use, hit_rate
from forecache.cache.prefetcher import (
    SLOT_READY,
    Features,
    ProMoEPolicy,
    stage_slots,
)
from forecache.cache.registry import SIM_POLICIES, PolicySpec, policy_spec
from forecache.predictor.base import Predictor
from forecache.sim.diskside import DiskSide
from forecache.sim.engine import SimEngine
from forecache.sim.shapes import ModelShape
from forecache.trace.format import Request, logged_layers

__all__ = ["SIM_POLICIES", "SimConfig", "SimResult", "Simulator", "simulate"]


@dataclass
class SimConfig:
    """One simulated run: policy, cache size, promoe's options and the ubatch size."""

    policy: str
    # per MoE layer with data, or per model layer (e.g. infinity's ``cache.allocation``); ncmoe:
    # the same expert budget, as whole layers
    n_slots: int | list[int]
    features: Features = field(default_factory=Features)
    window: int = 2
    n_ubatch: int = 512
    static_profile: np.ndarray | None = None  # static: routed counts [L, E]
    # promoe/infinity: stage slots for prompt passes, taken from the layers' slots (None:
    # stage_slots, as on a GPU at run time)
    stage_slots: int | None = None
    # MoBiLE (issue 20): a decode token's little pass routes its top ``little_k`` experts (0:
    # exact decoding); ``fallback`` of the tokens are then recomputed by the big pass, whose
    # experts the little pass's router output prefetches. ``little_resident``: the little pass
    # routes the token's top-1 and those of its top ``little_k`` already copied to their slots
    # (cache-conditional routing)
    little_k: int = 0
    fallback: float = 0.0
    little_resident: bool = False
    seed: int = 0  # which tokens fall back, and how many drafts are accepted
    # the runtime's hot path: "remap" (from patch version 18: slot ids remapped on the device, a
    # layer with every expert resident runs without a stop, a short ubatch waits for each
    # projection's copies and computes it as one product) or "groups" (before it: every cached
    # layer stops, a short ubatch with copies in flight computes expert groups), which the GPU
    # rows measured until 2026-11-26 ran
    hot_path: str = "remap"
    # prompt banks (forecache_cache_set_bank, patch version 19): a ubatch of DEVICE_MIN_TOKENS
    # rows or more computes each cached layer with a missing expert as one product over its
    # slots and a bank holding the experts they lack, copied over the bus on a stream of their
    # own, the next layer's filling while this one computes; no hook, no read-back, no slot
    # changed (None: as the runtime's default on a GPU: with hot_path "remap" for a policy
    # that does not watch every routing, without a disk tier)
    prompt_bank: bool | None = None
    # speculative decoding (SP-MoE, issue 21): each step drafts ``spec_k`` tokens, verifies them
    # with the next in one ubatch and accepts each draft with probability ``spec_accept`` (until
    # the first rejection). ``spec_draft`` "little": the model's little pass over ``little_k``
    # experts (self-little; the verification first prefetches what the little passes routed);
    # "model": a dense draft of ``draft_bytes`` on the device (its memory taken from the slots),
    # while which the verifier's experts of layers up to ``spec_cutoff`` (None: all) are copied
    # in, as SP-MoE's cross-model predictor names them (``draft_recall`` of them, at random);
    # ``spec_cutoff`` -1: SP-MoE's rule, as the runtime applies it (the predicted misses' copies
    # fit in the drafting time)
    spec_draft: str = ""
    spec_k: int = 4
    spec_accept: float = 0.8
    draft_bytes: float = 0.0
    spec_cutoff: int | None = None
    draft_recall: float = 1.0
    # batch jobs (``simulate_batch``): sequences decoded together, tokens a llama batch holds
    # (None: roofline.batch.batch_tokens), and the KV cache in host memory (llama.cpp's
    # offload_kqv off), where the CPU computes attention
    n_seq: int = 1
    n_batch: int | None = None
    kv_host: bool = False
    # how llama.cpp splits a batch into ubatches (``split_batch``): "simple", n_ubatch rows at a
    # time (a unified KV cache); "equal", as with a KV stream per sequence (forecache batch)
    split: str = "simple"
    # the profile the policy's host split plans with (None: the simulated machine's own). The
    # runtime plans with its default machine's profile and the device's probed copy rate
    # (``placement.costs.split_cost``): given, the plan takes the simulated machine's copy rate too
    plan_profile: Profile | None = None
    # the disk tier (issue 38): host slots each MoE layer keeps of its routed experts, the rest
    # read from the model file when needed (None, or every expert: all in host memory, no disk
    # tier). forecache's placements read into those slots (``sim.hosttier.HostTier``);
    # llama.cpp's ncmoe-mmap gets as many experts' worth of page cache (``PageCache``), and
    # ncmoe and offload, which read every host expert into memory, refuse a model that does not
    # fit. ``disk_window``: layers beyond ``window`` whose predicted experts are read into host
    # slots ahead, without a copy (0: none). ``fault_qd``: ncmoe-mmap's page faults in flight
    # (1: a faulting thread waits for each read-ahead window). ``host_evict``: the host tier's
    # eviction order (``sim.hosttier.HOST_EVICTIONS``; "uses" is the C tier's)
    host_slots: int | None = None
    disk_window: int = 0
    fault_qd: int = 1
    host_evict: str = "uses"
    # exclusive tiers: an expert copied to a device slot gives up its host slot first, and one
    # leaving a device slot is written back to a host slot (``HostTier.demote``)
    host_exclusive: bool = False
    # False: a predicted expert's copy reads nothing from the file; its read waits for the
    # layer's routing to want it (only experts already in host slots are copied ahead)
    host_read_ahead: bool = True
    # True: the disk's readers serve reads in priority order, each read split in pieces that
    # every reader works on, so reads end one after another at the full rate (``HostTier``'s
    # ``ordered``); False: the reads in flight share the rate and end together
    disk_ordered: bool = False
    # several devices (``sim.devices``): the device of each model layer, as llama.cpp's layer
    # split assigns them (None: one device). A layer's weights, KV and (forecache) expert
    # slots are on its device, its compute runs there and its copies take that device's link
    # to the host; a ubatch's activations cross to the next device at each split boundary
    layer_device: tuple[int, ...] | None = None

    def slots_at(self, layer: int) -> int:
        """Slots of model layer ``layer``."""
        return self.n_slots if isinstance(self.n_slots, int) else int(self.n_slots[layer])


@dataclass
class SimResult:
    ttft_s: float
    tpot_s: float
    prefill_s: float
    decode_s: float
    n_prefill_tokens: int
    n_decode_tokens: int
    hits: int
    misses: int
    host_layers: int
    h2d_bytes: int
    stall_s: float  # compute waiting for copies: loading time on the critical path
    hook_s: float
    extra: dict
    per_layer: list[dict]
    # the disk tier (``SimConfig.host_slots``): experts read from the file (ncmoe-mmap:
    # read-ahead windows faulted in) and their bytes, in all and during decode tokens; the
    # critical path's waits for them; uses of the host tier (ncmoe-mmap: of the page cache)
    # that found the expert in memory, or not
    disk_reads: int = 0
    disk_bytes: int = 0
    decode_disk_reads: int = 0
    decode_disk_bytes: int = 0
    disk_stall_s: float = 0.0
    host_hits: int = 0
    host_misses: int = 0

    @property
    def disk_reads_per_token(self) -> float:
        """Reads from the file per decoded token."""
        return self.decode_disk_reads / self.n_decode_tokens if self.n_decode_tokens else 0.0

    @property
    def disk_bytes_per_token(self) -> float:
        """Bytes read from the file per decoded token."""
        return self.decode_disk_bytes / self.n_decode_tokens if self.n_decode_tokens else 0.0

    @property
    def host_hit_rate(self) -> float | None:
        """Share of the host tier's uses that found the expert in memory (None: no uses)."""
        return hit_rate(self.host_hits, self.host_misses)

    def to_json(self) -> dict:
        out = {k: v for k, v in self.__dict__.items() if k not in ("extra", "per_layer")}
        out.update(self.extra)
        out["hit_rate"] = hit_rate(self.hits, self.misses) or 0.0
        out.update(disk_reads_per_token=self.disk_reads_per_token,
                   disk_bytes_per_token=self.disk_bytes_per_token,
                   host_hit_rate=self.host_hit_rate)
        out["per_layer"] = self.per_layer
        return out


class Simulator:
    """Replays requests of a trace through a policy on the modelled machine."""

    def __init__(self, shape: ModelShape, profile: Profile, cfg: SimConfig, layers: Sequence[int],
                 predictor: Predictor | None = None) -> None:
        self.shape, self.profile, self.cfg = shape, profile, cfg
        self.layers = list(layers)  # trace layers with routing data, simulated as cached layers
        n_layers = shape.layers
        self.n_slots = [0] * n_layers
        if not isinstance(cfg.n_slots, int) and len(cfg.n_slots) != n_layers:
            raise ValueError(f"{len(cfg.n_slots)} slot counts for a shape of {n_layers} layers")
        spec = self.spec = policy_spec(cfg.policy, simulated=True)
        # with a disk tier every layer computes from slots, its experts not in memory
        least = 1 if spec.cached and cfg.host_slots is not None and \
            cfg.host_slots < shape.experts else 0
        for il in self.layers:
            self.n_slots[il] = max(min(cfg.slots_at(il), shape.experts), least)
        f = cfg.features
        self.bank = self._banks(spec)
        if self.bank:  # the banks' device memory, out of the slots as stage slots
            self._take_slots(self._bank_held())
        stage = stage_slots(shape.experts, self.n_slots, given=cfg.stage_slots,
                            streams=spec.proactive and f.reorder and not self.bank)
        self._take_slots(stage)  # the stage's device memory
        self.n_stage = stage
        # a model draft's weights on the device, in experts' worth: out of the slots
        draft_experts = int(np.ceil(cfg.draft_bytes / shape.expert_bytes)) \
            if cfg.spec_draft == "model" and cfg.draft_bytes > 0 else 0
        self._take_slots(draft_experts)
        if cfg.layer_device is not None and len(cfg.layer_device) != n_layers:
            raise ValueError(f"{len(cfg.layer_device)} layer devices for a shape of {n_layers} "
                             "layers")
        self.engine = SimEngine(shape, self.n_slots, profile, whole_expert_chunks=not f.chunk,
                                n_stage=stage, bus_of=cfg.layer_device)
        self.n_devices = self.engine.n_buses
        cost = CostModel.from_profile(cfg.plan_profile or profile, shape.expert)
        if cfg.plan_profile is not None:
            cost.copy_gbps = profile.h2d_gbps
        self.policy: Policy | None = spec.policy.create(self.n_slots, PolicyInputs(
            features=f, cost=cost, profile=cfg.static_profile, top_k=shape.top_k)) \
            if spec.policy is not None else None
        # Layers whose experts stay in host memory under stock llama.cpp's rules: every layer for
        # offload; for ncmoe (--n-cpu-moe N) the first N, N as small as the budget allows. A
        # prompt's ubatches copy them up at the pinned rate, or the pageable one when mmap'd.
        self.stock_host: set[int] = set()
        self.stock_gbps = profile.pageable_gbps() if spec.mmap else profile.h2d_gbps
        if spec.placement == "host":
            self.stock_host = set(self.layers)
        elif spec.placement == "layers":
            # (a draft's weights take device memory --n-cpu-moe then leaves to host layers)
            total = sum(cfg.slots_at(il) for il in self.layers) - draft_experts
            on_gpu = min(len(self.layers), max(total, 0) // shape.experts)
            self.stock_host = set(sorted(self.layers)[:len(self.layers) - on_gpu])
        self.forecaster = None
        if spec.ranks_experts and f.prefetch and predictor is not None:
            # the whole ranking an EAM match gives: infinity's eviction priority
            self.forecaster = Forecaster(predictor, cfg.window, self.layers, self.n_slots,
                                         n_predict=shape.experts, min_score=0.0)
        elif spec.proactive and f.prefetch and predictor is not None:
            self.forecaster = Forecaster(predictor, cfg.window, self.layers, self.n_slots)
        self.disk = DiskSide(self, predictor)  # before the first load: it reads from the file
        if self.policy is not None:
            self.policy.attach(self.engine)
            for il, e, s in self.policy.initial_loads():
                self.engine.load(il, e, s, 1)
            self.engine.wait_until(lambda: self.engine.running is None and
                                   not any(self.engine.queue))
            # the loads before the first request are not the run's copies (nor any link's)
            self.engine.stats.update({k: 0 for k in self.engine.stats
                                      if k.startswith("h2d_bytes")}, n_chunks=0)
            self.disk.after_initial_loads()
        self.t = self.engine.now
        self._merge = CostModel.from_profile(profile, shape.expert)  # host entries' merge time
        self._hook_s = profile.prefetch_hook_s if spec.proactive and \
            profile.prefetch_hook_s > 0 else profile.hook_s
        # one-token gates the engine decides in C from the policy's tables, as at run time
        # (per experts a token routes: a MoBiLE little pass routes fewer)
        self._decode_gates: dict[int, tuple | None] = {}
        self._pred: dict[int, tuple[int, np.ndarray]] = {}  # layer -> (pass, predicted)
        self._floor = 0.0  # the last ubatch's physical floor
        self._bus_floor = 0.0  # and its bus floor
        self._rng = np.random.default_rng(cfg.seed)
        # the drafts' acceptance draws of their own: runs of one acceptance and k accept alike,
        # whatever else (recall, fallbacks) draws
        self._accept_rng = np.random.default_rng([cfg.seed, 1])
        self._little = False  # the pass being simulated is a MoBiLE little pass
        self._oracle: np.ndarray | None = None  # the big pass's routing, prefetched at its start
        self._bank_end: dict[int, float] = {}  # layer -> when its bank's fill ends (this pass)
        self._bank_free = 0.0  # when the fills' stream is free
        # the next pass reads the fills of the one before (a round of micro-batches' passes)
        self.keep_fills = False
        self._init_counters()

    def _init_counters(self) -> None:
        self.hits = self.misses = self.host_layers = 0
        self.stall = self.hook = self.fast = 0.0
        # critical-path seconds by what they wait for, beyond the device's compute: the CPU
        # (host experts, host attention), the bus (activations to a host KV cache; copy waits
        # are ``stall``) and the runtime's own steps (hooks, gates, passes, expert groups)
        self.cpu_s = self.bus_s = self.runtime_s = self.attn_s = 0.0
        self.decode_gates = 0
        self.quiet = 0  # layer passes without a stop (every expert resident)
        self.banked = 0  # layer passes computed from a prompt bank
        self.bank_bytes = 0.0  # bytes copied host -> banks
        self.hops = 0  # activations crossing between devices
        L = self.shape.layers
        self.lay = {k: np.zeros(L) for k in ("predicted", "correct", "in_time", "good", "stall")}
        self.floor_prefill: list[float] = []  # per request
        self.little_passes = self.big_passes = 0
        self.spec_steps = self.spec_accepted = 0
        self.spec_cutoffs: list[int] = []  # SP-MoE's rule's choices
        self.bus_floor_prefill: list[float] = []
        self.floor_decode: list[float] = []  # per decoded token

    def _take_slots(self, n: int) -> None:
        """``n`` slots' worth of device memory taken for something else: one slot from a layer
        at a time, from the last layer with more than one."""
        cached = [il for il in self.layers if self.n_slots[il] > 1]
        for k in range(n if cached else 0):
            self.n_slots[cached[-1 - k % len(cached)]] -= 1

    def _banks(self, spec: PolicySpec) -> bool:
        """Prompt banks, as ``placement.before.held_back`` places them: asked for (by default with
        the "remap" hot path), for a cached policy that does not watch every routing, without
        a disk tier, where some layer misses experts and, by default, within
        ``BANK_SHARE_MAX`` of the slots."""
        cfg, sh = self.cfg, self.shape
        want = cfg.prompt_bank if cfg.prompt_bank is not None else cfg.hot_path == "remap"
        if not (want and spec.policy is not None and not spec.policy.routes_every_layer and
                cfg.host_slots is None and cfg.hot_path == "remap"):
            return False
        if all(self.n_slots[il] >= sh.experts for il in self.layers):
            return False
        total = sum(self.n_slots[il] for il in self.layers)
        return self._bank_held() < total * (1.0 if cfg.prompt_bank else BANK_SHARE_MAX)

    def _bank_held(self) -> int:
        """Slots the banks take (``budget.settle_bank``), taken as the simulator takes what is
        held: one a layer from the last cached layers."""
        def slots_after(held: int) -> list[int]:
            slots = list(self.n_slots)
            cached = [il for il in self.layers if slots[il] > 1]
            for k in range(held if cached else 0):
                slots[cached[-1 - k % len(cached)]] -= 1
            return [slots[il] for il in self.layers]

        return settle_bank(self.shape.experts, slots_after)

    def reset_counters(self) -> None:
        """Forget what was counted so far and keep the state (slots, host tier, page cache,
        predictors, clocks): what a warmed-up run measures from here."""
        self._init_counters()
        self.engine.stats = dict.fromkeys(self.engine.stats, 0)
        if isinstance(self.policy, ProMoEPolicy):
            self.policy.prefetch_loads = self.policy.stale_predictions = 0
        self.disk.reset_counters()

    # -- timing model -------------------------------------------------------------------------
    def _dev(self, nbytes: float, flops: float) -> float:
        p = self.profile
        return roofline_s(p.gpu_launch_s, nbytes, p.gpu_mem_gbps, flops, p.gpu_tflops * 1e12)

    def _host(self, nbytes: float, flops: float, start: float | None = None) -> float:
        """CPU expert compute starting at ``start`` (default now); it reads DRAM at a shared
        rate while copies run, and copies that start before it ends share DRAM with it."""
        p, eng = self.profile, self.engine
        copying = eng.running is not None or any(eng.queue)
        mem = p.cpu_mem_gbps * p.dram_factor(copy=copying, cpu=True,
                                             disk=eng.disk is not None and eng.disk.flowing())
        t = roofline_s(p.cpu_launch_s, nbytes, mem, flops, p.cpu_gflops * 1e9)
        begin = self.t if start is None else start
        eng.cpu_busy_until = max(eng.cpu_busy_until, begin + t)
        return t

    def _node(self, experts: Sequence[int], rows: int, p: int) -> float:
        sh = self.shape
        return self._dev(len(experts) * sh.proj_bytes[p], rows * sh.proj_flops)

    # -- replay -------------------------------------------------------------------------------
    def run_request(self, req: Request) -> tuple[float, list[float]]:
        """Simulate one request; returns (prefill seconds, per-decode-token seconds)."""
        phase = req.phase if req.phase is not None else np.ones(req.n_tokens, np.int8)
        if self.policy is not None:
            self.policy.begin_request()
        if self.forecaster is not None:
            self.forecaster.begin_request()
        self.disk.begin_request()
        prefill_rows = np.flatnonzero(phase == 0)
        prefill = floor = bus = 0.0
        self.disk.set_decoding(False)
        for i in range(0, len(prefill_rows), self.cfg.n_ubatch):
            prefill += self._ubatch(req, prefill_rows[i:i + self.cfg.n_ubatch])
            floor += self._floor
            bus += self._bus_floor
        if len(prefill_rows):
            self.floor_prefill.append(floor)
            self.bus_floor_prefill.append(bus)
        decode = []
        rows = np.flatnonzero(phase != 0)
        self.disk.set_decoding(True)
        i = 0
        while self.cfg.spec_draft and i < len(rows):
            t, n = self._spec_step(req, rows[i:])
            decode.extend([t / n] * n)
            i += n
        for r in rows if not self.cfg.spec_draft else []:
            if self.cfg.little_k:
                decode.append(self._mobile_token(req, r))
                continue
            decode.append(self._ubatch(req, np.array([r])))
            self.floor_decode.append(self._floor)
        if self.forecaster is not None:
            self.forecaster.end_request()
        return prefill, decode

    def _mobile_token(self, req: Request, r: int) -> float:
        """One decode token under MoBiLE: the little pass, then for ``fallback`` of the tokens
        the big pass, which starts by prefetching the experts the little pass's router output
        names for every layer (the paper's training-free prefetch)."""
        self._little = True
        t = self._ubatch(req, np.array([r]))
        floor = self._floor
        self._little = False
        self.little_passes += 1
        if self._rng.random() < self.cfg.fallback:
            self._oracle = req.experts[r]
            t += self._ubatch(req, np.array([r]))
            floor += self._floor
            self._oracle = None
            self.big_passes += 1
        self.floor_decode.append(floor)
        return t

    def _spec_step(self, req: Request, rows: np.ndarray) -> tuple[float, int]:
        """One speculative step from the token at ``rows[0]``: draft ``spec_k`` tokens, verify
        them in one ubatch of k+1 rows (the trace's next rows: an accepted draft is the token the
        trace has there), accept each with ``spec_accept`` until the first rejection. Returns
        the step's seconds and the tokens it yields (accepted + 1)."""
        cfg, eng = self.cfg, self.engine
        k = min(cfg.spec_k, len(rows) - 1)
        t0 = self.t
        if k < 1:
            self._ubatch(req, rows[:1])
            self.floor_decode.append(self._floor)
            return self.t - t0, 1
        verify = rows[:k + 1]
        if cfg.spec_draft == "little":
            self._little = True
            for r in rows[:k]:
                self._ubatch(req, np.array([r]))
            self._little = False
            self.little_passes += k
            # the little passes' routing is the verification's: prefetched at its start
            self._oracle = np.concatenate([req.experts[r] for r in verify], axis=1)
        else:
            draft_s = self._dev(cfg.draft_bytes, 4.0 * cfg.draft_bytes)
            cutoff = len(self.layers) if cfg.spec_cutoff is None else cfg.spec_cutoff
            if cutoff < 0:
                miss = self.misses / max(self.hits + self.misses, 1)
                per_layer = miss * min(self.shape.top_k * k, self.shape.experts)
                copy_s = self._merge.copy_s()
                cutoff = len(self.layers) if per_layer <= 0 else \
                    min(len(self.layers), int(k * draft_s / (per_layer * copy_s)))
                self.spec_cutoffs.append(cutoff)
            for r in verify[:k]:
                # the draft reaches each layer and names the verifier's experts there
                if isinstance(self.policy, ProMoEPolicy):
                    for il in self.layers[:cutoff]:
                        ids = req.experts[r, il]
                        ids = [int(e) for e in ids[ids >= 0]
                               if self._rng.random() < cfg.draft_recall]
                        self.policy.warm(il, ids, eng)
                self.t += draft_s
                eng.advance_to(self.t)
        self._ubatch(req, verify)
        self._oracle = None
        self.floor_decode.append(self._floor)
        j = 0
        while j < k and self._accept_rng.random() < cfg.spec_accept:
            j += 1
        self.spec_steps += 1
        self.spec_accepted += j
        return self.t - t0, j + 1

    def _little_ids(self, req: Request, row: int, il: int) -> np.ndarray:
        """The experts a little pass routes at layer ``il``: the token's top ``little_k`` (by
        router weight where the trace has it, else in the trace's order, top-1 first), or with
        ``little_resident`` its top-1 and those of its top ``little_k`` copied to their slots (as
        forecache_cache_set_little does: a slot still copying is not used)."""
        ids = req.experts[row, il].astype(np.int64)
        if req.weights is not None:
            ids = ids[np.argsort(-req.weights[row, il].astype(np.float32), kind="stable")]
        ids = ids[ids >= 0]
        if not self.cfg.little_resident:
            return ids[:self.cfg.little_k]
        expert_of, state = self.engine.layer_state(il)
        ready = set(expert_of[state == SLOT_READY].tolist())
        return np.array([e for i, e in enumerate(ids[:self.cfg.little_k].tolist())
                         if i == 0 or e in ready], np.int64)

    def _ubatch(self, req: Request, rows: np.ndarray,
                attention: tuple[float, float] | None = None, logits: int = 1) -> float:
        """Simulate one ubatch; returns its seconds and leaves its floors: in ``_floor`` the
        device's compute with every routed expert resident, plus the bytes of this run's misses
        at the host's best rate (copies and CPU compute together, within DRAM), one after the
        other as a layer-by-layer schedule has them; in ``_bus_floor`` the misses' bytes over
        the bus with all compute hidden under them (or the compute, if longer).
        ``attention``: (KV bytes read, flops) of every layer's attention over the rows'
        contexts (batch replays; single requests leave attention out); ``logits``: rows the
        head computes and the runtime samples."""
        sh, eng, n = self.shape, self.engine, len(rows)
        t0 = self.t
        eng.new_pass()
        if self._oracle is not None and isinstance(self.policy, ProMoEPolicy):
            # the big pass prefetches what the little pass's router chose, every layer at once
            self.t += self._hook_s
            eng.advance_to(self.t)
            for il in self.layers:
                known = self._oracle[il][self._oracle[il] >= 0]
                self.policy.prefetch(il, known.tolist(), eng.epoch, eng)
        cached = set(self.layers)
        p = self.profile
        both = p.h2d_gbps * self.n_devices + p.cpu_mem_gbps
        best_gbps = min(both, p.dram_gbps) if p.dram_gbps > 0 else both
        floor = compute = 0.0
        missed_bytes = 0
        dev_at = self.cfg.layer_device
        device = dev_at[0] if dev_at is not None else 0
        if sh.lead_bytes:  # leading dense layers: weights on the device, every row through them
            lead = self._dev(sh.lead_bytes, 2.0 * n * sh.lead_bytes / sh.bytes_per_weight)
            self.t += lead
            floor += lead
            compute += lead
        banks = self.bank and n >= DEVICE_MIN_TOKENS and not self._little
        if not self.keep_fills:
            self._bank_end = {}
        if banks:  # the first bank layer's fill begins with the pass (fc_bank_begin)
            self._bank_fill(self._next_bank(-1), self.t)
        for il in range(sh.layers):
            if il not in cached:
                # a layer the trace logged no routing for is left out: the run is the model's
                # logged layers (a partial trace's figures hold for them, not for the rest)
                continue
            if dev_at is not None and dev_at[il] != device:
                hop = self._hop(n)
                device = dev_at[il]
                self.t += hop
                floor += hop
                compute += hop
            dense = self._dev(sh.layer_bytes, n * sh.layer_flops)
            if attention is not None:
                dense += self._attention(attention[0], attention[1], n)
            self.t += dense
            floor += dense
            compute += dense
            eng.advance_to(self.t)
            ids = req.experts[rows, il].astype(np.int64)
            if self._little:
                ids = self._little_ids(req, int(rows[0]), il)[None, :]
            known = ids[ids >= 0]
            if known.size == 0:
                continue
            experts, counts = first_use(known)
            self._account_prediction(il, experts)
            missed = self.misses
            nodes = sum(self._node(experts, known.size, j) for j in range(len(sh.proj_bytes)))
            floor += nodes
            compute += nodes
            if self.policy is not None and self.cfg.hot_path == "remap" and \
                    (self._quiet(il) or banks and self._complete(il)):
                # as fc_quiet: no stop, no gate; each projection one product over the slots
                self.hits += len(experts)
                self.quiet += 1
                self.t += nodes
                eng.advance_to(self.t)
                continue
            if banks and not self._complete(il):
                copied = self._bank_layer(il, nodes)
                missed_bytes += copied
                floor += copied / (best_gbps * 1e9)
                continue
            if self.policy is None:
                self._stock_layer(il, experts, known.size, n)
                floor += (self.misses - missed) * sh.expert_bytes / (best_gbps * 1e9)
                missed_bytes += (self.misses - missed) * sh.expert_bytes
                continue
            eng.begin_route(il, experts.tolist(), counts.tolist())
            L = eng.layers[il]
            for e in experts.tolist():
                if e in L.slot_of:
                    self.hits += 1
                else:
                    self.misses += 1
            floor += (self.misses - missed) * sh.expert_bytes / (best_gbps * 1e9)
            missed_bytes += (self.misses - missed) * sh.expert_bytes
            if self._in_c(il, experts, n):
                self.t += self.profile.decode_gate_s
                self.fast += self.profile.decode_gate_s
                self.decode_gates += 1
                self.runtime_s += self.profile.decode_gate_s
            else:
                self.t += self._hook_s
                self.hook += self._hook_s
                self.runtime_s += self._hook_s
            eng.advance_to(self.t)
            on_slots = self.policy.gate(il, experts, eng, counts, n)
            if on_slots and not L.sch_e:
                on_slots = eng.default_schedule(il, experts.tolist())
            if self.forecaster is not None:
                self._forecast(il, ids, req, rows)
            if on_slots and L.streams and not self.cfg.features.reorder:
                on_slots = False
            if not on_slots:
                eng.end_route_host(il)
                self.host_layers += 1
                if self.disk.tier is not None:  # its experts read into host slots first
                    self.disk.host_layer(il, experts, dict(zip(experts.tolist(),
                                                               counts.tolist(), strict=True)))
                    continue
                host = self._host_layer(experts, known.size)
                self.t += host
                self.cpu_s += host
                eng.advance_to(self.t)
                continue
            self._slot_compute(il, dict(zip(experts.tolist(), counts.tolist(), strict=True)), n)
        head = self._dev(sh.head_bytes, 2.0 * logits * sh.head_bytes / sh.bytes_per_weight)
        self.t += head
        # outside the graph: the pass's Python, and reading and sampling each further row
        self.t += self.profile.token_s + max(logits - 1, 0) * self.profile.sample_s
        self.runtime_s += self.profile.token_s + max(logits - 1, 0) * self.profile.sample_s
        self._floor = floor + head
        self._bus_floor = max(compute + head,
                              missed_bytes / (p.h2d_gbps * self.n_devices * 1e9))
        eng.advance_to(self.t)
        return self.t - t0

    def _next_bank(self, il: int) -> int:
        """The first layer after ``il`` a prompt pass computes from its bank (-1: none)."""
        later = [k for k in self.layers if k > il and not self._complete(k)]
        return later[0] if later else -1

    def _bank_fill(self, il: int, issued: float) -> None:
        """Layer ``il``'s bank filled on the fills' stream from ``issued`` on: the experts its
        slots lack, over the bus (those beyond the bank's size go into empty slots at run time:
        not modelled, the slots start full as promoe fills them)."""
        if il < 0 or il in self._bank_end:
            return
        sh, p = self.shape, self.profile
        expert_of, state = self.engine.layer_state(il)
        resident = len(set(expert_of[state == SLOT_READY].tolist()))
        h2d = (sh.experts - resident) * sh.expert_bytes
        fill = p.chunk_latency_s + h2d / (p.h2d_gbps * 1e9)
        start = max(issued, self._bank_free)
        self._bank_free = self._bank_end[il] = start + fill
        self.engine.stats["h2d_bytes"] += h2d
        self.bank_bytes += h2d

    def _bank_layer(self, il: int, nodes: float) -> float:
        """Layer ``il`` of a prompt pass from its bank (fc_bank_remap): its fill issued if it
        was not, the next bank layer's issued, one product per projection once its fill is
        done. Returns the bytes its fill copied over the bus."""
        before = self.bank_bytes
        self._bank_fill(il, self.t)
        self._bank_fill(self._next_bank(il), self.t)
        self.t += self.profile.gpu_launch_s  # the ranges launched before the layer's products
        self.runtime_s += self.profile.gpu_launch_s
        ready = self._bank_end[il]
        if ready > self.t:
            self.stall += ready - self.t
            self.lay["stall"][il] += ready - self.t
            self.t = ready
        self.t += nodes
        self.banked += 1
        self.engine.advance_to(self.t)
        return int(self.bank_bytes - before)

    def _hop(self, n_rows: int) -> float:
        """A ubatch's hidden state (f32) crossing from one device to the next at a split
        boundary: down to the host and up again (no peer-to-peer between the cards)."""
        p = self.profile
        t = 2 * (p.chunk_latency_s + n_rows * self.shape.d_model * 4 / (p.h2d_gbps * 1e9))
        self.bus_s += t
        self.hops += 1
        return t

    def _attention(self, nbytes: float, flops: float, n_rows: int) -> float:
        """One layer's attention over the ubatch's contexts: on the device, or with the KV cache
        in host memory on the CPU (sharing DRAM with copies), its rows' q, k and v copied down
        and its output back up."""
        if not self.cfg.kv_host:
            t = self._dev(nbytes, flops)
        else:
            p = self.profile
            act = 4.0 * n_rows * self.shape.d_model * 4  # f32 q, k, v down; the output up
            bus = 2 * p.chunk_latency_s + act / (p.h2d_gbps * 1e9)
            host = self._host(nbytes, flops)
            self.cpu_s += host
            self.bus_s += bus
            t = bus + host
        self.attn_s += t
        return t

    def _complete(self, il: int) -> bool:
        """Every expert of layer ``il`` is in a slot whose copy is done, and no stage slot holds
        one of its experts (fc_complete)."""
        eng = self.engine
        if self.n_slots[il] < self.shape.experts or \
                any(o is not None and o[0] == il for o in eng.stage_of):
            return False
        expert_of, state = eng.layer_state(il)
        return len(set(expert_of[state == SLOT_READY].tolist())) >= self.shape.experts

    def _quiet(self, il: int) -> bool:
        """Layer ``il`` runs without a stop (forecache_cache_set_quiet): every expert resident
        and, while forecasts listen, the next layer's too."""
        if self._little or self.policy is None or self.policy.routes_every_layer or \
                not self._complete(il):
            return False
        if self.forecaster is not None:
            later = [k for k in self.layers if k > il]
            return not later or self._complete(min(later))
        return True

    def _in_c(self, il: int, experts: np.ndarray, n_tokens: int) -> bool:
        """The gate is one the C decode gate decides (forecache_cache_set_decode_gate)."""
        k = len(experts)
        if n_tokens != 1 or (k != self.shape.top_k and not self._little):
            return False
        if k not in self._decode_gates:
            self._decode_gates[k] = self.policy.decode_gate(k) \
                if self.policy is not None and self.profile.decode_gate_s > 0 else None
        table = self._decode_gates[k]
        if table is None or self.n_slots[il] < k:
            return False
        L = self.engine.layers[il]
        _, state = self.engine.layer_state(il)
        slots = [L.slot_of.get(int(e), -1) for e in experts.tolist()]
        m = sum(1 for s in slots if s < 0)
        f = sum(1 for s in slots if s >= 0 and state[s] != SLOT_READY)
        return table[0][m * (k + 1) + f] >= 0

    def _stock_layer(self, il: int, experts: np.ndarray, pairs: int, n_tokens: int) -> None:
        """A layer as stock llama.cpp computes it: experts resident on the device (an ncmoe GPU
        layer), or in host memory, where ggml's scheduler computes a ubatch of at least
        ``op_offload_min_batch`` tokens on the device after copying up the experts it uses
        (ggml-backend.cpp ggml_backend_sched_compute_splits: only used experts are copied; at
        ``stock_gbps``: pinned memory's rate, or pageable memory's for mmap'd weights), and a
        smaller one on the CPU. mmap'd experts the page cache lacks are faulted in first."""
        sh, p = self.shape, self.profile
        if il not in self.stock_host:
            self.hits += len(experts)
            self.t += sum(self._node(experts, pairs, j) for j in range(len(sh.proj_bytes)))
            return
        self.misses += len(experts)
        faults = self.disk.faults(il, experts)
        if faults:  # the computing (or copying) thread waits for each read
            self.t += faults
            self.stall += faults
            self.lay["stall"][il] += faults
        if 0 < p.op_offload_min_batch <= n_tokens:
            copy = 0.0
            for j, nb in enumerate(sh.proj_bytes):
                nbytes = len(experts) * nb
                self.engine.stats["h2d_bytes"] += nbytes
                if self.n_devices > 1:  # over the link of the device that owns the layer
                    assert self.cfg.layer_device is not None
                    self.engine.stats[f"h2d_bytes_dev{self.cfg.layer_device[il]}"] += nbytes
                copy += p.chunk_latency_s + nbytes / (self.stock_gbps * 1e9)
                self.t += self._node(experts, pairs, j)
            # the copies precede each projection's matmul on the same stream: loading time on
            # the critical path
            self.t += copy
            self.stall += copy
            self.lay["stall"][il] += copy
        else:
            host = self._host_layer(experts, pairs)
            self.t += host
            self.cpu_s += host
        self.engine.advance_to(self.t)

    def _host_layer(self, experts: Sequence[int], pairs: int) -> float:
        sh = self.shape
        t = 0.0
        for p in range(len(sh.proj_bytes)):  # one projection after the other
            t += self._host(len(experts) * sh.proj_bytes[p], pairs * sh.proj_flops, self.t + t)
        return t

    def _wait(self, il: int, cond: Callable[[], bool], experts: Sequence[int] = ()) -> None:
        """The critical path waits for ``cond`` (copies of ``experts``: a wait for one still on
        disk counts as the disk tier's too)."""
        if cond():
            return
        tier = self.disk.tier
        on_disk = tier is not None and any(not tier.present(il, e) for e in experts)
        t = self.engine.wait_until(cond)
        if t > self.t:
            self.stall += t - self.t
            self.lay["stall"][il] += t - self.t
            if on_disk:
                self.disk.waited(t - self.t)
            self.t = t

    def _slot_compute(self, il: int, rows_of: dict[int, int], n_tokens: int = 1) -> None:
        """Compute layer ``il``'s schedule (``rows_of``: token rows routed to each expert) for
        a ubatch of ``n_tokens`` rows."""
        eng = self.engine
        L = eng.layers[il]
        n = L.n_dev
        on_host = L.sch_e[n:]
        host_rows = sum(rows_of[e] for e in on_host)
        sh = self.shape
        tier = self.disk.tier if on_host else None  # host entries read from the file first
        # as fc_node_hook: a short ubatch whose experts all have slots of the layer waits on the
        # host for each projection's copies (the nodes before it running), then computes it as
        # one product, with no expert group
        waits = self.cfg.hot_path == "remap" and n_tokens < DEVICE_MIN_TOKENS and n > 0 and \
            not on_host and not L.streams and all(s < L.n_slots for s in L.sch_s[:n])
        if self.cfg.hot_path == "remap" and on_host and tier is None and not L.streams and \
                not self._little and all(s < L.n_slots for s in L.sch_s[:n]):
            # as fc_whole_start: the CPU computes the host entries whole (every projection, one
            # hand-off) while each projection is one product over the slots, the host entries'
            # rows reading spare slots (their bytes read too); the rows are written at the end
            host_end = self.t + self._host_layer(on_host, host_rows)
            for p in range(L.n_proj):
                self._wait(il, lambda p=p: eng.all_ready_proj(il, p), L.sch_e[:n])
                self.t += self._node(L.sch_e, sum(rows_of[e] for e in L.sch_e), p)
                eng.advance_to(self.t)
                eng.consume(il, range(n), p)
            self.cpu_s += max(host_end - self.t, 0.0)
            self.t = max(self.t, host_end) + self._merge.merge_s(host_rows)
            eng.advance_to(self.t)
            return
        if not self.cfg.features.reorder or not self.spec.proactive:
            # as the C side without reordering: wait for every slot, then each projection once
            self._wait(il, lambda: eng.all_ready(il), L.sch_e[:n])
            if tier is not None:
                for batch in self.disk.batches(il, on_host):
                    self.disk.take(il, batch)
                    self._read_wait(il, self.disk.ready_time(il, batch))
                    self.disk.give_back(il, batch)
            for p in range(L.n_proj):
                dev = self._node(L.sch_e[:n], sum(rows_of[e] for e in L.sch_e[:n]), p)
                if on_host:  # computed meanwhile on the CPU, then written into the result
                    host = self._host(len(on_host) * sh.proj_bytes[p], host_rows * sh.proj_flops)
                    self.cpu_s += max(host - dev, 0.0)
                    dev = max(dev, host) + self._merge.merge_proj_s(host_rows)
                self.t += dev
            eng.advance_to(self.t)
            for p in range(L.n_proj):
                eng.consume(il, range(n), p)
            return
        for p in range(L.n_proj):
            start = self.t
            if tier is not None:
                batches = self.disk.batches(il, on_host)
                self.disk.take(il, batches[0])
            else:
                host_end = self.t + self._host(len(on_host) * sh.proj_bytes[p],
                                               host_rows * sh.proj_flops) if on_host else self.t
            staged = any(s >= L.n_slots for s in L.sch_s[:n])
            if waits:
                self._wait(il, lambda p=p: eng.all_ready_proj(il, p), L.sch_e[:n])
            if n and not L.streams and not staged and not on_host and \
                    eng.all_ready_proj(il, p):
                # every slot entry in place: the node runs as rewritten, no gathered group (as
                # fc_node_hook). A split projection never does: C computes its device entries as
                # expert groups (fc_grouped, fc_slot_compute), the CPU its host entries meanwhile
                dev = L.sch_e[:n]
                self.t += self._node(dev, sum(rows_of[e] for e in dev), p)
                eng.advance_to(self.t)
                eng.consume(il, range(n), p)
                continue
            i = 0
            while i < n:
                self._wait(il, lambda i=i, p=p: eng.entry_ready(il, i, p), L.sch_e[i:i + 1])
                j = i + 1
                kind = L.sch_s[i] >= L.n_slots  # a group reads the slots or the stage slots
                while j < n and eng.entry_ready(il, j, p) and (L.sch_s[j] >= L.n_slots) == kind:
                    j += 1
                group = L.sch_e[i:j]
                self.t += self._node(group, sum(rows_of[e] for e in group), p) + \
                    self.profile.group_s
                self.runtime_s += self.profile.group_s
                eng.advance_to(self.t)
                eng.consume(il, range(i, j), p)
                i = j
            if on_host:
                if tier is not None:
                    host_end, last = self.disk.host_entries(il, p, batches, rows_of, start)
                    self._read_wait(il, min(last, host_end))
                self.cpu_s += max(host_end - self.t, 0.0)
                self.t = max(self.t, host_end) + self._merge.merge_proj_s(host_rows)
                eng.advance_to(self.t)

    def _read_wait(self, il: int, ready: float) -> None:
        """The critical path waits until ``ready`` for reads from the file."""
        if ready > self.t:
            self.disk.waited(ready - self.t)
            self.stall += ready - self.t
            self.lay["stall"][il] += ready - self.t
            self.t = ready

    def _forecast(self, il: int, ids: np.ndarray, req: Request, rows: np.ndarray) -> None:
        assert self.forecaster is not None and isinstance(self.policy, ProMoEPolicy)
        hidden = None
        if self.forecaster.needs_hidden and req.gate_input is not None:
            hidden = np.asarray(req.gate_input[rows, il], dtype=np.float32)
        toks = None if req.token_ids is None else np.asarray(req.token_ids[rows])
        policy, eng = self.policy, self.engine
        pass_id = eng.epoch
        t = self.t
        for target, experts in self.forecaster.on_gate(il, ids, hidden, toks):
            t += self.profile.predictor_s
            # accuracy is of the experts copied ahead, not of infinity's whole ranking
            copied = experts[:policy.prefetch_n] if isinstance(policy, InfinityPolicy) else experts
            self._pred[target] = (pass_id, copied)
            eng.at(t, lambda target=target, experts=experts:
                   policy.prefetch(target, experts.tolist(), pass_id, eng))
        self.disk.forecast(il, ids, hidden, toks, t)  # on the same thread, after these

    def _account_prediction(self, il: int, routed: np.ndarray) -> None:
        """ACCURACY, FETCHRATE and GOODPRED (ProMoE §4.1) of the prediction made for ``il``."""
        got = self._pred.pop(il, None)
        if got is None or not isinstance(self.policy, ProMoEPolicy):
            return
        _, predicted = got
        expert_of, state = self.engine.layer_state(il)
        ready = {int(e) for e, s in zip(expert_of.tolist(), state.tolist(), strict=True)
                 if s == SLOT_READY}
        routed_set = set(routed.tolist())
        for e in predicted.tolist():
            self.lay["predicted"][il] += 1
            self.lay["correct"][il] += e in routed_set
            self.lay["in_time"][il] += e in ready
            self.lay["good"][il] += e in routed_set and e in ready

    def result(self, prefill: list[float], decode: list[float], n_prefill: int) -> SimResult:
        eng = self.engine
        per_layer = []
        for il in self.layers:
            p = self.lay["predicted"][il]
            per_layer.append({
                "layer": il, "stall_s": float(self.lay["stall"][il]),
                "accuracy": float(self.lay["correct"][il] / p) if p else None,
                "fetchrate": float(self.lay["in_time"][il] / p) if p else None,
                "goodpred": float(self.lay["good"][il] / p) if p else None,
            })
        n_req = max(len(prefill), 1)
        extra = {k: v for k, v in eng.stats.items() if k != "h2d_bytes"}
        # the floors of this run's misses (``_ubatch``)
        extra["floor_ttft_s"] = float(np.mean(self.floor_prefill)) if self.floor_prefill else 0.0
        extra["bus_floor_ttft_s"] = float(np.mean(self.bus_floor_prefill)) \
            if self.bus_floor_prefill else 0.0
        extra["floor_tpot_s"] = float(np.mean(self.floor_decode)) if self.floor_decode else 0.0
        extra["layers_simulated"] = len(self.layers)
        extra["stage_slots"] = self.n_stage
        if self.cfg.little_k:
            extra.update(little_passes=self.little_passes, big_passes=self.big_passes)
        if self.cfg.spec_draft:
            if self.spec_cutoffs:
                extra["spec_cutoff_mean"] = float(np.mean(self.spec_cutoffs))
            extra.update(spec_steps=self.spec_steps, spec_accepted=self.spec_accepted,
                         tokens_per_step=(self.spec_accepted + self.spec_steps) /
                         max(self.spec_steps, 1))
        if self.n_devices > 1:
            extra.update(devices=self.n_devices, device_hops=self.hops)
        extra["decode_gate_s"] = self.fast
        extra["decode_gates_in_c"] = self.decode_gates
        extra["quiet_layers"] = self.quiet
        extra["banked_layers"] = self.banked
        extra["bank_bytes"] = int(self.bank_bytes)
        if isinstance(self.policy, ProMoEPolicy):
            extra.update(prefetch_loads=self.policy.prefetch_loads,
                         stale_predictions=self.policy.stale_predictions)
        extra.update(self.disk.extra())
        return SimResult(
            ttft_s=sum(prefill) / n_req, tpot_s=float(np.mean(decode)) if decode else 0.0,
            prefill_s=sum(prefill), decode_s=float(sum(decode)), n_prefill_tokens=n_prefill,
            n_decode_tokens=len(decode), hits=self.hits, misses=self.misses,
            host_layers=self.host_layers, h2d_bytes=int(eng.stats["h2d_bytes"]),
            stall_s=self.stall, hook_s=self.hook, extra=extra, per_layer=per_layer,
            **self.disk.result_fields())


def simulate(requests: Sequence[Request], shape: ModelShape, profile: Profile, cfg: SimConfig,
             predictor: Predictor | None = None, warmup: Sequence[Request] = ()) -> SimResult:
    """Replay ``requests`` (in order, one at a time) and summarise; ``warmup`` requests are
    replayed first and not counted (caches then start as a running server's would)."""
    if not requests:
        raise ValueError("no requests to simulate")
    layers = logged_layers(list(warmup) + list(requests), shape.layers)
    sim = Simulator(shape, profile, cfg, layers, predictor)
    for req in warmup:
        sim.run_request(req)
    if warmup:
        sim.reset_counters()
    prefill, decode = [], []
    n_prefill = 0
    for req in requests:
        p, d = sim.run_request(req)
        if req.phase is not None and (req.phase == 0).any():
            prefill.append(p)
            n_prefill += int((req.phase == 0).sum())
        decode.extend(d)
    return sim.result(prefill, decode, n_prefill)

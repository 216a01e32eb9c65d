"""The simulator's side of the disk tier: what a replay does differently when experts live in
the model file (``SimConfig.host_slots`` below the experts a layer has).

forecache's placements (an expert cache) get a ``HostTier`` under their copy engine: host
computes read their experts first, in batches of at most half the host slots, experts already
held first (as the C cache's ``fc_host_rows``), and with ``disk_window`` the predictor names the
experts of the layer ``window + disk_window`` ahead, read into host slots without a copy.
llama.cpp's ``ncmoe-mmap`` gets a ``PageCache``: its host experts are computed (or copied up)
from pages the kernel faults in when they are not cached. Stock runs that read every host
expert into memory (``ncmoe``, ``offload``: --no-mmap) cannot load such a model.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from forecache.cache.forecast import Forecaster
from forecache.predictor.base import Predictor
from forecache.sim.hosttier import DISK_PREFETCH, HostTier, PageCache, fault_s

if TYPE_CHECKING:
    from forecache.sim.simulate import Simulator


class DiskSide:
    """The disk tier of one simulated run: the host tier or the page cache, the disk window's
    forecaster, and what waiting on reads cost the critical path."""

    def __init__(self, sim: Simulator, predictor: Predictor | None) -> None:
        cfg, shape, spec = sim.cfg, sim.shape, sim.spec
        self.sim = sim
        self.tier: HostTier | None = None
        self.pages: PageCache | None = None
        self.forecaster: Forecaster | None = None
        self.stall_s = 0.0  # critical-path seconds waiting on reads
        self.decode_stall_s = 0.0  # of those, during decode tokens
        self.initial_reads = 0  # reads the slots' first fill made, before the replay
        self.fault_reads = self.fault_bytes = 0  # page-cache read-ahead windows faulted in
        self.decode_fault_reads = self.decode_fault_bytes = 0
        self.decoding = False
        n_host = cfg.host_slots
        if n_host is None or n_host >= shape.experts:
            return  # every expert fits in host memory: no disk tier (as ``size_disk_tier``)
        if n_host < 1:
            raise ValueError(f"{n_host} host slots a layer: the disk tier needs at least one")
        room = n_host * len(sim.layers)  # experts host memory holds
        if spec.cached:
            self.tier = sim.engine.attach_disk([n_host if il in sim.layers else 0
                                                for il in range(shape.layers)], cfg.host_evict,
                                               cfg.host_exclusive, cfg.host_read_ahead,
                                               cfg.disk_ordered)
            f = cfg.features
            if cfg.disk_window > 0 and spec.proactive and f.prefetch and predictor is not None:
                self.forecaster = Forecaster(copy.deepcopy(predictor),
                                             cfg.window + cfg.disk_window, sim.layers,
                                             [n_host] * shape.layers)
            return
        held = len(sim.stock_host) * shape.experts
        if held <= room:
            return
        if not spec.mmap:
            raise ValueError(f"{cfg.policy} reads its {held} host experts into memory "
                             f"(--no-mmap), which holds {room}: it cannot load this model")
        if cfg.fault_qd < 1:
            raise ValueError(f"fault_qd must be at least 1, not {cfg.fault_qd}")
        if sim.profile.disk is None:
            raise ValueError(f"profile {sim.profile.name} has no disk section: page faults "
                             "need its rate and latency")
        self.pages = PageCache(room)

    def waited(self, seconds: float) -> None:
        """The critical path waited ``seconds`` for reads."""
        self.stall_s += seconds
        if self.decoding:
            self.decode_stall_s += seconds

    @property
    def active(self) -> bool:
        return self.tier is not None or self.pages is not None

    def begin_request(self) -> None:
        """A request starts."""
        if self.tier is not None:
            self.tier.begin_request()

    def set_decoding(self, on: bool) -> None:
        """Reads from now on count as a decode token's (True) or a prompt's."""
        self.decoding = on
        if self.tier is not None:
            self.tier.decoding = on

    def reset_counters(self) -> None:
        """Forget the reads, uses and waits counted so far (a warm-up's)."""
        self.stall_s = self.decode_stall_s = 0.0
        self.fault_reads = self.fault_bytes = 0
        self.decode_fault_reads = self.decode_fault_bytes = 0
        if self.tier is not None:
            self.tier.stats = type(self.tier.stats)()
        if self.pages is not None:
            self.pages.hits = self.pages.misses = 0

    def after_initial_loads(self) -> None:
        """The slots' first fill read its experts before the replay: not counted."""
        if self.tier is not None:
            self.initial_reads = self.tier.stats.reads
            self.tier.stats = type(self.tier.stats)()

    # -- llama.cpp's mmap'd host experts --------------------------------------------------------
    def faults(self, il: int, experts: np.ndarray) -> float:
        """Seconds the page faults of ``experts`` of host layer ``il`` take, synchronously,
        before they are computed or copied up (0 when all are cached)."""
        if self.pages is None:
            return 0.0
        missed = self.pages.access(il, experts.tolist())
        if not missed:
            return 0.0
        sim = self.sim
        assert sim.profile.disk is not None
        one, n = fault_s(sim.shape.proj_bytes, sim.profile.disk, sim.cfg.fault_qd)
        nbytes = len(missed) * sim.shape.expert_bytes
        self.fault_reads += n * len(missed)
        self.fault_bytes += nbytes
        if self.decoding:
            self.decode_fault_reads += n * len(missed)
            self.decode_fault_bytes += nbytes
        t = one * len(missed)
        self.waited(t)
        return t

    # -- forecache's host tier ------------------------------------------------------------------
    def batches(self, il: int, experts: Sequence[int]) -> list[list[int]]:
        """``experts`` in the batches a host compute reads and computes them in: at most half
        the host slots each, experts already read first."""
        assert self.tier is not None
        cap = max(1, self.tier.layers[il].n_host // 2)
        held = [e for e in experts if self.tier.present(il, e)]
        rest = [e for e in experts if not self.tier.present(il, e)]
        order = held + rest
        return [order[i:i + cap] for i in range(0, len(order), cap)]

    def take(self, il: int, batch: Sequence[int]) -> None:
        """A host compute needs ``batch``: each a use, and read first when missing."""
        assert self.tier is not None
        for e in batch:
            self.tier.compute(il, e, +1)
            self.tier.use(il, e, 0)

    def ready_time(self, il: int, batch: Sequence[int]) -> float:
        """When every expert of ``batch`` is read: at once if they are (their reads' ends),
        else after running the engine until they are."""
        tier, eng = self.tier, self.sim.engine
        assert tier is not None
        if all(tier.present(il, e) for e in batch):
            return max((tier.ready_at.get((il, e), -np.inf) for e in batch), default=-np.inf)
        return eng.wait_until(lambda: all(tier.present(il, e) for e in batch))

    def give_back(self, il: int, batch: Sequence[int]) -> None:
        """A host compute of ``batch`` ended."""
        assert self.tier is not None
        for e in batch:
            self.tier.touch(il, e)
            self.tier.compute(il, e, -1)

    def host_layer(self, il: int, experts: np.ndarray, rows_of: dict[int, int]) -> None:
        """Layer ``il`` computed on the CPU (the policy's whole-layer choice): projection by
        projection, batch by batch, each waiting for its reads on the critical path."""
        sim, sh = self.sim, self.sim.shape
        for p in range(len(sh.proj_bytes)):
            for batch in self.batches(il, experts.tolist()):
                self.take(il, batch)
                ready = self.ready_time(il, batch)
                if ready > sim.t:
                    self.waited(ready - sim.t)
                    sim.stall += ready - sim.t
                    sim.lay["stall"][il] += ready - sim.t
                    sim.t = ready
                t = sim._host(len(batch) * sh.proj_bytes[p],
                              sum(rows_of[e] for e in batch) * sh.proj_flops)
                sim.t += t
                sim.cpu_s += t
                sim.engine.advance_to(sim.t)
                self.give_back(il, batch)

    def host_entries(self, il: int, p: int, batches: list[list[int]], rows_of: dict[int, int],
                     start: float) -> tuple[float, float]:
        """Projection ``p`` of a split layer's host entries, computed beside the device from
        ``start`` (the first batch was taken then): (when the CPU is done, when its last read
        ended)."""
        sim, sh = self.sim, self.sim.shape
        end = last = start
        for b, batch in enumerate(batches):
            if b:
                self.take(il, batch)
            ready = self.ready_time(il, batch)
            last = max(last, ready)
            begin = max(end, ready)
            end = begin + sim._host(len(batch) * sh.proj_bytes[p],
                                    sum(rows_of[e] for e in batch) * sh.proj_flops, begin)
            self.give_back(il, batch)
        return end, last

    # -- the disk window ------------------------------------------------------------------------
    def forecast(self, il: int, ids: np.ndarray, hidden: np.ndarray | None,
                 toks: np.ndarray | None, t: float) -> None:
        """Predict the layer ``window + disk_window`` ahead on the predictor thread (after the
        copy predictions, from ``t``) and read its predicted experts that have neither a
        device nor a host slot, at the disk window's priority."""
        if self.forecaster is None:
            return
        sim = self.sim
        eng, pass_id = sim.engine, sim.engine.epoch
        for target, experts in self.forecaster.on_gate(il, ids, hidden, toks):
            t += sim.profile.predictor_s
            eng.at(t, lambda target=target, experts=experts: self._prefetch(
                target, experts.tolist(), pass_id))

    def _prefetch(self, layer: int, experts: list[int], pass_id: int) -> None:
        eng, tier = self.sim.engine, self.tier
        assert tier is not None
        current, routed = eng.passes(layer)
        if pass_id != current or routed == pass_id:
            return  # the layer was routed already: too late
        on_device = eng.layers[layer].slot_of
        tier.prefetch(layer, [e for e in experts if e not in on_device], DISK_PREFETCH)

    # -- the result -------------------------------------------------------------------------------
    def result_fields(self) -> dict:
        """The SimResult fields of the disk tier."""
        if self.tier is not None:
            s = self.tier.stats
            return {"disk_reads": s.reads, "disk_bytes": s.bytes,
                    "decode_disk_reads": s.decode_reads, "decode_disk_bytes": s.decode_bytes,
                    "disk_stall_s": self.stall_s, "host_hits": s.hits, "host_misses": s.misses}
        if self.pages is not None:
            return {"disk_reads": self.fault_reads, "disk_bytes": self.fault_bytes,
                    "decode_disk_reads": self.decode_fault_reads,
                    "decode_disk_bytes": self.decode_fault_bytes, "disk_stall_s": self.stall_s,
                    "host_hits": self.pages.hits, "host_misses": self.pages.misses}
        return {}

    def extra(self) -> dict:
        """What else the run's JSON says about the disk tier."""
        if self.tier is not None:
            s = self.tier.stats
            return {"decode_disk_stall_s": self.decode_stall_s,
                    "host_slots": self.sim.cfg.host_slots,
                    "disk_window": self.sim.cfg.disk_window, "host_evict": self.tier.evict,
                    "host_evictions": s.evictions, "host_displaced": s.displaced,
                    "host_exclusive": self.sim.cfg.host_exclusive, "host_demoted": s.demoted,
                    "host_read_ahead": self.sim.cfg.host_read_ahead,
                    "initial_disk_reads": self.initial_reads}
        if self.pages is not None:
            return {"decode_disk_stall_s": self.decode_stall_s,
                    "page_cache_experts": self.pages.capacity, "fault_qd": self.sim.cfg.fault_qd}
        return {}

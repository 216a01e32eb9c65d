"""The disk tier's figures the runtime is held to: host slots for a host budget, and the disk
reads a replay predicts (issue 38: the CPU build's measured reads per token within 15% of
these)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from forecache.cache.cost import Profile
from forecache.cache.disk import HOST_INPUT_TENSORS, even_host_slots
from forecache.gguf.specs import get_spec, tensor_plan
from forecache.predictor.base import Predictor
from forecache.sim.shapes import ModelShape, shape_of
from forecache.sim.simulate import SimConfig, SimResult, simulate
from forecache.trace.format import Request


def host_weight_bytes(name: str, qtype: str = "q4_k") -> int:
    """Bytes of a models.yaml model's non-expert weights that llama.cpp keeps on the host on a
    GPU build: the token embeddings (a shape-only trace model's: the size of its head, whose
    matrix has the same dimensions)."""
    try:
        spec = get_spec(name)
    except ValueError:
        return shape_of(name, qtype).head_bytes
    return sum(t.nbytes for t in tensor_plan(spec, qtype) if t.name in HOST_INPUT_TENSORS)


def host_slots_for(shape: ModelShape, host_budget: int, host_weights: int = 0) -> int:
    """Host slots each MoE layer gets from ``host_budget`` bytes of host memory, of which the
    model's host-resident weights take ``host_weights`` (``cache.disk.size_disk_tier``'s split):
    ``shape.experts`` when every expert fits (no disk tier)."""
    return even_host_slots(shape.experts, shape.layers, shape.expert_bytes,
                           host_budget - host_weights)


@dataclass(frozen=True)
class DiskReads:
    """What a replay read from the model file: whole experts (``reads``) over all its tokens,
    and during its decode tokens; the host tier's uses that found their expert read."""

    reads: int
    bytes: int
    decode_reads: int
    initial_reads: int  # the device slots' first fill, before the first token (not in reads)
    prefill_tokens: int
    decode_tokens: int
    host_hit_rate: float | None

    @property
    def per_token(self) -> float:
        """Reads per token, prompt and decode tokens together (what a run's counters give
        divided by the tokens it computed)."""
        n = self.prefill_tokens + self.decode_tokens
        return self.reads / n if n else 0.0

    @property
    def per_decode_token(self) -> float:
        """Reads during decode per decoded token."""
        return self.decode_reads / self.decode_tokens if self.decode_tokens else 0.0


def predict_disk_reads(requests: Sequence[Request], shape: ModelShape, host_slots: int,
                       n_slots: int | list[int], *, policy: str = "lru",
                       profile: Profile | str = "rtx4090", window: int = 2,
                       disk_window: int = 0, predictor: Predictor | None = None,
                       n_ubatch: int = 512, stage_slots: int | None = 0) -> DiskReads:
    """The disk reads a run of ``requests`` (their routing, prompt rows then decode rows, one
    request after the other in one context) makes with ``host_slots`` host slots a MoE layer
    (``HostSlots.n_host``) and ``n_slots`` device slots a layer, under ``policy``: the simulator's
    replay of the C cache's disk tier (empty host slots at the start; a copy queued or a host
    compute batch that lacks its expert reads it; the reads of the device slots' first fill,
    before the first token, are apart in ``initial_reads``). With a reactive policy the count
    follows from the routing alone; promoe's depends on timing too (``profile``, which needs a
    disk section, and ``predictor`` with ``window`` and ``disk_window``). Prompts go through in
    ubatches of ``n_ubatch`` rows; ``stage_slots``: promoe's stage slots (0, as on a CPU-only
    build; None: as on a GPU)."""
    prof = Profile.load(profile) if isinstance(profile, str) else profile
    if prof.disk is None:
        raise ValueError(f"profile {prof.name} has no disk section")
    cfg = SimConfig(policy, n_slots, window=window, n_ubatch=n_ubatch, host_slots=host_slots,
                    disk_window=disk_window, stage_slots=stage_slots)
    r: SimResult = simulate(requests, shape, prof, cfg, predictor)
    return DiskReads(reads=r.disk_reads, bytes=r.disk_bytes, decode_reads=r.decode_disk_reads,
                     initial_reads=int(r.extra.get("initial_disk_reads", 0)),
                     prefill_tokens=r.n_prefill_tokens, decode_tokens=r.n_decode_tokens,
                     host_hit_rate=r.host_hit_rate)

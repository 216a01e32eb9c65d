"""The disk tier's plan: how many experts of each layer a host memory budget keeps in host slots,
the rest read from the model file as they are needed (``forecache_cache_set_disk``)."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from forecache.cache.budget import format_size
from forecache.diskprobe import DiskRate, measure_reads
from forecache.errors import setting
from forecache.gguf.header import ModelFile
from forecache.native import api

# reads in flight: an NVMe drive reaches its rate at a queue depth of about 8
DEFAULT_READERS = 8
# on a GPU build llama.cpp keeps the token embeddings on the host; every other non-expert weight
# goes to the device
HOST_INPUT_TENSORS = ("token_embd.weight", "per_layer_token_embd.weight")


@dataclass(frozen=True)
class DiskTier:
    """What the C cache's disk tier is given: the model's files (a split model's shards in
    order), host slots per layer, reads in flight."""

    paths: tuple[Path, ...]
    n_host: list[int]
    n_readers: int = DEFAULT_READERS


@dataclass(frozen=True)
class HostSlots:
    """Host slots per layer (0 for layers without experts) and what they hold."""

    n_host: list[int]
    host_bytes: int  # the model's other weights kept on the host
    host_expert_bytes: int  # the host slots
    disk_expert_bytes: int  # routed experts that live only in the file
    expert_bytes: int  # one expert, all projections (the largest layer's)

    @property
    def experts_on_disk(self) -> float:
        """Share of the routed experts' bytes beyond the host slots."""
        total = self.host_expert_bytes + self.disk_expert_bytes
        return self.disk_expert_bytes / total if total else 0.0

    def describe(self) -> str:
        """One line for the user: where the experts live."""
        per = sorted(set(n for n in self.n_host if n))
        return (f"disk tier: {format_size(self.host_expert_bytes)} of host slots "
                f"({'/'.join(map(str, per))} experts a layer), "
                f"{format_size(self.disk_expert_bytes)} of experts read from the file "
                f"({self.experts_on_disk:.0%})")


def host_weight_bytes(model: ModelFile, *, on_gpu: bool) -> int:
    """Bytes of the model's non-expert weights that llama.cpp keeps in host memory: all of them
    on a CPU-only build, the token embeddings on a GPU."""
    if not on_gpu:
        return model.non_expert_bytes()
    return sum(t.nbytes for t in model.tensors if t.name in HOST_INPUT_TENSORS)


def even_host_slots(n_expert: int, n_layers: int, expert_bytes: int, room: int) -> int:
    """Host slots each of ``n_layers`` MoE layers gets from ``room`` bytes, split evenly (the
    runtime's rule, which the simulator's disk tier follows)."""
    return max(0, min(n_expert, room // max(expert_bytes * n_layers, 1)))


def size_disk_tier(model: ModelFile, host_budget: int, *, on_gpu: bool,
                   slot_bytes: int = 0) -> HostSlots | None:
    """Host slots per MoE layer for ``host_budget`` bytes of host memory: the budget less the
    non-expert weights kept on the host (and ``slot_bytes`` of device slots, which are host
    memory on a CPU-only build), split evenly over the layers' experts. None when every expert
    fits: the model then loads as usual. Raises ``ValueError`` with the fix when the budget
    cannot hold the non-expert weights and each layer's top-k experts."""
    layers = model.moe_layers()
    per_expert = max(model.layer_expert_bytes())
    top_k = max(model.n_expert_used, 1)
    fixed = host_weight_bytes(model, on_gpu=on_gpu) + slot_bytes
    need = fixed + len(layers) * top_k * per_expert
    if host_budget < need:
        raise ValueError(
            f"{setting('host_budget')} {format_size(host_budget)} is below the "
            f"{format_size(need)} the host needs: {format_size(fixed)} of non-expert weights"
            f"{' and expert slots' if slot_bytes else ''} and {top_k} experts of each of "
            f"{len(layers)} layers; raise it to at least {format_size(need)}")
    if host_budget - fixed >= model.total_expert_bytes():
        return None
    n = even_host_slots(model.n_expert, len(layers), per_expert, host_budget - fixed)
    n_host = [0] * model.n_layer
    for il in layers:
        n_host[il] = n
    held = n * per_expert * len(layers)
    return HostSlots(n_host, fixed, held, model.total_expert_bytes() - held, per_expert)


# what the start-up probe of a model file's experts reads: enough to reach the disk's rate, little
# enough to cost a fraction of a second
PROBE_BYTES = 64 << 20
PROBE_EXPERTS = (2, 64)


def probe_ranges(model: ModelFile) -> list[tuple[Path, int, int]]:
    """(file, offset, bytes) of what the start-up probe reads: whole experts (one range a
    projection), about PROBE_BYTES of them, scattered over the MoE layers as routing reads them
    (over a split model's shards as its tensors lie)."""
    layers = model.moe_layers()
    lo, hi = PROBE_EXPERTS
    n = max(lo, min(hi, PROBE_BYTES // max(max(model.layer_expert_bytes()), 1)))
    ranges = []
    for k in range(n):
        il = layers[k % len(layers)]
        e = (k * 7919 + il) % model.n_expert
        for t in model.expert_tensors(il):
            size = t.nbytes // model.n_expert
            path, start = model.locate(t)
            ranges.append((path, start + e * size, size))
    return ranges


def probe_expert_reads(model: ModelFile, depth: int) -> DiskRate:
    """The disk tier's read rate, measured at start on ``model``'s own experts (each
    projection one read, ``depth`` in flight; ``probe_ranges``)."""
    return measure_reads(probe_ranges(model), depth)


def readers_default() -> int:
    """Reads in flight: ``DEFAULT_READERS``, fewer on a machine with few cores."""
    return max(2, min(DEFAULT_READERS, 4 * (os.cpu_count() or 1)))


_LOADING = threading.Lock()  # the loader's switch is process-wide: one load at a time sets it


@contextmanager
def experts_left_on_disk(on: bool = True) -> Iterator[None]:
    """Models loaded inside leave their routed-expert tensors in the file (mapped, never read):
    the disk tier reads them. Does nothing when ``on`` is false."""
    if not on:
        yield
        return
    c_api = api()
    with _LOADING:
        c_api.set_disk_experts(True)
        try:
            yield
        finally:
            c_api.set_disk_experts(False)

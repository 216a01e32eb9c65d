"""Several devices: llama.cpp's layer split, and what each device's memory holds.

llama.cpp (``--split-mode layer``, its default) gives each device a contiguous range of layers in
proportion to a tensor split (``--tensor-split``; by default each device's free memory: even for
equal cards), the output layer counted as one more layer and so on the last device
(llama-model.cpp ``load_tensors``: layer ``il`` goes to the first device whose cumulative share
exceeds ``il / (n_layer + 1)``). A device holds its layers' non-expert weights, KV cache and
compute buffers; what is left of its memory holds experts: forecache's slots for its layers, or
under stock ``--n-cpu-moe N`` its layers' whole experts (the first N layers' experts stay in host
memory wherever their layers are).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from forecache.roofline.shape import ModelShape


def layer_devices(n_layers: int, split: Sequence[float]) -> list[int]:
    """The device of each of ``n_layers`` layers and then of the output layer (``n_layers + 1``
    entries) under tensor split ``split``, computed in float32 as llama.cpp computes it."""
    if not split or any(s < 0 for s in split) or sum(split) <= 0:
        raise ValueError(f"tensor split {list(split)}: give non-negative shares, some positive")
    points = np.cumsum(np.asarray(split, np.float32), dtype=np.float32)
    points = (points / points[-1]).astype(np.float32)
    act = np.float32(n_layers + 1)
    out = []
    for il in range(n_layers + 1):
        at = np.float32(il) / act
        # std::upper_bound: the first split point greater than the layer's position
        out.append(min(int(np.searchsorted(points, at, side="right")), len(split) - 1))
    return out


def split_of(counts: Sequence[int]) -> list[float]:
    """The tensor split that gives device ``d`` exactly ``counts[d]`` layers (the output layer
    on the last device)."""
    shares = [float(c) for c in counts]
    shares[-1] += 1.0
    return shares


def device_layers(devices: Sequence[int], n_devices: int) -> list[list[int]]:
    """The layers of each device (``devices``: each layer's, as ``layer_devices`` without the
    output's entry)."""
    out: list[list[int]] = [[] for _ in range(n_devices)]
    for il, d in enumerate(devices):
        out[d].append(il)
    return out


def fixed_bytes(shape: ModelShape, layers: Sequence[int], output: bool, reserve: int) -> int:
    """Device memory that is not experts: ``layers``' non-expert weights (the leading dense
    layers with the first layer), the output head on the output's device and ``reserve`` (the
    device's KV cache and compute buffers)."""
    lead = shape.lead_bytes if 0 in layers else 0
    return len(layers) * shape.layer_bytes + lead + (shape.head_bytes if output else 0) + reserve


def device_slots(shape: ModelShape, devices: Sequence[int], budgets: Sequence[int],
                 reserve: int) -> list[int]:
    """forecache's slots per model layer: each device's budget less what is not experts,
    spread evenly over its layers' slots (``devices``: ``layer_devices``' output, the output
    layer's device last)."""
    layers = device_layers(devices[:-1], len(budgets))
    slots = [0] * shape.layers
    for d, ls in enumerate(layers):
        if not ls:
            continue
        left = budgets[d] - fixed_bytes(shape, ls, devices[-1] == d, reserve)
        n = min(shape.experts, int(left // (shape.expert_bytes * len(ls))))
        if n < 1:
            raise ValueError(f"device {d}: {budgets[d] / 2**30:.1f} GiB leaves no expert slot for "
                             f"each of its {len(ls)} layers")
        for il in ls:
            slots[il] = n
    return slots


@dataclass(frozen=True)
class StockSplit:
    """Stock llama.cpp's best ``--n-cpu-moe N --tensor-split ...`` on the devices: the fewest
    host layers N for which some tensor split fits every device, and that split."""

    n_cpu_moe: int
    split: list[float]
    devices: list[int]  # each layer's device, then the output's (``layer_devices``)

    @property
    def layer_device(self) -> tuple[int, ...]:
        """Each model layer's device (``SimConfig.layer_device``)."""
        return tuple(self.devices[:-1])

    def n_slots(self, shape: ModelShape) -> list[int]:
        """Slots per layer as ``SimConfig`` takes them for ncmoe: a device layer's every expert,
        none for the first ``n_cpu_moe`` layers."""
        return [0 if il < self.n_cpu_moe else shape.experts for il in range(shape.layers)]


def stock_split(shape: ModelShape, budgets: Sequence[int], reserve: int) -> StockSplit:
    """``StockSplit`` for devices of ``budgets`` bytes: for each N from 0, llama.cpp's default
    split (by the devices' memory) if it fits, else the layers packed in order, each device
    taking as many as fit (which finds a contiguous split whenever one exists), the output
    head on the last device."""
    n_dev = len(budgets)
    L = shape.layers
    for n_cpu in range(L + 1):
        default = [float(b) for b in budgets]
        if _fits(shape, layer_devices(L, default), budgets, reserve, n_cpu):
            return StockSplit(n_cpu, default, layer_devices(L, default))
        counts = [0] * n_dev
        il = 0
        for d in range(n_dev):
            room = budgets[d] - reserve - (shape.head_bytes if d == n_dev - 1 else 0)
            while il < L:
                need = _layer_bytes(shape, il, n_cpu)
                if need > room:
                    break
                room -= need
                counts[d] += 1
                il += 1
        if il == L:
            split = split_of(counts)
            devices = layer_devices(L, split)
            assert device_layers(devices[:-1], n_dev) == _ranges(counts)
            return StockSplit(n_cpu, split, devices)
    raise ValueError(f"{len(budgets)} devices of {[b / 2**30 for b in budgets]} GiB do not hold "
                     "the model's non-expert weights")


def _layer_bytes(shape: ModelShape, il: int, n_cpu: int) -> int:
    """Device bytes of layer ``il`` under ``--n-cpu-moe n_cpu``."""
    experts = 0 if il < n_cpu else shape.experts * shape.expert_bytes
    return shape.layer_bytes + experts + (shape.lead_bytes if il == 0 else 0)


def _fits(shape: ModelShape, devices: Sequence[int], budgets: Sequence[int], reserve: int,
          n_cpu: int) -> bool:
    used = [reserve] * len(budgets)
    used[devices[-1]] += shape.head_bytes
    for il, d in enumerate(devices[:-1]):
        used[d] += _layer_bytes(shape, il, n_cpu)
    return all(u <= b for u, b in zip(used, budgets, strict=True))


def _ranges(counts: Sequence[int]) -> list[list[int]]:
    out, at = [], 0
    for c in counts:
        out.append(list(range(at, at + c)))
        at += c
    return out

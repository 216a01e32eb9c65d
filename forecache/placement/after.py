"""The placement finished once llama.cpp has loaded the model: where it put each layer decides
each device's slots and the link each layer's copies are priced by."""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from forecache.cache.budget import device_slots
from forecache.cache.cost import CostModel
from forecache.cache.disk import probe_expert_reads, readers_default
from forecache.cache.policies import Policy
from forecache.cache.prefetcher import stage_slots
from forecache.cache.runtime import ExpertCache
from forecache.diskprobe import DiskRate
from forecache.gguf.header import ModelFile
from forecache.native.ggml_devices import Device, devices, local_gpus
from forecache.native.libs import ModelLoadError, api
from forecache.placement.before import LoadPlan, Placement
from forecache.placement.build import build_cache


def llama_layer_devices(ctx: int, n_layer: int) -> list[int] | None:
    """The ggml device index of each layer's non-expert weights as llama.cpp put them, -1 for
    host memory (None if the C side cannot tell)."""
    arr = (ctypes.c_int32 * n_layer)()
    return list(arr) if api().layer_devices(ctx, arr, n_layer) == 0 else None


def slot_devices(ctx: int, model: ModelFile, placement: Placement) -> list[int] | None:
    """The ggml device index each layer's slots go on: the device llama.cpp put the layer on,
    or the cache's own for a layer in host memory (None if the C side cannot tell)."""
    got = llama_layer_devices(ctx, model.n_layer)
    return None if got is None else [d if d >= 0 else placement.device.index for d in got]


@dataclass
class Finished:
    """The placement as the load turned out, and the expert cache attached to it."""

    placement: Placement | None
    cache: ExpertCache | None = None
    # per model layer, the device whose link the split prices that layer's copies by (None: the
    # cache's own device for every layer)
    split_devices: list[Device | None] | None = None
    disk_rate: DiskRate | None = None  # the disk tier's reads, measured at start


def finish(ctx: int, model: ModelFile, plan: LoadPlan, *,
           profile: Callable[[], np.ndarray] | None = None,
           say: Callable[[str], None] | None = None) -> Finished:
    """Finish ``plan`` on the loaded context ``ctx``: the placement as the load turned out
    (``fit``), then a cached policy's expert cache on it, priced by the links and the disk it
    runs on. ``profile``: the routing counts a static policy pins from when none was given."""
    placement, cfg = fit(ctx, model, plan), plan.cache
    if placement is None or cfg is None or not cfg.spec.cached:
        return Finished(placement)
    if cfg.spec.needs_profile and cfg.profile is None and profile is not None:
        cfg.profile = profile()
    disk_rate = probe_disk(model, placement)
    devices_of = split_devices(ctx, model, placement, bool(plan.rpc))
    cache = build_cache(ctx, model, placement, cfg, devices_of, disk_rate, say=say)
    return Finished(placement, cache, devices_of, disk_rate)


def fit(ctx: int, model: ModelFile, plan: LoadPlan) -> Placement | None:
    """``plan``'s placement as the load turned out: ncmoe's host layers were fitted to the
    layer split predicted before the load (a load whose layers went elsewhere is refused), and
    a cached policy's slots with a budget per device are sized from where the layers are."""
    cfg, placement = plan.cache, plan.placement
    if plan.layer_dev is not None:
        got = llama_layer_devices(ctx, model.n_layer)
        if got != plan.layer_dev[:model.n_layer]:
            names = {d.index: d.name for d in devices()}
            where = [names.get(d, "CPU") for d in got or []] or ["devices it does not report"]
            raise ModelLoadError(f"llama.cpp put the layers on {', '.join(where)}, not where "
                                 "ncmoe's budget per device was fitted; give each device's "
                                 "share with tensor_split")
    if cfg is None or placement is None or cfg.device_budgets is None or not cfg.spec.cached:
        return placement
    layer_dev = slot_devices(ctx, model, placement)
    if layer_dev is None:
        raise ModelLoadError(f"cannot tell which device holds each of the {model.n_layer} "
                             "layers")
    names = {d.index: d.name for d in devices()}
    sizes = {"n_ctx": plan.n_ctx, "n_ubatch": plan.n_ubatch}
    slots = device_slots(model, cfg.device_budgets, layer_dev, names, **sizes)
    # held back on every device
    stage = stage_slots(model.n_expert, slots, given=cfg.stage_slots,
                        streams=cfg.spec.proactive and cfg.features.reorder)
    if stage:
        slots = device_slots(model, cfg.device_budgets, layer_dev, names, **sizes, held=stage)
    # a policy moving slots between layers (infinity) moves them within each device
    by_dev: dict[int, list[int]] = {}
    for il in model.moe_layers():
        by_dev.setdefault(layer_dev[il], []).append(il)
    slots = cfg.spec.policy.layer_slots(model, slots, list(by_dev.values()))
    return replace(placement, n_slots=slots, stage_slots=stage)


def split_devices(ctx: int, model: ModelFile, placement: Placement,
                  rpc: bool) -> list[Device | None] | None:
    """Per model layer, the device whose link the host/device split prices the layer's copies
    by: where llama.cpp put layers on other devices than the cache's own (``rpc`` servers,
    other GPUs), the device holding the layer's slots, each of which the split then prices by
    its own measured link; None where every layer's slots are on the cache's own device."""
    local = placement.device
    if not rpc and len(local_gpus()) < 2:
        return None
    layer_dev = slot_devices(ctx, model, placement)
    if layer_dev is None:
        return None
    moe = set(model.moe_layers())
    by_index = {dev.index: dev for dev in devices()}
    out = [by_index.get(d) if il in moe and placement.n_slots[il] > 0 else None
           for il, d in enumerate(layer_dev)]
    if all(d is None or d.index == local.index for d in out):
        return None
    return out


def priced_devices(policy: Policy | None, placement: Placement | None,
                   layer_devices: list[Device | None] | None) -> dict[str, dict[str, float]]:
    """Each device the host/device split prices, with what it prices now: its copy rate
    (``copy_gbps``) and its expert groups' measured over modelled compute time
    (``device_scale``; 1 where not measured); empty without a split."""
    if policy is None or policy.cost is None:
        return {}

    def row(c: CostModel) -> dict[str, float]:
        return {"copy_gbps": c.copy_gbps, "device_scale": c.dev_scale}

    if not layer_devices:
        return {placement.device.name if placement is not None else "device": row(policy.cost)}
    out: dict[str, dict[str, float]] = {}
    for il, dev in enumerate(layer_devices):
        cost = policy.cost_for(il)
        if dev is not None and cost is not None:
            out.setdefault(dev.name, row(cost))
    return out


def probe_disk(model: ModelFile, placement: Placement) -> DiskRate | None:
    """The file's read rate where a disk tier reads experts from it, for the split's costs."""
    if placement.disk is None:
        return None
    try:
        return probe_expert_reads(model, readers_default())
    except OSError as e:
        raise ModelLoadError(f"cannot read the experts of {model.path}: {e}; the disk tier "
                             "reads them from the file") from e

"""The cost models a proactive policy's host/device split starts from: the machine profile, this
machine's measured rates, or a short probe of the device's link."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from forecache.cache.cost import CostModel, ExpertShape, Profile
from forecache.cache.measured import measured_rates
from forecache.diskprobe import DiskRate
from forecache.errors import setting
from forecache.gguf.header import ModelFile
from forecache.native.ggml_devices import (
    CopyProbeError,
    Device,
    is_rpc,
    measure_copy,
)
from forecache.placement.options import CacheConfig

# the machine profile promoe's host/device split starts from until it has measured the rates:
# on a GPU, the one profile whose runtime costs were measured on a GPU run of forecache (an
# H200's: a split projection's hand-off to the CPU and back costs ~0.37 ms there, against the
# CPU build's 6 us in the 4090 profile, so a split plan with that profile splits far too often);
# the 4090 host's otherwise (a CPU build splits only with a machine named)
DEFAULT_MACHINE = "rtx4090"
DEFAULT_GPU_MACHINE = "h200-xeon"


def default_machine(device: Device | None) -> str:
    """The profile a split plans with on ``device`` when no machine is named."""
    return DEFAULT_GPU_MACHINE if device is not None and device.type == "gpu" else \
        DEFAULT_MACHINE


# the pinned copy that probes a GPU's host-to-device rate when a split starts without a measured
# one: long enough to reach the bus rate (tens of ms at most, once per load)
RATE_PROBE_BYTES = 64 << 20
RPC_PROBE_BYTES = 16 << 20
RATE_PROBE_ITERS = 3


def machines_for(machine: str | None, n_devices: int) -> list[str | None]:
    """``--machine`` for ``n_devices`` devices: one profile for each, or one per device (a
    comma list, in llama.cpp's order of the devices holding layers)."""
    names = [m.strip() for m in machine.split(",")] if machine else [None]
    if len(names) == 1:
        return names * n_devices
    if len(names) != n_devices or not all(names):
        raise ValueError(f"{setting('machine')} {machine}: {len(names)} profiles for "
                         f"{n_devices} device{'s' if n_devices != 1 else ''} holding slots; "
                         "give one profile, or one per device in llama.cpp's order")
    return names


def split_costs(model: ModelFile, cfg: CacheConfig, devices: Sequence[Device],
                disk_rate: DiskRate | None = None) -> dict[int, CostModel]:
    """A cost model per device of ``devices`` (ggml device index -> model), each
    ``split_cost``'s for that device: its own profile (``cfg.machine`` may name one per device)
    and its own measured or probed copy rate."""
    order = list({d.index: d for d in devices}.values())
    names = machines_for(cfg.machine, len(order))
    return {d.index: split_cost(model, replace(cfg, machine=m), d, disk_rate)
            for d, m in zip(order, names, strict=True)}


def split_cost(model: ModelFile, cfg: CacheConfig, device: Device | None,
               disk_rate: DiskRate | None = None) -> CostModel:
    """The cost model a proactive policy's host/device split starts from: ``cfg.machine``'s
    profile when one is named; else the device's default profile (``default_machine``) with this
    machine's rates where they are known: the expert copy rate and CPU compute time the last run
    of ``model`` on ``device`` measured (``cache.measured``), else the copy rate probed now (a
    GPU). The run corrects them as it measures (``CostModel.calibrate``). With a disk tier, its
    reads cost what ``disk_rate`` measured, unless the named profile gives its disk."""
    profile = Profile.load(machines_for(cfg.machine, 1)[0] or default_machine(device))
    cost = CostModel.from_profile(profile, ExpertShape.of(model))
    if disk_rate is not None and (cfg.machine is None or profile.disk is None):
        cost.disk_gbps, cost.disk_latency_s = disk_rate.gbps, disk_rate.latency_s
    # an RPC server computes on another machine, each expert group a network round trip: its
    # groups' measured time corrects the profile's device compute
    cost.calibrate_device = device is not None and is_rpc(device)
    if cfg.machine is not None or device is None:
        return cost
    copy_gbps, host_scale = measured_rates(model, device.name)
    cost.host_scale = host_scale
    if copy_gbps is not None and copy_gbps > 0:
        cost.copy_gbps, cost.copy_measured = copy_gbps, True  # kept again by this run's record
    elif device.type != "cpu":
        # a probe's rate is a starting point, not a measured expert copy rate to keep; an RPC
        # server's through the network, with a shorter probe
        nbytes = RPC_PROBE_BYTES if is_rpc(device) else RATE_PROBE_BYTES
        cost.copy_gbps = probe_copy_gbps(device, nbytes) or cost.copy_gbps
    return cost


def probe_copy_gbps(device: Device, nbytes: int = RATE_PROBE_BYTES) -> float | None:
    """``device``'s host-to-device rate from a short probe: from pinned memory where the device
    has it, else pageable (an RPC server's device: the network's rate); None if neither runs."""
    for pinned in (True, False):
        try:
            return measure_copy(device.index, nbytes, RATE_PROBE_ITERS, pinned=pinned).h2d_gbps
        except CopyProbeError:
            continue
    return None


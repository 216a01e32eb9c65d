"""From a policy and a budget to llama.cpp tensor placement and an attached expert cache."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from forecache.cache.budget import (
    BANK_SHARE_MAX,
    BudgetError,
    MemoryPlan,
    bank_size,
    device_host_layers,
    format_size,
    parse_budgets,
    parse_size,
    plan_memory,
    slots_for_fraction,
)
from forecache.cache.choice import PRIOR, Choice, DecodeShape, Evidence, choose_among, locality
from forecache.cache.cost import DEVICE_MIN_TOKENS, CostModel, ExpertShape, Profile
from forecache.cache.disk import DiskPlan, DiskTier, plan_disk, readers_default
from forecache.cache.forecast import Forecaster
from forecache.cache.measured import load_evidence, measured_rates
from forecache.cache.policies import HostOnlyPolicy, Policy, PolicyInputs
from forecache.cache.prefetcher import Features, Prefetcher, stage_slots
from forecache.cache.registry import PolicySpec, build_policy, policy_spec
from forecache.cache.runtime import DEFAULT_CHUNK_BYTES, ExpertCache, RouteCallback
from forecache.diskprobe import DiskRate
from forecache.errors import setting
from forecache.gguf.header import EXPERT_TENSOR_PATTERN, ModelFile
from forecache.native.cache_api import CHUNK_EXPERT
from forecache.native.ggml_devices import (
    CopyProbeError,
    Device,
    cache_device,
    host_buffer_type,
    is_rpc,
    local_gpus,
    measure_copy,
)
from forecache.predictor.base import Predictor

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
# layers ahead the EAM predictor forecasts: its matches are request-level, so distance costs
# little accuracy and gives the copies time
EAM_WINDOW = 2


@dataclass
class CacheConfig:
    """How a run places routed experts: a policy and how much device memory it may use.

    Exactly one of ``gpu_budget`` (bytes for everything on the device), ``device_budgets`` (the
    same for each device llama.cpp puts layers on, in device order; one: all of them together),
    ``cache_fraction`` (share of each layer's experts in slots) or ``slots_per_layer`` sizes the
    cache; ``offload`` needs none.
    """

    policy: str = "offload"
    gpu_budget: int | None = None
    cache_fraction: float | None = None
    slots_per_layer: int | None = None
    profile: np.ndarray | None = None  # static: routed counts [n_layer, n_expert]
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    on_route: RouteCallback | None = None  # sees every routing decision (see ExpertCache)
    features: Features = field(default_factory=Features)  # promoe's (and infinity's) techniques
    predictor: str = "auto"  # promoe: learned when trained for the model, else history; or eam
    window: int | None = None  # promoe: prediction distance; default: the trained one
    machine: str | None = None  # promoe: profile the split's costs start from (None: default)
    auto: bool = False  # no policy was named: the default placement may pick ncmoe (choice.py)
    # promoe/infinity: stage slots for prompt passes (None: stage_slots_for on a GPU, none on
    # a CPU build, where slots are host memory too); held back from a gpu_budget
    stage_slots: int | None = None
    # prompt banks (forecache_cache_set_bank): ubatches of DEVICE_MIN_TOKENS or more compute each
    # layer from a copy of all its experts, filled while the layer before computes; held back
    # from a gpu_budget in place of stage slots (None: on a GPU, where some layer misses experts)
    prompt_bank: bool | None = None
    # copies on a stream of each device's own, ordered with compute by events where the device has
    # them (a GPU): a decoded token's product waits on the device, not the host, for its copies
    copy_stream: bool = True
    # MoBiLE decoding (lossy; forecache_cache_set_little): each generated token first runs a
    # little pass over its top ``little_k`` experts (-1: half the model's top-k; 0: exact
    # decoding), and is recomputed by the full model when the little pass's top probability is
    # below ``gamma``; ``little_resident``: the little pass keeps its top-1 and those of its top
    # ``little_k`` (-1: the whole top-k) already in device slots, so it never waits for a copy
    little_k: int = 0
    gamma: float = 0.7
    little_resident: bool = False
    # host memory for the model's experts (with its non-expert weights on the host): the experts
    # beyond it stay in the file and the disk tier reads them (None: every expert in memory)
    host_budget: int | None = None
    device_budgets: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        spec = policy_spec(self.policy)
        if self.host_budget is not None and spec.placement != "slots":
            raise ValueError(f"{setting('host_budget')} runs in forecache's expert cache, and "
                             f"policy {self.policy} reads every expert from memory: use "
                             f"{setting('policy', 'promoe')}, infinity or lru")
        sizes = [x for x in (self.gpu_budget, self.cache_fraction, self.slots_per_layer,
                             self.device_budgets) if x is not None]
        if self.device_budgets is not None and (spec.placement not in ("slots", "layers") or
                                                self.host_budget is not None):
            raise ValueError(f"a {setting('gpu_budget')} per device sizes the slots of a cached "
                             f"policy (promoe, infinity, lru, ...) or ncmoe's host layers, "
                             f"without {setting('host_budget')}; not {self.policy}"
                             f"{' with a disk tier' if self.host_budget is not None else ''}")
        if len(sizes) > 1:
            raise ValueError(f"give one of {setting('gpu_budget')} and "
                             f"{setting('cache_fraction')}, not both")
        if spec.placement != "host" and not sizes:
            raise ValueError(f"policy {self.policy} needs {setting('gpu_budget')} or "
                             f"{setting('cache_fraction')}")
        if spec.placement == "layers" and self.gpu_budget is None and \
                self.device_budgets is None:
            raise ValueError(f"policy ncmoe places whole layers and needs {setting('gpu_budget')}")
        if self.little_k and not 0.0 <= self.gamma <= 1.0:
            raise ValueError(f"{setting('gamma')} is {self.gamma}: give a probability in [0, 1]")

    @property
    def spec(self) -> PolicySpec:
        """The placement ``policy`` names."""
        return policy_spec(self.policy)


# Device memory left free when the budget is taken from the GPU's free memory: other processes,
# the driver's own allocations and fragmentation.
AUTO_BUDGET_RESERVE = 0.05
# a CPU-only build's share of each layer's experts in slots when only a host budget is given
DISK_CPU_SLOT_FRACTION = 0.125
AUTO_BUDGET_MIN_RESERVE = 512 << 20


def resolve_cache_config(policy: str | None, gpu_budget: int | str | None,
                         cache_fraction: float | None, *, predictor: str = "auto",
                         window: int | None = None, machine: str | None = None,
                         features: Features | None = None, stage_slots: int | None = None,
                         prompt_bank: bool | None = None, little_k: int = 0, gamma: float = 0.7,
                         little_resident: bool = False,
                         host_budget: int | str | None = None) -> CacheConfig | None:
    """The configuration users get from what they gave: promoe unless a policy is named; sized by
    the budget or fraction given, else by the GPU's free memory. With nothing given on a
    CPU-only build, None: llama.cpp's own placement, since device and host are the same memory."""
    per_device = parse_budgets(gpu_budget) if isinstance(gpu_budget, str) and "," in gpu_budget \
        else None
    budget = None if per_device else \
        parse_size(gpu_budget) if isinstance(gpu_budget, str) else gpu_budget
    host = parse_size(host_budget) if isinstance(host_budget, str) else host_budget
    if host is not None and budget is None and cache_fraction is None and \
            cache_device().type == "cpu":
        # the disk tier lives in the expert cache; on a CPU-only build its slots are host
        # memory too, so they stay few
        cache_fraction = DISK_CPU_SLOT_FRACTION
    if budget is None and cache_fraction is None and per_device is None and \
            (policy is None or policy_spec(policy).placement != "host"):
        dev = cache_device()
        gpus = local_gpus()
        if len(gpus) > 1 and (policy is None or policy_spec(policy).placement == "slots"):
            # llama.cpp splits the layers over every GPU: each sizes its own layers' slots
            per_device = tuple(auto_budget(d) for d in gpus)
        elif dev.type != "cpu":
            budget = auto_budget(dev)
        elif policy is None:
            if little_k:
                raise ValueError(f"MoBiLE decoding ({setting('mode')} mobile) runs in "
                                 "forecache's expert cache: on a CPU-only build give "
                                 f"{setting('policy')} promoe with {setting('cache_fraction')}")
            return None
    return CacheConfig(policy=policy or "promoe", gpu_budget=budget,
                       cache_fraction=cache_fraction, predictor=predictor, window=window,
                       machine=machine, features=features or Features(), auto=policy is None,
                       stage_slots=stage_slots, prompt_bank=prompt_bank,
                       little_k=little_k, gamma=gamma,
                       little_resident=little_resident, host_budget=host,
                       device_budgets=per_device)


def auto_budget(dev: Device) -> int:
    """The budget a run takes on ``dev`` when none is given: its free memory less a reserve."""
    reserve = max(int(dev.memory_free * AUTO_BUDGET_RESERVE), AUTO_BUDGET_MIN_RESERVE)
    return max(dev.memory_free - reserve, 0)


def spread_budget(cfg: CacheConfig) -> CacheConfig:
    """A cached policy's or ncmoe's single ``gpu_budget`` as the devices' total, for a run whose
    layers llama.cpp puts on other devices than the cache's own (several GPUs, RPC servers):
    slots are then sized per device once the model is loaded, ncmoe's host layers per device
    from llama.cpp's split before it loads (``budget._device_loads`` shares it)."""
    if not (cfg.spec.cached or cfg.spec.placement == "layers") or cfg.gpu_budget is None:
        return cfg
    return replace(cfg, gpu_budget=None, device_budgets=(cfg.gpu_budget,))


def default_choice(model: ModelFile, cfg: CacheConfig, *, n_ctx: int, n_ubatch: int,
                   routing_hit: Callable[[int], tuple[float, int]] | None = None,
                   ) -> Choice | None:
    """For a configuration whose policy nobody named: promoe or ncmoe, whichever the cost model
    (with this model's measured routing and rates when a run kept them) expects to be faster at
    this budget, a prompt ubatch of ``n_ubatch`` rows and a decoded token both weighed
    (``choice.choose``); ``routing_hit`` (slots a layer -> LRU hit rate and lookups): the
    routing the run will replay, which then decides in place of the measured one. None where
    there is nothing to choose: a policy was named, the cache is sized by a fraction (ncmoe needs
    a budget), or a CPU-only build with no ``machine`` (device and host are the same memory)."""
    if not cfg.auto or cfg.gpu_budget is None or cfg.host_budget is not None:
        return None  # (stock's placements need every expert in memory)
    dev = cache_device()
    if dev.type == "cpu" and cfg.machine is None:
        return None
    plan = plan_memory(model, cfg.gpu_budget, n_ctx=n_ctx, n_ubatch=n_ubatch,
                       device_name=dev.name, device_total=dev.memory_total)
    layers = model.moe_layers()
    full = plan.slots_per_layer()

    def promoe_shape(c: CacheConfig) -> DecodeShape:
        """promoe's placement under ``c``: the slots its stage slots or prompt banks leave."""
        stage, bank = held_back(model, c, plan, full, dev.type, proactive=c.features.reorder)
        slots = plan.slots_per_layer(held=stage + bank) if stage or bank else full
        return DecodeShape(n_moe=len(layers), n_expert=model.n_expert,
                           top_k=model.n_expert_used, n_slots=min(slots[il] for il in layers),
                           ncmoe_host_layers=plan.ncmoe_cpu_layers(),
                           dense_bytes=plan.non_expert_bytes, n_layer=model.n_layer,
                           prompt_rows=n_ubatch, bank=bank > 0)

    # the placement promoe takes by default, then (where nobody said) the one with prompt banks
    # the other way: banks over BANK_SHARE_MAX of the budget may still pay in both phases
    shapes = [promoe_shape(cfg)]
    if cfg.prompt_bank is None:
        try:
            other = promoe_shape(replace(cfg, prompt_bank=not shapes[0].bank))
        except BudgetError:  # no room for them
            other = shapes[0]
        if other.bank != shapes[0].bank:
            shapes.append(other)
    profile = Profile.load(machines_for(cfg.machine, 1)[0] or default_machine(dev))
    cost = CostModel.from_profile(profile, ExpertShape.of(model))

    def evidence_at(n_slots: int) -> Evidence:
        share = n_slots / model.n_expert
        if routing_hit is not None:  # the routing replayed decides, with this device's rates
            hit, lookups = routing_hit(n_slots)
            copy, scale = measured_rates(model, dev.name)
            return Evidence(locality(hit, share), "replay", lookups, copy, scale, share)
        return load_evidence(model, dev.name, share) or PRIOR

    return choose_among([(s, evidence_at(s.n_slots)) for s in shapes], profile, cost)


def bank_experts(model: ModelFile, slots: Sequence[int]) -> int:
    """The experts' worth of device memory a device's prompt banks take beside ``slots`` (per
    model layer; ``budget.bank_size`` over the MoE layers)."""
    return bank_size(model.n_expert, [slots[il] for il in model.moe_layers() if il < len(slots)])


def held_back(model: ModelFile, cfg: CacheConfig, plan: MemoryPlan | None,
              slots: Sequence[int], device_type: str, *, proactive: bool) -> tuple[int, int]:
    """What a cached placement holds back from its slots: (stage slots, experts' worth of prompt
    banks). Prompt banks (``cfg.prompt_bank``; by default on a GPU) where some layer would miss
    experts, its experts are in memory, nothing must see every routing (banks compute a prompt's
    layers without reading them) and, by default, they take at most ``BANK_SHARE_MAX`` of the
    expert budget; they serve prompts in place of stage slots. Else a proactive policy's stage
    slots (on a GPU). Without a budget (a fraction of the experts) the banks come beside the
    slots."""
    spec = cfg.spec
    layers = model.moe_layers()
    full = plan.slots_per_layer() if plan is not None else list(slots)
    misses = any(full[il] < model.n_expert for il in layers if il < len(full))
    watched = cfg.on_route is not None or (spec.policy is not None and
                                           spec.policy.routes_every_layer)
    bank = cfg.prompt_bank if cfg.prompt_bank is not None else device_type != "cpu"
    bank = bank and spec.cached and misses and cfg.host_budget is None and not watched
    if bank and plan is not None:
        held = plan.bank_held()
        fits = held * plan.largest_expert_bytes <= plan.expert_budget
        if fits and (cfg.prompt_bank or held * plan.largest_expert_bytes <=
                     plan.expert_budget * BANK_SHARE_MAX):
            return 0, held
        if cfg.prompt_bank:
            off = "--no-prompt-bank" if setting("prompt_bank").startswith("--") else \
                "prompt_bank=False"
            raise BudgetError(f"prompt banks of {held} experts leave no expert slots in "
                              f"{format_size(plan.budget)}; raise {setting('gpu_budget')} or "
                              f"turn them off ({off})")
        bank = False
    if bank:
        return 0, bank_experts(model, slots)  # beside the slots
    return stage_slots(model.n_expert, list(slots), streams=proactive, given=cfg.stage_slots,
                       on_cpu=device_type == "cpu"), 0


@dataclass
class Placement:
    """The decisions made before llama.cpp loads the model."""

    device: Device
    plan: MemoryPlan | None
    n_slots: list[int]
    host_layers: list[int]  # layers whose experts are in host memory
    stage_slots: int = 0  # promoe/infinity: stage slots beside the slots
    bank: bool = False  # prompt banks beside the slots (CacheConfig.prompt_bank)
    disk: DiskPlan | None = None  # host slots of the disk tier (cfg.host_budget)


def place(model: ModelFile, cfg: CacheConfig, *, n_ctx: int, n_ubatch: int,
          layer_dev: Sequence[int] | None = None) -> Placement:
    """Choose the device and split the budget for ``cfg``; ``layer_dev``: the device llama.cpp
    will put each layer on, which ncmoe's budget per device (``cfg.device_budgets``) needs."""
    dev = cache_device()
    if ncmoe_per_device(cfg):
        if layer_dev is None:
            raise ValueError("ncmoe with a budget per device needs llama.cpp's layer split")
        from forecache.native.ggml_devices import devices

        names = {d.index: d.name for d in devices()}
        assert cfg.device_budgets is not None
        host = device_host_layers(model, cfg.device_budgets, layer_dev, names, n_ctx=n_ctx,
                                  n_ubatch=n_ubatch)
        return Placement(dev, None, [0] * model.n_layer, host)
    plan = None
    if cfg.gpu_budget is not None:
        plan = plan_memory(model, cfg.gpu_budget, n_ctx=n_ctx, n_ubatch=n_ubatch,
                           device_name=dev.name, device_total=dev.memory_total)
    layers = model.moe_layers()
    spec = cfg.spec
    if spec.placement == "layers":
        assert plan is not None
        return Placement(dev, plan, [0] * model.n_layer, layers[:plan.ncmoe_cpu_layers()])
    if spec.policy is None:  # offload
        return Placement(dev, plan, [0] * model.n_layer, layers)
    if plan is not None:
        slots = (plan.slots_per_layer() + [0] * model.n_layer)[:model.n_layer]
    elif cfg.cache_fraction is not None:
        slots = slots_for_fraction(model, cfg.cache_fraction)
    elif cfg.device_budgets is not None:  # sized once loaded: which device holds which layer
        slots = [1 if il in layers else 0 for il in range(model.n_layer)]
    else:
        assert cfg.slots_per_layer is not None
        slots = [min(cfg.slots_per_layer, model.n_expert) if il in layers else 0
                 for il in range(model.n_layer)]
    stage, bank = 0, 0
    if cfg.device_budgets is None:
        stage, bank = held_back(model, cfg, plan, slots, dev.type,
                                proactive=spec.proactive and cfg.features.reorder)
    if plan is not None and (stage or bank > 0):
        slots = (plan.slots_per_layer(held=stage + bank)
                 + [0] * model.n_layer)[:model.n_layer]
    slots = spec.policy.layer_slots(model, slots)
    disk = None
    if cfg.host_budget is not None:
        on_gpu = dev.type != "cpu"
        slot_bytes = 0 if on_gpu else (sum(slots) + stage) * max(model.layer_expert_bytes())
        disk = plan_disk(model, cfg.host_budget, on_gpu=on_gpu, slot_bytes=slot_bytes)
        if disk is not None:  # every layer computes from slots: its experts are not in memory
            slots = [max(n, 1) if il in layers else n for il, n in enumerate(slots)]
    return Placement(dev, plan, slots, layers, stage, bank > 0, disk)


def ncmoe_per_device(cfg: CacheConfig) -> bool:
    """ncmoe (whole layers' experts in host memory) with a budget for each device."""
    return cfg.spec.placement == "layers" and cfg.device_budgets is not None


def expert_overrides(placement: Placement) -> dict[str, Any]:
    """``llama_cpp.Llama`` keywords that load the experts of ``placement.host_layers`` into host
    memory (pinned when the device has a pinned host buffer type), as ``-ot``/``--n-cpu-moe`` do.
    """
    if not placement.host_layers:
        return {}
    layers = "|".join(str(il) for il in placement.host_layers)
    pattern = f"^blk\\.({layers})\\..*{EXPERT_TENSOR_PATTERN}"
    # Slots are filled by copying an expert's bytes, so host experts keep the file's layout:
    # no CPU weight repacking (llama.cpp would otherwise repack experts overridden to "CPU").
    return {"tensor_buft_overrides": [(pattern, host_buffer_type(placement.device.index))],
            "use_extra_bufts": False}


def make_policy(cfg: CacheConfig, n_slots: list[int], model: ModelFile | None = None,
                device: Device | None = None, disk_rate: DiskRate | None = None,
                layer_devices: Sequence[Device | None] | None = None) -> Policy:
    """The slot policy of ``cfg`` (``cache.registry``). A proactive policy's host/device split
    needs ``model``; without an explicit ``cfg.machine`` it is off when the cache ``device`` is
    the CPU itself (on a CPU build both sides are the same cores). ``disk_rate``: the disk
    tier's reads as measured at start, which the split prices its reads by. ``layer_devices``:
    per model layer, the device holding its slots where they are on devices other than
    ``device`` (RPC servers, several GPUs): each such device's layers are then priced by a
    model of its own (``split_costs``: its own link), ``device`` unused."""
    cost = None
    layer_costs: list[CostModel | None] | None = None
    held = [d for d in layer_devices or [] if d is not None]
    on_cpu = all(d.type == "cpu" for d in held) if held else \
        device is not None and device.type == "cpu"
    if cfg.spec.proactive and cfg.features.split and model is not None and \
            (cfg.machine is not None or not on_cpu):
        if held:
            costs = split_costs(model, cfg, held, disk_rate)
            layer_costs = [costs[d.index] if d is not None else None
                           for d in layer_devices or []]
            cost = costs[held[0].index]
        else:
            cost = split_cost(model, cfg, device, disk_rate)
    policy = build_policy(cfg.policy, n_slots, PolicyInputs(
        features=cfg.features, cost=cost, layer_costs=layer_costs, profile=cfg.profile,
        top_k=model.n_expert_used if model is not None else 1))
    if policy is None:
        raise ValueError(f"policy {cfg.policy} is llama.cpp's own placement: it has no expert "
                         "cache to attach")
    return policy


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


def make_forecaster(model: ModelFile, cfg: CacheConfig, n_slots: list[int],
                    say: Callable[[str], None] | None = None) -> Forecaster:
    """The predictor a proactive policy prefetches with. promoe: the learned one trained for
    ``model`` (window ``cfg.window``, default the smallest trained), else ``history`` (needs no
    training), or ``eam`` (needs the model's stored EAM collection). infinity: always ``eam``,
    ranking every expert its matches activate, from the stored collection or, without one, from
    an empty collection that learns each served request."""
    from forecache.predictor.history import HistoryPredictor
    from forecache.predictor.store import load_learned, trained_windows

    layers = model.moe_layers()
    if cfg.spec.ranks_experts:
        return Forecaster(eam_predictor(model, ranking=True, say=say), cfg.window or EAM_WINDOW,
                          layers, n_slots, n_predict=model.n_expert, min_score=0.0)
    name = cfg.predictor
    windows = trained_windows(model)
    if name == "auto":
        name = "learned" if (windows if cfg.window is None else cfg.window in windows) else \
            "history"
        if name == "history" and say is not None:
            say(f"no learned predictors for {model.path.name}"
                f"{'' if cfg.window is None else f' (window {cfg.window})'}: prefetching with "
                "the history predictor; `forecache trace` and `forecache train` make them")
    if name == "learned":
        if not windows and cfg.window is None:
            raise ValueError(f"{setting('predictor', 'learned')}: no learned predictors for "
                             f"{model.path.name}; make them with `forecache trace -m "
                             f"{model.path} --builtin default --out TRACE.npz` and `forecache "
                             "train -m MODEL --trace TRACE.npz --window 2`, or use "
                             f"{setting('predictor', 'history')}")
        window = cfg.window if cfg.window is not None else windows[0]
        predictor = load_learned(model, window)
    elif name == "history":
        window = cfg.window or 1
        predictor = HistoryPredictor(len(layers), model.n_expert, model.n_expert_used)
    elif name == "eam":
        window = cfg.window or EAM_WINDOW
        predictor = eam_predictor(model, ranking=False)
    else:
        raise ValueError(f"policy promoe predicts with learned, history or eam, not {name!r}")
    return Forecaster(predictor, window, layers, n_slots)


def eam_predictor(model: ModelFile, *, ranking: bool,
                  say: Callable[[str], None] | None = None) -> Predictor:
    """MoE-Infinity's EAM predictor for ``model`` from its stored collection, adding each
    finished request to it. ``ranking`` (infinity): no prior, so an expert no match activates
    scores 0, and without a stored collection it starts empty (said through ``say``). Otherwise
    (promoe's eam predictor) the routing prior breaks ties and a missing collection is an error
    naming the commands that make one."""
    from forecache.predictor.eam import EAMPredictor
    from forecache.predictor.store import has_eam, load_eam

    layers = model.moe_layers()
    p = EAMPredictor(len(layers), model.n_expert, model.n_expert_used,
                     prior_weight=0.0 if ranking else 1e-3)
    if not ranking or has_eam(model):
        col = load_eam(model)
        p.restore(col.eams, col.prior)
    elif say is not None:
        say(f"no EAM collection for {model.path.name}: infinity starts with an empty one, "
            "learns each request and splits slots evenly; `forecache trace` and `forecache "
            "train --predictor eam` make one")
    return p


def attach(ctx: int, placement: Placement, cfg: CacheConfig, policy: Policy,
           model: ModelFile | None = None, say: Callable[[str], None] | None = None,
           ) -> ExpertCache:
    """Create the expert cache on a loaded context (promoe: with its prediction thread)."""
    forecaster = None
    chunk = cfg.chunk_bytes
    reorder = False  # the reactive baselines wait for every copy of a layer, then compute it
    gather = 0
    if isinstance(policy, Prefetcher):  # proactive
        f = policy.features
        if f.prefetch:
            assert model is not None, "promoe needs the model file for its predictor"
            forecaster = make_forecaster(model, cfg, placement.n_slots, say)
        chunk = chunk if f.chunk else CHUNK_EXPERT
        reorder = f.reorder
        gather = f.prompt_gather
    disk = None
    if placement.disk is not None:
        assert model is not None, "the disk tier reads the model file"
        disk = DiskTier(tuple(model.files), placement.disk.n_host, readers_default())
    return ExpertCache(ctx, placement.n_slots, policy, device=placement.device.index,
                       chunk_bytes=chunk, on_route=cfg.on_route, forecaster=forecaster,
                       reorder=reorder, stage_slots=placement.stage_slots, disk=disk,
                       gather=gather, bank_tokens=DEVICE_MIN_TOKENS if placement.bank else 0,
                       copy_stream=cfg.copy_stream)


def attach_observer(ctx: int, model: ModelFile, device: int, on_route: RouteCallback, *,
                    gate_input: bool = False) -> ExpertCache:
    """An expert cache that only watches: every MoE layer is computed from host memory (the
    experts must be host-resident) and each routing decision goes to ``on_route``. Traces and
    routing profiles use it; one slot per MoE layer is allocated because the hook fires only on
    layers with slots."""
    layers = set(model.moe_layers())
    n_slots = [1 if il in layers else 0 for il in range(model.n_layer)]
    return ExpertCache(ctx, n_slots, HostOnlyPolicy(n_slots), device=device, on_route=on_route,
                       gate_input=gate_input)

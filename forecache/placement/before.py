"""The placement planned before llama.cpp loads the model."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from forecache.cache.budget import (
    BANK_SHARE_MAX,
    BudgetError,
    BudgetSplit,
    bank_size,
    device_host_layers,
    draft_device_bytes,
    draft_ubatch,
    format_size,
    prefill_seqs,
    slots_for_fraction,
    split_budget,
)
from forecache.cache.choice import PRIOR, Choice, DecodeShape, Evidence, choose_among, locality
from forecache.cache.cost import CostModel, ExpertShape, Profile
from forecache.cache.disk import HostSlots, size_disk_tier
from forecache.cache.measured import load_evidence, measured_rates
from forecache.cache.prefetcher import stage_slots
from forecache.errors import setting
from forecache.gguf.header import EXPERT_TENSOR_PATTERN, ModelFile, read_model_file
from forecache.native.ggml_devices import (
    Device,
    cache_device,
    host_buffer_type,
    layer_split,
    local_gpus,
)
from forecache.native.libs import MAX_THREADS, ModelLoadError
from forecache.native.rpc import RPCError, add_servers, parse_endpoints
from forecache.placement.costs import default_machine, machines_for
from forecache.placement.options import (
    AUTO,
    DEFAULT_POLICY,
    CacheConfig,
    Options,
    draft_with_mobile,
    spread_budget,
)
from forecache.trace.replay import Routing, load_routing


def default_choice(model: ModelFile, cfg: CacheConfig, *, n_ctx: int, n_ubatch: int,
                   routing_hit: Callable[[int], tuple[float, int]] | None = None,
                   memory: BudgetSplit | None = None) -> Choice | None:
    """For a configuration whose policy nobody named: promoe or ncmoe, whichever the cost model
    (with this model's measured routing and rates when a run kept them) expects to be faster at
    this budget, a prompt ubatch of ``n_ubatch`` rows and a decoded token both weighed
    (``choice.choose``); ``routing_hit`` (slots a layer -> LRU hit rate and lookups): the
    routing the run will replay, which then decides in place of the measured one. None where
    there is nothing to choose: a policy was named, the cache is sized by a fraction (ncmoe needs
    a budget), or a CPU-only build with no ``machine`` (device and host are the same memory).
    ``memory``: the budget's split, where the caller has worked it out."""
    if cfg.policy is not None or cfg.gpu_budget is None or cfg.host_budget is not None:
        return None  # (stock's placements need every expert in memory)
    dev = cache_device()
    if dev.type == "cpu" and cfg.machine is None:
        return None
    split = memory or budget_split(model, cfg, n_ctx=n_ctx, n_ubatch=n_ubatch)
    assert split is not None
    layers = model.moe_layers()
    full = split.slots_per_layer()

    def promoe_shape(c: CacheConfig) -> DecodeShape:
        """promoe's placement under ``c``: the slots its stage slots or prompt banks leave."""
        stage, bank = held_back(model, c, split, full, dev.type, proactive=c.features.reorder)
        slots = split.slots_per_layer(held=stage + bank) if stage or bank else full
        return DecodeShape(n_moe=len(layers), n_expert=model.n_expert,
                           top_k=model.n_expert_used, n_slots=min(slots[il] for il in layers),
                           ncmoe_host_layers=split.ncmoe_cpu_layers(),
                           dense_bytes=split.non_expert_bytes, n_layer=model.n_layer,
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


def banks_asked(cfg: CacheConfig, device_type: str) -> bool:
    """Whether a placement under ``cfg`` on a ``device_type`` device holds prompt banks where
    some layer would miss experts (``held_back``, before their size meets the budget): asked
    for (``cfg.prompt_bank``; by default on a GPU), for a cache whose experts are in memory and
    whose routing nothing must see (banks compute a prompt's layers without reading it)."""
    spec = cfg.spec
    watched = cfg.on_route is not None or (spec.policy is not None and
                                           spec.policy.routes_every_layer)
    bank = cfg.prompt_bank if cfg.prompt_bank is not None else device_type != "cpu"
    return bank and spec.cached and cfg.host_budget is None and not watched


def held_back(model: ModelFile, cfg: CacheConfig, split: BudgetSplit | None,
              slots: Sequence[int], device_type: str, *, proactive: bool) -> tuple[int, int]:
    """What a cached placement holds back from its slots: (stage slots, experts' worth of prompt
    banks). Prompt banks (``cfg.prompt_bank``; by default on a GPU) where some layer would miss
    experts, its experts are in memory, nothing must see every routing (banks compute a prompt's
    layers without reading them) and, by default, they take at most ``BANK_SHARE_MAX`` of the
    expert budget; they serve prompts in place of stage slots. Else a proactive policy's stage
    slots (on a GPU). Without a budget (a fraction of the experts) the banks come beside the
    slots."""
    layers = model.moe_layers()
    full = split.slots_per_layer() if split is not None else list(slots)
    misses = any(full[il] < model.n_expert for il in layers if il < len(full))
    bank = banks_asked(cfg, device_type) and misses
    if bank and split is not None:
        held = split.bank_held()
        fits = held * split.largest_expert_bytes <= split.expert_budget
        if fits and (cfg.prompt_bank or held * split.largest_expert_bytes <=
                     split.expert_budget * BANK_SHARE_MAX):
            return 0, held
        if cfg.prompt_bank:
            off = "--no-prompt-bank" if setting("prompt_bank").startswith("--") else \
                "prompt_bank=False"
            raise BudgetError(f"prompt banks of {held} experts leave no expert slots in "
                              f"{format_size(split.budget)}; raise {setting('gpu_budget')} or "
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
    memory: BudgetSplit | None  # where the budget goes (None without a single budget)
    n_slots: list[int]
    host_layers: list[int]  # layers whose experts are in host memory
    stage_slots: int = 0  # promoe/infinity: stage slots beside the slots
    bank: bool = False  # prompt banks beside the slots (CacheConfig.prompt_bank)
    disk: HostSlots | None = None  # host slots of the disk tier (cfg.host_budget)


def budget_split(model: ModelFile, cfg: CacheConfig, *, n_ctx: int, n_ubatch: int,
                 kv_on_device: bool = True, contexts: Sequence[int] = (),
                 draft_bytes: int = 0) -> BudgetSplit | None:
    """Where ``cfg.gpu_budget`` goes on the cache's device (None without a single budget);
    ``kv_on_device``, ``contexts`` and ``draft_bytes`` as ``budget.split_budget`` takes them."""
    if cfg.gpu_budget is None:
        return None
    dev = cache_device()
    return split_budget(model, cfg.gpu_budget, n_ctx=n_ctx, n_ubatch=n_ubatch,
                       device_name=dev.name, device_total=dev.memory_total,
                       kv_on_device=kv_on_device, contexts=contexts, draft_bytes=draft_bytes)


def draft_context_bytes(options: Options, n_ctx: int, n_ubatch: int) -> int:
    """The device memory a draft model's context takes beside the model (0 without one, for
    the model's own little pass, or a draft path that is not a file, which the draft's load
    then refuses): the budget pays for it, stock's placement and the cache's alike."""
    if options.draft is None or not os.path.isfile(options.draft):
        return 0
    return draft_device_bytes(read_model_file(options.draft), n_ctx, n_ubatch)


def micro_contexts(options: Options, n_ctx: int) -> list[int]:
    """The context sizes of a batch job's prompt contexts (``options.micro`` - 1 of them,
    ``roofline.batch.prefill_seqs`` sequences each, as ``micro.Sibling`` sizes them)."""
    n_seq = max(options.n_seq_max, 1)
    return [n_ctx // n_seq * prefill_seqs(n_seq, options.micro)] * (options.micro - 1)


def place(model: ModelFile, cfg: CacheConfig, *, n_ctx: int, n_ubatch: int,
          layer_dev: Sequence[int] | None = None, memory: BudgetSplit | None = None,
          ) -> Placement:
    """Choose the device and split the budget for ``cfg``; ``layer_dev``: the device llama.cpp
    will put each layer on, which ncmoe's budget per device (``cfg.device_budgets``) needs;
    ``memory``: the budget's split, where the caller has worked it out."""
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
    split = memory or budget_split(model, cfg, n_ctx=n_ctx, n_ubatch=n_ubatch)
    layers = model.moe_layers()
    spec = cfg.spec
    if spec.placement == "layers":
        assert split is not None
        return Placement(dev, split, [0] * model.n_layer, layers[:split.ncmoe_cpu_layers()])
    if spec.policy is None:  # offload
        return Placement(dev, split, [0] * model.n_layer, layers)
    if split is not None:
        slots = (split.slots_per_layer() + [0] * model.n_layer)[:model.n_layer]
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
        stage, bank = held_back(model, cfg, split, slots, dev.type,
                                proactive=spec.proactive and cfg.features.reorder)
    if split is not None and (stage or bank > 0):
        slots = (split.slots_per_layer(held=stage + bank)
                 + [0] * model.n_layer)[:model.n_layer]
    slots = spec.policy.layer_slots(model, slots)
    disk = None
    if cfg.host_budget is not None:
        on_gpu = dev.type != "cpu"
        slot_bytes = 0 if on_gpu else (sum(slots) + stage) * max(model.layer_expert_bytes())
        disk = size_disk_tier(model, cfg.host_budget, on_gpu=on_gpu, slot_bytes=slot_bytes)
        if disk is not None:  # every layer computes from slots: its experts are not in memory
            slots = [max(n, 1) if il in layers else n for il, n in enumerate(slots)]
    return Placement(dev, split, slots, layers, stage, bank > 0, disk)


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


@dataclass
class LoadPlan:
    """Everything decided before llama.cpp loads the model: the configuration resolved, the
    default's choice, the placement, and llama.cpp's keywords that carry it out."""

    options: Options
    cache: CacheConfig | None  # None: llama.cpp's own placement, no expert cache
    choice: Choice | None  # the default placement's, when it chose
    placement: Placement | None
    layer_dev: list[int] | None  # ncmoe per device: the device llama.cpp will put each layer on
    rpc: list[str]  # RPC servers registered for the load
    routing: Routing | None  # replayed in place of the router's (benchmarks)
    n_ctx: int
    n_ubatch: int
    load_kwargs: dict[str, Any]  # llama_cpp.Llama's keywords
    draft_ubatch: int = 0  # a draft model's context's ubatch (``budget.draft_ubatch``)


def plan_load(model: ModelFile, options: Options, cache: CacheConfig | None | object,
              routing_trace: str | os.PathLike[str] | Routing | None,
              kwargs: dict[str, Any]) -> LoadPlan:
    """Plan ``model``'s load from ``options`` (or a ready ``cache``; ``AUTO``: from the
    options) and llama_cpp.Llama's keywords ``kwargs``: the configuration, RPC servers
    registered (llama.cpp splits layers over their devices as it loads), the default's choice
    (never expected slower than ``--n-cpu-moe``), the device memory split and the tensor
    overrides."""
    kwargs = dict(kwargs)
    for key in ("n_threads", "n_threads_batch"):
        n = kwargs.get(key)
        if n is not None and not 1 <= int(n) <= MAX_THREADS:
            raise ValueError(f"{key}={n}: use 1 to {MAX_THREADS} (or None: every core)")
    cfg = _configure(options, cache)
    rpc = (parse_endpoints(options.rpc) if isinstance(options.rpc, str) else
           list(options.rpc)) if options.rpc else []
    if rpc:
        if cfg is not None and cfg.policy is not None:
            cfg = spread_budget(cfg)  # a single size is the devices' total
        try:
            add_servers(rpc)  # before the load: llama.cpp then splits the layers over them
        except RPCError as e:
            raise ModelLoadError(str(e)) from e
        # over RPC the default is llama.cpp's own placement
        cfg = None if cfg is None or cfg.policy is None else cfg
        kwargs.setdefault("n_gpu_layers", -1)  # the servers' devices take the layers
    elif cfg is not None and len(local_gpus()) > 1:
        cfg = spread_budget(cfg)  # llama.cpp splits the layers over every GPU
    n_ctx = int(kwargs.get("n_ctx", 512)) or int(model.arch_kv("context_length", 4096))
    n_ubatch = min(int(kwargs.get("n_batch", 512)), int(kwargs.get("n_ubatch", 512)))
    routing = None
    if routing_trace is not None:
        if cfg is not None and cfg.little_k:
            raise ValueError(f"{setting('routing_trace')} replays every expert of the trace's "
                             "rows: it cannot go with MoBiLE's little pass, which chooses "
                             "experts of its own")
        if options.n_seq_max <= 1:
            # one sequence's routing is set a batch at a time: every llama_decode must be one
            # ubatch (a batch job's is set by sequence and position, however llama.cpp splits it)
            kwargs.update(n_batch=n_ubatch, n_ubatch=n_ubatch)
        routing = routing_trace if isinstance(routing_trace, Routing) else load_routing(
            routing_trace, n_layers=len(model.moe_layers()), n_expert=model.n_expert,
            top_k=model.n_expert_used)
        if cfg is not None and cfg.spec.needs_profile and cfg.profile is None:
            # the hottest experts of the routing replayed, not of the model's own
            cfg = replace(cfg, profile=routing.counts(model.moe_layers(), model.n_layer,
                                                      model.n_expert))
    choice, memory = None, None
    d_ubatch = draft_ubatch(int(kwargs.get("n_batch", 512)))  # (after a replay's n_batch)
    if cfg is not None:  # the budget's split, worked out once for the choice and the placement
        memory = budget_split(model, cfg, n_ctx=n_ctx, n_ubatch=n_ubatch,
                              kv_on_device=bool(kwargs.get("offload_kqv", True)),
                              contexts=micro_contexts(options, n_ctx),
                              draft_bytes=draft_context_bytes(options, n_ctx, d_ubatch))
        choice = default_choice(model, cfg, n_ctx=n_ctx, n_ubatch=n_ubatch, memory=memory,
                                routing_hit=routing.decode_hit_rate if routing else None)
    if cfg is not None and cfg.policy is None:  # named now: the choice, or the default's own
        cfg = replace(cfg, policy=choice.policy if choice is not None else DEFAULT_POLICY)
    if choice is not None and cfg is not None:
        if choice.policy != "ncmoe" and cfg.prompt_bank is None:
            # the banks the choice weighed (perhaps over their default share)
            cfg = replace(cfg, prompt_bank=choice.shape.bank)
    placement, layer_dev = None, None
    if cfg is not None:
        kwargs.setdefault("n_gpu_layers", -1)
        if ncmoe_per_device(cfg):
            layer_dev = layer_split(model.n_layer, int(kwargs["n_gpu_layers"]),
                                kwargs.get("tensor_split"))
        placement = place(model, cfg, n_ctx=n_ctx, n_ubatch=n_ubatch, layer_dev=layer_dev,
                          memory=memory)
        if placement.disk is not None:
            # the other weights read into memory, not faulted in from the file's pages
            kwargs.setdefault("use_mmap", False)
        kwargs.update(expert_overrides(placement))
    if options.n_seq_max > 1:
        # a KV stream per sequence: each sees its cells where it would alone, which keeps its
        # attention sums in the same order as a single-sequence run
        kwargs.update(n_seq_max=options.n_seq_max, kv_unified=False)
    return LoadPlan(options, cfg, choice, placement, layer_dev, rpc, routing, n_ctx, n_ubatch,
                    kwargs, d_ubatch)


def _configure(options: Options, cache: CacheConfig | None | object) -> CacheConfig | None:
    """The configuration: resolved from ``options`` (``cache`` is ``AUTO``) or ``cache`` as
    given, which the placement keywords of ``options`` cannot go with."""
    if cache is AUTO:
        return options.cache_config()
    assert cache is None or isinstance(cache, CacheConfig)
    if options.draft is not None and cache is not None and cache.little_k:
        raise draft_with_mobile()
    if options.mode == "mobile":
        raise ValueError(f"{setting('mode')} goes with the policy keywords; with "
                         f"{setting('cache')} set CacheConfig(little_k=..., gamma=...)")
    if options.host_budget is not None:
        raise ValueError(f"{setting('host_budget')} goes with the policy keywords; with "
                         f"{setting('cache')} set CacheConfig(host_budget=...)")
    return cache

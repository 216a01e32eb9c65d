"""From a placement to an attached expert cache: its policy, its predictor and its disk tier."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from forecache.cache.cost import DEVICE_MIN_TOKENS, CostModel
from forecache.cache.disk import DiskTier, readers_default
from forecache.cache.forecast import Forecaster
from forecache.cache.policies import HostOnlyPolicy, Policy, PolicyInputs
from forecache.cache.prefetcher import ProMoEPolicy
from forecache.cache.registry import build_policy
from forecache.cache.runtime import ExpertCache, RouteCallback
from forecache.diskprobe import DiskRate
from forecache.errors import setting
from forecache.gguf.header import ModelFile
from forecache.native.cache_api import CHUNK_EXPERT
from forecache.native.ggml_devices import (
    Device,
)
from forecache.placement.before import Placement
from forecache.placement.costs import split_cost, split_costs
from forecache.placement.options import PREDICTORS, CacheConfig
from forecache.predictor.base import Predictor

# layers ahead the EAM predictor forecasts: its matches are request-level, so distance costs
# little accuracy and gives the copies time
EAM_WINDOW = 2


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
        raise ValueError(f"policy promoe predicts with {', '.join(PREDICTORS[1:])}, "
                         f"not {name!r}")
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
    if isinstance(policy, ProMoEPolicy):  # proactive
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


def build_cache(ctx: int, model: ModelFile, placement: Placement, cfg: CacheConfig,
                layer_devices: Sequence[Device | None] | None = None,
                disk_rate: DiskRate | None = None, say: Callable[[str], None] | None = None,
                ) -> ExpertCache:
    """``cfg``'s policy (``make_policy``) in an expert cache attached to the loaded context,
    its pinned experts in place and its counters at zero."""
    policy = make_policy(cfg, placement.n_slots, model, placement.device, disk_rate,
                         layer_devices)
    cache = attach(ctx, placement, cfg, policy, model, say=say)
    cache.wait_idle()  # the static policy's pinned experts
    cache.reset_stats()
    return cache

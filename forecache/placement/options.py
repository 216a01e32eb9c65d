"""What a run asks for and its resolved form."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

import numpy as np

from forecache.cache.budget import (
    parse_budgets,
    parse_size,
)
from forecache.cache.prefetcher import Features
from forecache.cache.registry import PolicySpec, policy_spec
from forecache.cache.runtime import DEFAULT_CHUNK_BYTES, RouteCallback
from forecache.errors import setting
from forecache.native.ggml_devices import (
    Device,
    cache_device,
    local_gpus,
)
from forecache.predictor.registry import RUNTIME_PREDICTORS


class _Auto:
    """Marker: the cache configuration comes from the options (``Llama(cache=AUTO)``)."""


AUTO: Any = _Auto()
# the placement the default weighs first, and takes where there is nothing to choose
DEFAULT_POLICY = "promoe"
# promoe's predictors (``build.make_forecaster``); auto: learned when trained for the model,
# else history
PREDICTORS = ("auto", *RUNTIME_PREDICTORS)
# exact: the model as it is; mobile: MoBiLE's little and big passes (lossy)
MODES = ("exact", "mobile")
# promoe's techniques, each of which the command line turns off (``--no-prefetch``, ...)
SWITCHES = {"prefetch": "predicted prefetch",
            "chunk": "per-projection copy chunks (one chunk per expert instead)",
            "preempt": "early preemption of queued predictions at the gate",
            "reorder": "cache-first expert order and slot streaming",
            "split": "computing missing experts on the CPU when cheaper than copying"}


def draft_with_mobile() -> ValueError:
    """The one line for speculation asked for beside MoBiLE's little pass."""
    return ValueError(f"{setting('draft')} and {setting('mode')} mobile: choose one "
                      "(speculation is exact, mobile decoding is not)")


@dataclass(frozen=True)
class Options:
    """What a run asks for, as the command line's options and ``Llama``'s keyword arguments both
    give it, with the only copy of every default. ``cache_config`` resolves it for this machine;
    the placement is planned from that (``before.plan_load``)."""

    policy: str | None = None  # None: promoe or ncmoe, whichever is expected faster (choice.py)
    gpu_budget: int | str | None = None  # bytes, a size, or sizes per device ("20GiB,22GiB")
    cache_fraction: float | None = None
    host_budget: int | str | None = None  # beyond it the experts stay on disk
    predictor: str = "auto"
    window: int | None = None  # None: the window the learned predictors were trained for
    machine: str | None = None  # None: the device's default profile (costs.default_machine)
    stage_slots: int | None = None  # None: prefetcher.stage_slots
    prompt_bank: bool | None = None  # None: on a GPU, where some layer misses experts
    features: Features = field(default_factory=Features)
    mode: str = "exact"
    gamma: float = 0.7
    little_k: int | None = None  # None: half the model's top-k
    little_resident: bool = False
    draft: str | None = None
    draft_k: int | None = None  # None: adaptive
    rpc: str | Sequence[str] | None = None
    n_seq_max: int = 1
    # contexts over the model a batch job decodes in (its micro-batches: the prompts in
    # micro - 1 contexts of their own); the budget pays each one's buffers and KV cache
    micro: int = 1

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"{setting('mode')} {self.mode!r}: use 'exact' or 'mobile'")
        if self.draft is not None and self.mode == "mobile":
            raise draft_with_mobile()

    @classmethod
    def take(cls, kwargs: dict[str, Any], base: Options | None = None) -> Options:
        """``base`` (default: every default) with the fields named in ``kwargs``, taken out of
        it: what is left are llama.cpp's keywords."""
        mine = {f.name: kwargs.pop(f.name) for f in fields(cls) if f.name in kwargs}
        return replace(base, **mine) if base is not None else cls(**mine)

    @classmethod
    def from_cli(cls, **opts: Any) -> Options:
        """The command line's options: each ``no_<switch>`` flag turns one of promoe's
        techniques off; the others are fields."""
        off = {name: not opts.pop(f"no_{name}", False) for name in SWITCHES}
        return cls(features=Features(**off), **opts)

    @property
    def mobile_k(self) -> int:
        """``CacheConfig.little_k``: 0 for exact decoding, -1 for half the top-k."""
        return (self.little_k or -1) if self.mode == "mobile" else 0

    def cache_config(self) -> CacheConfig | None:
        """The configuration users get from what they gave: promoe unless a policy is named;
        sized by the budget or fraction given, else by the GPU's free memory. With nothing given
        on a CPU-only build, None: llama.cpp's own placement, since device and host are the same
        memory."""
        policy, gpu_budget, cache_fraction = self.policy, self.gpu_budget, self.cache_fraction
        per_device = parse_budgets(gpu_budget) \
            if isinstance(gpu_budget, str) and "," in gpu_budget else None
        budget = None if per_device else \
            parse_size(gpu_budget) if isinstance(gpu_budget, str) else gpu_budget
        host = parse_size(self.host_budget) if isinstance(self.host_budget, str) else \
            self.host_budget
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
                if self.mobile_k:
                    raise ValueError(f"MoBiLE decoding ({setting('mode')} mobile) runs in "
                                     "forecache's expert cache: on a CPU-only build give "
                                     f"{setting('policy')} promoe with "
                                     f"{setting('cache_fraction')}")
                return None
        return CacheConfig(policy=policy, gpu_budget=budget,
                           cache_fraction=cache_fraction, predictor=self.predictor,
                           window=self.window, machine=self.machine, features=self.features,
                           stage_slots=self.stage_slots,
                           prompt_bank=self.prompt_bank, little_k=self.mobile_k,
                           gamma=self.gamma, little_resident=self.little_resident,
                           host_budget=host, device_budgets=per_device)


@dataclass
class CacheConfig:
    """How a run places routed experts: a policy and how much device memory it may use.

    Exactly one of ``gpu_budget`` (bytes for everything on the device), ``device_budgets`` (the
    same for each device llama.cpp puts layers on, in device order; one: all of them together),
    ``cache_fraction`` (share of each layer's experts in slots) or ``slots_per_layer`` sizes the
    cache; ``offload`` needs none.
    """

    # None: nobody named one, and the load chooses (``before.plan_load``: promoe or ncmoe,
    # whichever is expected faster; DEFAULT_POLICY where there is nothing to choose)
    policy: str | None = "offload"
    gpu_budget: int | None = None
    cache_fraction: float | None = None
    slots_per_layer: int | None = None
    profile: np.ndarray | None = None  # static: routed counts [n_layer, n_expert]
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    on_route: RouteCallback | None = None  # sees every routing decision (see ExpertCache)
    features: Features = field(default_factory=Features)  # promoe's (and infinity's) techniques
    predictor: str = Options.predictor  # promoe: one of PREDICTORS
    window: int | None = None  # promoe: prediction distance; default: the trained one
    machine: str | None = None  # promoe: profile the split's costs start from (None: default)
    # promoe/infinity: stage slots for prompt passes (None: prefetcher.stage_slots's rule: on a
    # GPU, none on a CPU build, where slots are host memory too); held back from a gpu_budget
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
    gamma: float = Options.gamma
    little_resident: bool = False
    # host memory for the model's experts (with its non-expert weights on the host): the experts
    # beyond it stay in the file and the disk tier reads them (None: every expert in memory)
    host_budget: int | None = None
    device_budgets: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        spec = self.spec
        if self.host_budget is not None and spec.placement != "slots":
            raise ValueError(f"{setting('host_budget')} runs in forecache's expert cache, and "
                             f"policy {spec.name} reads every expert from memory: use "
                             f"{setting('policy', 'promoe')}, infinity or lru")
        sizes = [x for x in (self.gpu_budget, self.cache_fraction, self.slots_per_layer,
                             self.device_budgets) if x is not None]
        if self.device_budgets is not None and (spec.placement not in ("slots", "layers") or
                                                self.host_budget is not None):
            raise ValueError(f"a {setting('gpu_budget')} per device sizes the slots of a cached "
                             f"policy (promoe, infinity, lru, ...) or ncmoe's host layers, "
                             f"without {setting('host_budget')}; not {spec.name}"
                             f"{' with a disk tier' if self.host_budget is not None else ''}")
        if len(sizes) > 1:
            raise ValueError(f"give one of {setting('gpu_budget')} and "
                             f"{setting('cache_fraction')}, not both")
        if spec.placement != "host" and not sizes:
            raise ValueError(f"policy {spec.name} needs {setting('gpu_budget')} or "
                             f"{setting('cache_fraction')}")
        if spec.placement == "layers" and self.gpu_budget is None and \
                self.device_budgets is None:
            raise ValueError(f"policy ncmoe places whole layers and needs {setting('gpu_budget')}")
        if self.little_k and not 0.0 <= self.gamma <= 1.0:
            raise ValueError(f"{setting('gamma')} is {self.gamma}: give a probability in [0, 1]")

    @property
    def spec(self) -> PolicySpec:
        """The placement ``policy`` names; before the load's choice, the default's own."""
        return policy_spec(self.policy or DEFAULT_POLICY)


# Device memory left free when the budget is taken from the GPU's free memory: other processes,
# the driver's own allocations and fragmentation.
AUTO_BUDGET_RESERVE = 0.05
# a CPU-only build's share of each layer's experts in slots when only a host budget is given
DISK_CPU_SLOT_FRACTION = 0.125
AUTO_BUDGET_MIN_RESERVE = 512 << 20


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


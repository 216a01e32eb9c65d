"""``forecache.Llama``: llama-cpp-python's ``Llama`` with forecache's expert placement and cache.

A script written for ``llama_cpp.Llama`` switches by changing its import: every method
(``create_completion``, ``create_chat_completion``, ``__call__``, ``tokenize``, ...) is
llama-cpp-python's own, so return shapes and streaming are the same. What differs is how the
model is loaded: routed experts stay in host memory and a policy keeps the ones the coming layers
need in device slots, within ``gpu_budget`` (on a GPU by default ``promoe``, or stock llama.cpp's
``--n-cpu-moe`` placement where that is expected to decode faster).
"""

from __future__ import annotations

import codecs
import ctypes
import dataclasses
import functools
import os
import re
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from forecache.cache.budget import device_slots, format_size
from forecache.cache.choice import Choice
from forecache.cache.cost import CostModel
from forecache.cache.disk import experts_left_on_disk, probe_expert_reads, readers_default
from forecache.cache.measured import record_run
from forecache.cache.policies import hit_rate
from forecache.cache.prefetcher import stage_slots
from forecache.cache.runtime import ExpertCache
from forecache.cache.setup import (
    CacheConfig,
    Placement,
    attach,
    attach_observer,
    default_choice,
    expert_overrides,
    make_policy,
    ncmoe_per_device,
    place,
    resolve_cache_config,
    spread_budget,
)
from forecache.diskprobe import DiskRate
from forecache.errors import setting
from forecache.generate import Streamed
from forecache.gguf.header import ModelFile, require_moe
from forecache.models.names import resolve_model_arg
from forecache.native import llama_cpp_module, llama_cpp_package, patch_version
from forecache.native.cache_api import SLOT_EMPTY
from forecache.native.ggml_devices import Device, layer_split, local_gpus
from forecache.native.libs import MAX_THREADS, ModelLoadError, api
from forecache.native.log import LOG_ERROR, abort_in_one_line, load_log
from forecache.native.rpc import RPCError, add_servers, parse_endpoints
from forecache.speculative.speculator import SpecStats, Speculator, sampler_for
from forecache.trace.replay import ReplayError, Routing, RoutingReplay, load_routing

llama_cpp = llama_cpp_package()  # after checking that the build fits this CPU

# Text routed once to build the static policy's profile when none is given.
CALIBRATION_TEXT = (
    "The history of science is the study of how people came to understand the natural world: "
    "measuring the stars, mixing metals, growing crops, curing illness and writing it all down. "
)
# llama.cpp log lines that mean an allocation failed during load
_OOM = re.compile(r"out of memory|insufficient memory|failed to allocate|unable to allocate|"
                  r"cudaMalloc failed|cannot allocate|ErrorOutOfDeviceMemory", re.IGNORECASE)


class _Auto:
    """Marker: choose the cache configuration from the keyword arguments and the device."""


AUTO: Any = _Auto()


def top_probability(logits: np.ndarray) -> float:
    """The largest softmax probability of ``logits``: 1 / sum(exp(z - max z)), in one pass."""
    return 1.0 / float(np.exp(logits - logits.max(), dtype=np.float64).sum())


class Llama(llama_cpp.Llama):
    """A drop-in for ``llama_cpp.Llama`` that runs MoE GGUF models with forecache's expert cache.

    ``model_path`` is a GGUF file or, as a string, any name the command line's ``-m`` takes
    (``"default"``: the built-in default model; `forecache models` lists the names).
    ``policy`` (promoe, infinity, lru, lfu, static, ncmoe, offload), ``gpu_budget`` (bytes or a
    size such as ``"24GiB"``: all device memory the run may use) and ``cache_fraction`` (share
    of each layer's experts in slots) choose the placement. Without a policy, the budget
    (default: the GPU's free memory) goes to promoe where ``cache.choice`` expects it to decode
    1.2x faster than ncmoe, else to ncmoe (``policy_choice`` says which and why); a CPU-only
    build given none of them
    keeps llama.cpp's own placement (device and host are the same memory).
    ``predictor``, ``window`` and ``machine`` tune promoe. ``mode="mobile"`` (MoBiLE, lossy)
    decodes each token with a little pass over ``little_k`` experts (default half the model's)
    and recomputes it with the full model when the little pass's top probability is below
    ``gamma``; ``little_resident`` keeps only the top expert and those already on the device
    (of the top ``little_k``, default all); ``"exact"`` (the default) is the model as it is.
    ``n_seq_max`` sizes the context for that many sequences decoded together, each with
    n_ctx / n_seq_max of the context (``forecache batch``). ``host_budget`` (bytes or a size):
    host memory for the model's weights that stay on the host, its experts included; experts
    beyond it stay in the GGUF file and the disk tier reads them as they are needed (a model
    larger than host memory). ``routing_trace`` (benchmarks only)
    replays a trace's routing (a path, or a ``Routing`` already mapped onto this model) in every
    expert matmul instead of the router's (``trace.replay``;
    the tokens are then meaningless, and each batch is one ubatch). ``cache`` passes a ready
    ``CacheConfig`` (or None for no cache). Every other keyword goes to ``llama_cpp.Llama``;
    ``n_gpu_layers`` defaults to all layers when a cache is used.
    """

    def __init__(self, model_path: str | os.PathLike[str], *, gpu_budget: int | str | None = None,
                 policy: str | None = None, cache_fraction: float | None = None,
                 predictor: str = "auto", window: int | None = None, machine: str | None = None,
                 mode: str = "exact", gamma: float = 0.7, little_k: int | None = None,
                 little_resident: bool = False, draft: str | None = None,
                 draft_k: int | None = None, n_seq_max: int = 1,
                 host_budget: int | str | None = None,
                 cache: CacheConfig | None = AUTO,
                 routing_trace: str | os.PathLike[str] | Routing | None = None,
                 rpc: str | Sequence[str] | None = None,
                 **kwargs: Any) -> None:
        self.expert_cache: ExpertCache | None = None
        self.replay: RoutingReplay | None = None
        self._spec: Speculator | None = None
        # MoBiLE: (little-pass experts, gamma, resident experts only)
        self._mobile: tuple[int, float, bool] | None = None
        # little passes, big passes (fallbacks), copies the big passes prefetched: since reset_stats
        self.mobile_passes = [0, 0, 0]
        for key in ("n_threads", "n_threads_batch"):
            n = kwargs.get(key)
            if n is not None and not 1 <= int(n) <= MAX_THREADS:
                raise ValueError(f"{key}={n}: use 1 to {MAX_THREADS} (or None: every core)")
        model_path = resolve_model_arg(model_path)  # a name, as -m takes it, or a path
        self.model_file: ModelFile = require_moe(model_path)
        patch_version()  # refuses a stock llama-cpp-python before llama.cpp touches the file
        abort_in_one_line()
        if mode not in ("exact", "mobile"):
            raise ValueError(f"{setting('mode')} {mode!r}: use 'exact' or 'mobile'")
        if draft is not None and (mode == "mobile" or
                                  isinstance(cache, CacheConfig) and cache.little_k):
            raise ValueError(f"{setting('draft')} and {setting('mode')} mobile: choose one "
                             "(speculation is exact, mobile decoding is not)")
        if mode == "mobile" and cache is not AUTO:
            raise ValueError(f"{setting('mode')} goes with the policy keywords; with "
                             f"{setting('cache')} set CacheConfig(little_k=..., gamma=...)")
        if cache is AUTO:
            cache = resolve_cache_config(policy, gpu_budget, cache_fraction, predictor=predictor,
                                         window=window, machine=machine,
                                         little_k=(little_k or -1) if mode == "mobile" else 0,
                                         gamma=gamma, little_resident=little_resident,
                                         host_budget=host_budget)
        elif host_budget is not None:
            raise ValueError(f"{setting('host_budget')} goes with the policy keywords; with "
                             f"{setting('cache')} set CacheConfig(host_budget=...)")
        self.rpc: list[str] = (parse_endpoints(rpc) if isinstance(rpc, str) else list(rpc)) \
            if rpc else []
        if self.rpc:
            cache = self._rpc_placement(cache)
            kwargs.setdefault("n_gpu_layers", -1)  # the servers' devices take the layers
        elif cache is not None and len(local_gpus()) > 1:
            cache = spread_budget(cache)  # llama.cpp splits the layers over every GPU
        self.placement: Placement | None = None
        # per model layer, the device whose link the split prices that layer's copies by
        # (None: the cache's own device for every layer)
        self.split_devices: list[Device | None] | None = None
        self.disk_rate: DiskRate | None = None  # the disk tier's reads, measured at start
        n_ctx = int(kwargs.get("n_ctx", 512)) or int(self.model_file.arch_kv("context_length",
                                                                            4096))
        n_ubatch = min(int(kwargs.get("n_batch", 512)), int(kwargs.get("n_ubatch", 512)))
        if routing_trace is not None:
            if draft is not None or (cache is not None and cache.little_k):
                raise ValueError(f"{setting('routing_trace')} replays every expert of the "
                                 f"trace's rows: it cannot go with {setting('draft')} or "
                                 "MoBiLE's little pass, which choose experts or rows of their own")
            # a replayed routing is set per ubatch: every llama_decode must be one
            kwargs.update(n_batch=n_ubatch, n_ubatch=n_ubatch)
            routing = routing_trace if isinstance(routing_trace, Routing) else load_routing(
                routing_trace, n_layers=len(self.model_file.moe_layers()),
                n_expert=self.model_file.n_expert, top_k=self.model_file.n_expert_used)
            if cache is not None and cache.spec.needs_profile and cache.profile is None:
                # the hottest experts of the routing replayed, not of the model's own
                cache = dataclasses.replace(cache, profile=routing.counts(
                    self.model_file.moe_layers(), self.model_file.n_layer,
                    self.model_file.n_expert))
        # the default placement is never expected to decode slower than --n-cpu-moe
        self.policy_choice: Choice | None = None
        if cache is not None:
            self.policy_choice = default_choice(
                self.model_file, cache, n_ctx=n_ctx, n_ubatch=n_ubatch,
                routing_hit=routing.decode_hit_rate if routing_trace is not None else None)
            if self.policy_choice is not None:
                chosen = self.policy_choice
                cache = dataclasses.replace(cache, policy=chosen.policy)
                if chosen.policy != "ncmoe" and cache.prompt_bank is None:
                    # the banks the choice weighed (perhaps over their default share)
                    cache = dataclasses.replace(cache, prompt_bank=chosen.shape.bank)
        self.cache_config: CacheConfig | None = cache
        split: list[int] | None = None  # where llama.cpp will put each layer (ncmoe per device)
        if cache is not None:
            kwargs.setdefault("n_gpu_layers", -1)
            if ncmoe_per_device(cache):
                split = layer_split(self.model_file.n_layer, int(kwargs["n_gpu_layers"]),
                                    kwargs.get("tensor_split"))
            self.placement = place(self.model_file, cache, n_ctx=n_ctx, n_ubatch=n_ubatch,
                                   layer_dev=split)
        verbose = bool(kwargs.get("verbose", True))
        on_disk = self.placement is not None and self.placement.disk is not None
        if on_disk:  # the other weights read into memory, not faulted in from the file's pages
            kwargs.setdefault("use_mmap", False)
        with load_log(not verbose) as log, experts_left_on_disk(on_disk):
            try:
                super().__init__(str(model_path), **kwargs, **self._load_params(n_seq_max))
            except (ValueError, RuntimeError) as e:
                failure = e
            else:
                failure = None
        if failure is not None:
            raise ModelLoadError(self._load_failure(failure, log)) from failure
        self.n_seq_max = n_seq_max
        low = llama_cpp_module()
        self._vocab = low.llama_model_get_vocab(self.model)
        if split is not None:
            self._check_split(split)
        if cache is not None and cache.device_budgets is not None and cache.spec.cached:
            self._size_per_device(cache, n_ctx, n_ubatch)
        if cache is not None and cache.spec.cached:
            self._attach_cache(cache)
        if routing_trace is not None:
            self._attach_replay(routing, n_ubatch)
        if cache is not None and cache.little_k:
            self._mobile = (self._little_k(cache.little_k, cache.little_resident), cache.gamma,
                            cache.little_resident)
        if (draft is not None or self._mobile is not None) and self.is_recurrent:
            self.close()
            raise ValueError(
                f"{self.model_file.path.name} ({self.model_file.arch}) keeps a recurrent state, "
                f"which llama.cpp cannot take back to an earlier token: "
                f"{setting('draft') if draft is not None else setting('mode', 'mobile')} "
                "recomputes tokens and needs that; run without it")
        if draft is not None:
            self._spec = self._speculator(draft, draft_k)

    def _rpc_placement(self, cache: CacheConfig | None) -> CacheConfig | None:
        """Register the RPC servers (before the model loads: llama.cpp then splits its layers
        over their devices) and check the placement asked for runs over them: llama.cpp's own
        (no policy: the default), offload, or an expert cache whose slots go on the device each
        layer lives on, sized by a fraction or a budget per device (one size: their total).
        ncmoe's host layers are fitted to each device's budget from llama.cpp's split."""
        if cache is not None and not cache.auto:
            cache = spread_budget(cache)  # a single size is the devices' total
        try:
            add_servers(self.rpc)
        except RPCError as e:
            raise ModelLoadError(str(e)) from e
        return None if cache is None or cache.auto else cache

    @property
    def is_recurrent(self) -> bool:
        """The model keeps a recurrent state (a state-space or convolution layer): llama.cpp
        cannot remove its last tokens from a sequence."""
        low = llama_cpp_module()
        return bool(low.llama_model_is_recurrent(self.model) or
                    low.llama_model_is_hybrid(self.model))

    def _speculator(self, draft: str, draft_k: int | None) -> Speculator:
        """Speculative decoding with ``draft`` (closing the model on a bad one)."""
        try:
            return Speculator(self, draft, draft_k)
        except ValueError:
            self.close()
            raise

    @property
    def speculator(self) -> Speculator | None:
        """Speculative decoding's draft, draft length and counters, or None without a draft."""
        return self._spec

    @property
    def mobile(self) -> tuple[int, float, bool] | None:
        """MoBiLE decoding's settings (little-pass experts, gamma, resident experts only), or
        None for exact decoding."""
        return self._mobile

    def _little_k(self, little_k: int, resident: bool) -> int:
        """The little pass's experts per token: ``little_k``, or for -1 half the top-k (all of
        it when the pass keeps only resident experts, which is what shrinks it then)."""
        k = self.model_file.n_expert_used
        top = k if resident else k - 1
        m = (k if resident else k // 2) if little_k < 0 else little_k
        if self.expert_cache is None:
            policy = self.cache_config.policy if self.cache_config else "none"
            self.close()
            raise ValueError("MoBiLE decoding runs in forecache's expert cache, which this run "
                             f"does not have (policy {policy}); give {setting('policy')} promoe "
                             "(or lru, lfu, static, infinity)")
        if not 1 <= m <= top:
            self.close()
            raise ValueError(f"{setting('little_k')} {m}: the little pass routes 1 to {top} of "
                             f"the {k} experts {self.model_file.path.name} routes per token")
        return m

    @functools.wraps(llama_cpp.Llama.eval)
    def eval(self, tokens: Sequence[int]) -> None:
        # in MoBiLE decoding a generated token first runs the little pass and is recomputed by
        # the full model (its KV entry replaced) when the little pass's top probability is
        # below gamma
        if self._mobile is None or len(tokens) != 1 or self.expert_cache is None:
            return super().eval(tokens)
        m, gamma, resident = self._mobile
        n_past = self.n_tokens
        self.expert_cache.set_little(m, resident)
        try:
            super().eval(tokens)
        finally:
            self.expert_cache.set_little(0)
        self.mobile_passes[0] += 1
        ptr = llama_cpp_module().llama_get_logits_ith(self.ctx, -1)
        logits = np.ctypeslib.as_array(ptr, shape=(self.n_vocab(),))
        if top_probability(logits) < gamma:
            self.mobile_passes[2] += self.expert_cache.prefetch_little(
                self.model_file.n_expert_used)
            self.n_tokens = n_past  # eval drops the KV cells from here: the big pass's replace them
            super().eval(tokens)
            self.mobile_passes[1] += 1
        return None

    def _load_params(self, n_seq_max: int) -> dict[str, Any]:
        """llama_cpp.Llama keywords of forecache's placement and of ``n_seq_max`` sequences."""
        params = expert_overrides(self.placement) if self.placement else {}
        if n_seq_max > 1:
            # a KV stream per sequence: each sees its cells where it would alone, which keeps its
            # attention sums in the same order as a single-sequence run
            params.update(n_seq_max=n_seq_max, kv_unified=False)
        return params

    @classmethod
    def open(cls, model_path: str | os.PathLike[str], *, cache: CacheConfig | None,
             n_ctx: int = 4096, n_threads: int | None = None, n_seq_max: int = 1,
             n_gpu_layers: int = -1, verbose: bool = False, **kwargs: Any) -> Llama:
        """Load as forecache's commands do: ``n_ctx`` tokens per sequence, capped by the model's
        training context, every core for prompt and generation threads, and every layer on the
        GPU of a GPU build, with or without a cache."""
        threads = n_threads or os.cpu_count() or 1
        model_path = resolve_model_arg(model_path)
        per_seq = require_moe(model_path).fit_context(n_ctx)
        return cls(model_path, cache=cache, n_ctx=per_seq * n_seq_max, n_seq_max=n_seq_max,
                   n_threads=threads, n_threads_batch=threads, n_gpu_layers=n_gpu_layers,
                   verbose=verbose, **kwargs)

    def _load_failure(self, err: Exception, log: list[tuple[int, str]]) -> str:
        """One line for a failed load: out of memory (with a budget to try) or llama.cpp's own
        reason."""
        name = self.model_file.path.name
        oom = [text for _, text in log if _OOM.search(text)]
        if oom:
            cfg = self.cache_config
            dev = self.placement.device if self.placement else None
            if dev is not None and dev.type != "cpu":
                budget = cfg.gpu_budget if cfg and cfg.gpu_budget else dev.memory_free
                return (f"out of memory while loading {name} ({oom[0]}): try a smaller "
                        f"{setting('gpu_budget')}, e.g. {format_size(int(budget * 0.8))}, or a "
                        f"shorter {setting('n_ctx')}")
            return (f"out of memory while loading {name} ({oom[0]}): lower {setting('n_ctx')} "
                    "or free host memory")
        errors = [text for level, text in log if level == LOG_ERROR and text]
        detail = f" ({errors[-1]})" if errors else ""
        return (f"llama.cpp could not load {name}: {err}{detail}; run with "
                f"{setting('verbose', True)} for llama.cpp's log")

    def _size_per_device(self, cfg: CacheConfig, n_ctx: int, n_ubatch: int) -> None:
        """Slots for each layer from each device's budget, now that llama.cpp has put the layers
        on devices (``budget.device_slots``); a budget too small is refused in one line."""
        from forecache.native.ggml_devices import devices

        assert self.placement is not None and cfg.device_budgets is not None
        layer_dev = self._layer_devices()
        if layer_dev is None:
            self.close()
            raise ModelLoadError("cannot tell which device holds each of the "
                                 f"{self.model_file.n_layer} layers")
        names = {d.index: d.name for d in devices()}
        try:
            slots = device_slots(self.model_file, cfg.device_budgets, layer_dev, names,
                                 n_ctx=n_ctx, n_ubatch=n_ubatch)
            # held back on every device
            stage = stage_slots(self.model_file.n_expert, slots, given=cfg.stage_slots,
                                streams=cfg.spec.proactive and cfg.features.reorder)
            if stage:
                slots = device_slots(self.model_file, cfg.device_budgets, layer_dev, names,
                                     n_ctx=n_ctx, n_ubatch=n_ubatch, held=stage)
        except ValueError:
            self.close()
            raise
        # a policy moving slots between layers (infinity) moves them within each device
        by_dev: dict[int, list[int]] = {}
        for il in self.model_file.moe_layers():
            by_dev.setdefault(layer_dev[il], []).append(il)
        slots = cfg.spec.policy.layer_slots(self.model_file, slots, list(by_dev.values()))
        self.placement = dataclasses.replace(self.placement, n_slots=slots, stage_slots=stage)

    def _check_split(self, split: list[int]) -> None:
        """ncmoe's host layers were fitted to ``split``, the layer split predicted before the
        load: refuse a load whose layers went elsewhere (the budgets would not hold)."""
        from forecache.native.ggml_devices import devices

        got = self._llama_layer_devices()
        if got != split[:self.model_file.n_layer]:
            names = {d.index: d.name for d in devices()}
            where = [names.get(d, "CPU") for d in got or []] or ["devices it does not report"]
            self.close()
            raise ModelLoadError(f"llama.cpp put the layers on {', '.join(where)}, not where "
                                 "ncmoe's budget per device was fitted; give each device's "
                                 "share with tensor_split")

    def _llama_layer_devices(self) -> list[int] | None:
        """The ggml device index of each layer's non-expert weights as llama.cpp put them, -1
        for host memory (None if the C side cannot tell)."""
        n_layer = self.model_file.n_layer
        arr = (ctypes.c_int32 * n_layer)()
        return list(arr) if api().layer_devices(self.ctx, arr, n_layer) == 0 else None

    def _layer_devices(self) -> list[int] | None:
        """The ggml device index each layer's slots go on: the device llama.cpp put the layer
        on, or the cache's own for a layer in host memory (None if the C side cannot tell)."""
        assert self.placement is not None
        got = self._llama_layer_devices()
        return None if got is None else [d if d >= 0 else self.placement.device.index for d in got]

    def _split_devices(self) -> list[Device | None] | None:
        """Per model layer, the device whose link the host/device split prices the layer's
        copies by: where llama.cpp put layers on other devices than the cache's own (RPC
        servers, other GPUs), the device holding the layer's slots, each of which the split then
        prices by its own measured link; None where every layer's slots are on the cache's own
        device."""
        from forecache.native.ggml_devices import devices

        assert self.placement is not None
        local = self.placement.device
        if not self.rpc and len(local_gpus()) < 2:
            return None
        layer_dev = self._layer_devices()
        if layer_dev is None:
            return None
        moe = set(self.model_file.moe_layers())
        by_index = {dev.index: dev for dev in devices()}
        out = [by_index.get(d) if il in moe and self.placement.n_slots[il] > 0 else None
               for il, d in enumerate(layer_dev)]
        if all(d is None or d.index == local.index for d in out):
            return None
        return out

    def split_costs(self) -> dict[str, dict[str, float]]:
        """Each device the host/device split prices, with what it prices now: its copy rate
        (``copy_gbps``) and its expert groups' measured over modelled compute time
        (``device_scale``; 1 where not measured); empty without a split."""
        cache = self.expert_cache
        policy = cache.policy if cache is not None else None
        if policy is None or policy.cost is None:
            return {}

        def row(c: CostModel) -> dict[str, float]:
            return {"copy_gbps": c.copy_gbps, "device_scale": c.dev_scale}

        if not self.split_devices:
            name = self.placement.device.name if self.placement is not None else "device"
            return {name: row(policy.cost)}
        out: dict[str, dict[str, float]] = {}
        for il, dev in enumerate(self.split_devices):
            cost = policy.cost_for(il)
            if dev is not None and cost is not None:
                out.setdefault(dev.name, row(cost))
        return out

    def _attach_cache(self, cfg: CacheConfig) -> None:
        assert self.placement is not None
        if cfg.spec.needs_profile and cfg.profile is None:
            cfg.profile = self.routing_profile(self.tokenize(CALIBRATION_TEXT.encode() * 2), 16)
        if self.placement.disk is not None:  # the file's read rate, for the split's costs
            try:
                self.disk_rate = probe_expert_reads(self.model_file, readers_default())
            except OSError as e:
                self.close()
                raise ModelLoadError(f"cannot read the experts of {self.model_file.path}: {e}; "
                                     "the disk tier reads them from the file") from e
        self.split_devices = self._split_devices()
        self.expert_cache = attach(self.ctx, self.placement, cfg,
                                   make_policy(cfg, self.placement.n_slots, self.model_file,
                                               self.placement.device, self.disk_rate,
                                               self.split_devices),
                                   self.model_file,
                                   say=lambda msg: print(msg, file=sys.stderr))
        cache = self.expert_cache  # predictors that read token ids get each batch's

        def on_batch(tokens: Sequence[int]) -> None:
            cache.begin_ubatch(np.asarray(tokens, dtype=np.int32))

        self.on_batch = on_batch
        self.expert_cache.wait_idle()  # the static policy's pinned experts
        self.expert_cache.reset_stats()

    def routing_profile(self, tokens: list[int], n_gen: int) -> np.ndarray:
        """Routed-expert counts [n_layer, n_expert] of a greedy run over ``tokens``, computed from
        host memory with an observing hook."""
        assert self.placement is not None
        mf = self.model_file
        counts = np.zeros((mf.n_layer, mf.n_expert), dtype=np.int64)

        def count(layer: int, ids: np.ndarray, _w: object, _x: object) -> None:
            np.add.at(counts[layer], ids.ravel(), 1)

        observer = attach_observer(self.ctx, mf, self.placement.device.index, count)
        try:
            for i, _ in enumerate(self.generate(tokens, temp=0.0, reset=True)):
                if i + 1 >= n_gen:
                    break
        finally:
            observer.close()
            self.reset()
            self._ctx.kv_cache_clear()  # reset() only rewinds: low-level decoding needs no cells
        return counts

    def format_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True,
                    ) -> str:
        """Render chat messages with the model's own template (tokenizer.chat_template in the
        GGUF), ending with the assistant's turn opened when ``add_generation_prompt``."""
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter

        template = self.metadata.get("tokenizer.chat_template")
        if not template:
            raise ValueError(f"{self.model_file.path.name} has no chat template "
                             "(tokenizer.chat_template); use a plain prompt instead")
        eos, bos = self.token_eos(), self.token_bos()
        fmt = Jinja2ChatFormatter(template, self._model.token_get_text(eos) if eos >= 0 else "",
                                  self._model.token_get_text(bos) if bos >= 0 else "",
                                  add_generation_prompt=add_generation_prompt)
        return fmt(messages=messages).prompt

    @functools.wraps(llama_cpp.Llama.generate)
    def generate(self, tokens: Any, *args: Any, **kwargs: Any) -> Iterator[int]:
        # every completion, chat and stream passes here: the predictor sees request boundaries
        worker = self.expert_cache.worker if self.expert_cache is not None else None
        if self.expert_cache is not None:
            self.expert_cache.policy.begin_request()
        if worker is not None:
            worker.begin_request()
        # llama-cpp-python makes a new sampler chain for every generation and drops the old one,
        # which a reference cycle (its free callback holds the object) keeps alive until a full
        # garbage collection, with an n_vocab-sized buffer (1.8 MB for a 151k vocabulary): free
        # it now.
        if self._sampler is not None:
            self._sampler.close()
            self._sampler = None
        # with a draft, llama-cpp-python's generator gives way to the speculative one wherever
        # its sampler settings can be reproduced (not typical, mirostat, grammars, processors)
        sampler = sampler_for(kwargs, self.last_n_tokens_size) \
            if self._spec is not None and not args else None
        try:
            if self._spec is not None and sampler is not None:
                return (yield from self._spec.generate(self, tokens, sampler,
                                                       bool(kwargs.get("reset", True)),
                                                       self._seed))
            return (yield from super().generate(tokens, *args, **kwargs))
        finally:
            if worker is not None:
                worker.end_request()

    def stream(self, tokens: list[int], max_tokens: int, out: Streamed, *,
               ignore_eos: bool = False, stop: object = None, **sampling: Any) -> Iterator[str]:
        """Generate up to ``max_tokens`` after ``tokens`` (reusing the KV cache of a common
        prefix), yielding text as it completes UTF-8 characters; ``out`` receives the tokens and
        the finish reason. A true ``stop`` (checked before each token) ends it early."""
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        cache = self.expert_cache
        gen = self.generate(tokens, reset=True, **sampling)
        try:
            for tok in gen:
                if stop:
                    out.finish = "interrupted"
                    break
                if cache is not None:
                    cache.check_interrupt()
                if out.t_first is None:
                    out.t_first = time.perf_counter()
                if not ignore_eos and self.is_eog(tok):
                    out.finish = "stop"
                    break
                out.tokens.append(tok)
                piece = decoder.decode(self.detokenize([tok],
                                                       prev_tokens=tokens + out.tokens[:-1]))
                if piece:
                    yield piece
                if len(out.tokens) >= max_tokens:
                    break
        finally:
            gen.close()
        tail = decoder.decode(b"", final=True)
        if tail:
            yield tail

    def complete(self, tokens: list[int], max_tokens: int,
                 on_text: Callable[[str], None] | None = None, **kwargs: Any) -> Streamed:
        """``stream`` to the end, handing each piece of text to ``on_text``; the result has the
        whole text and the start and end times."""
        out = Streamed(t_start=time.perf_counter())
        pieces: list[str] = []
        for piece in self.stream(tokens, max_tokens, out, **kwargs):
            pieces.append(piece)
            if on_text:
                on_text(piece)
        out.text = "".join(pieces)
        out.t_end = time.perf_counter()
        return out

    def is_eog(self, token: int) -> bool:
        """Whether ``token`` ends a generation (EOS, EOT, <|im_end|>, ...)."""
        return bool(llama_cpp_module().llama_vocab_is_eog(self._vocab, token))

    def expert_stats(self) -> dict:
        """Expert-cache counters since the last ``reset_stats()``: policy, hits, misses,
        hit_rate, bytes copied host-to-device, stall time, gate-hook time and calls, time and
        count of the gates decided in C (``decode_gate_s``, ``decode_gates``), and the
        device slots (total, filled, bytes); layer passes computed from prompt banks
        (``banked``) and the bytes copied into them from host memory (``bank_bytes``). Zeros,
        with policy ``none``, when the model runs without a cache."""
        cfg = self.cache_config
        out: dict = {"policy": cfg.policy if cfg else "none",
                     "mode": "mobile" if self._mobile else "exact", "hits": 0, "misses": 0,
                     "hit_rate": None, "h2d_bytes": 0, "stall_s": 0.0, "copy_s": 0.0,
                     "hook_s": 0.0, "hook_calls": 0, "decode_gate_s": 0.0, "decode_gates": 0,
                     "host_layers": 0, "banked": 0, "bank_bytes": 0, "cache_slots": 0,
                     "slots_filled": 0,
                     "slot_bytes": 0, "device": self.placement.device.name if self.placement
                     else None}
        if self._mobile:
            out.update(little_k=self._mobile[0], gamma=self._mobile[1],
                       little_resident=self._mobile[2],
                       little_passes=self.mobile_passes[0], big_passes=self.mobile_passes[1],
                       little_prefetches=self.mobile_passes[2])
        if self._spec is not None:
            out.update(self._spec.stats_json())
        cache = self.expert_cache
        if cache is None:
            return out
        s = cache.stats()
        out.update({k: s[k] for k in ("hits", "misses", "h2d_bytes", "stall_s", "host_layers",
                                      "copy_s", "hook_s", "banked", "bank_bytes")})
        out["hook_calls"] = s["n_hook_calls"]
        out["decode_gate_s"], out["decode_gates"] = s["fast_s"], s["fast_gates"]
        out["hit_rate"] = hit_rate(s["hits"], s["misses"])
        out["cache_slots"] = cache.n_slots_total
        on = {info.device for info in cache.layers.values() if info.n_slots}
        if self.placement is not None and on != {self.placement.device.index}:
            # slots on the devices llama.cpp put the layers on (RPC servers' devices)
            from forecache.native.ggml_devices import devices

            per_device = cache.device_stats({d.index: d.name for d in devices()})
            out["device"] = ",".join(per_device)
            out["devices"] = per_device
        out["slots_filled"] = sum(int(np.count_nonzero(cache.layer_state(il)[1] != SLOT_EMPTY))
                                  for il, info in cache.layers.items() if info.n_slots)
        out["slot_bytes"] = sum(info.n_slots * info.expert_bytes for info in cache.layers.values())
        if cache.disk is not None:
            out.update({k: s[k] for k in ("disk_reads", "disk_bytes", "disk_direct_bytes",
                                          "disk_s", "disk_wait_s", "host_hits", "host_misses")})
            out["host_hit_rate"] = hit_rate(s["host_hits"], s["host_misses"])
        return out

    def _attach_replay(self, routing: Routing, n_ubatch: int) -> None:
        """Replay ``routing`` in place of the router's (after the cache, whose gate hook then
        sees the replayed ids)."""
        from forecache.native.ggml_devices import cache_device
        from forecache.native.libs import libllama

        replay = RoutingReplay(routing, self.model_file.moe_layers(), self.model_file.n_layer,
                               n_ubatch)
        try:
            replay.attach(libllama(), self.ctx, cache_device().index)
        except ReplayError:
            self.close()
            raise
        self.replay = replay
        before = self.on_batch

        def on_batch(tokens: Sequence[int]) -> None:
            replay.before_batch(len(tokens))
            if before is not None:
                before(tokens)

        self.on_batch = on_batch

    def reset_stats(self) -> None:
        """Zero the expert-cache counters (the cached experts stay)."""
        self.mobile_passes = [0, 0, 0]
        if self._spec is not None:
            self._spec.stats = SpecStats()
        if self.expert_cache is not None:
            self.expert_cache.reset_stats()

    def close(self) -> None:
        """Free the expert cache, then llama.cpp's context and model."""
        spec = getattr(self, "_spec", None)
        if spec is not None:
            spec.close()
            self._spec = None
        replay = getattr(self, "replay", None)
        if replay is not None:
            replay.close()  # before the cache: its hooks chain the cache's
            self.replay = None
        cache = getattr(self, "expert_cache", None)
        if cache is not None and replay is None:
            self._record_routing(cache)
        if cache is not None:
            cache.close()
            self.expert_cache = None
        if hasattr(self, "_stack"):
            super().close()

    def _record_routing(self, cache: ExpertCache) -> None:
        """Keep what a promoe run measured (decode hit rate, copy and CPU rates) for the next
        run's default placement (``cache.choice``)."""
        cfg, placement = self.cache_config, self.placement
        if cfg is None or cfg.policy != "promoe" or placement is None:
            return
        layers = self.model_file.moe_layers()
        share = min(placement.n_slots[il] for il in layers) / self.model_file.n_expert
        hits, misses = cache.decode_counts()
        try:
            record_run(self.model_file, placement.device.name, share, hits, misses,
                       cache.policy.cost)
        except OSError:
            pass  # the model file went away: nothing to key the record by

    def __enter__(self) -> Llama:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

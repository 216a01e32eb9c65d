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
import functools
import os
import re
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from forecache.cache.budget import format_size
from forecache.cache.choice import Choice
from forecache.cache.disk import experts_left_on_disk
from forecache.cache.measured import record_run
from forecache.cache.policies import hit_rate
from forecache.cache.runtime import ExpertCache
from forecache.diskprobe import DiskRate
from forecache.errors import setting
from forecache.generate import Streamed
from forecache.gguf.header import ModelFile, require_moe
from forecache.models.names import ModelNotFoundError, resolve_model_arg
from forecache.native import llama_cpp_module, llama_cpp_package, patch_version
from forecache.native.cache_api import SLOT_EMPTY
from forecache.native.ggml_devices import Device
from forecache.native.libs import ModelLoadError
from forecache.native.log import LOG_ERROR, abort_in_one_line, load_log
from forecache.placement.after import finish, priced_devices
from forecache.placement.before import LoadPlan, Placement, plan_load
from forecache.placement.build import attach_observer
from forecache.placement.options import AUTO, CacheConfig, Options
from forecache.speculative.acceptance import AcceptanceReplay
from forecache.speculative.speculator import SELF_DRAFTS, SpecStats, Speculator, sampler_for
from forecache.trace.replay import Routing, RoutingReplay

llama_cpp = llama_cpp_package()  # after checking that the build fits this CPU

# Text routed once to build the static policy's profile when none is given.
CALIBRATION_TEXT = (
    "The history of science is the study of how people came to understand the natural world: "
    "measuring the stars, mixing metals, growing crops, curing illness and writing it all down. "
)
# llama.cpp log lines that mean an allocation failed during load
_OOM = re.compile(r"out of memory|insufficient memory|failed to allocate|unable to allocate|"
                  r"cudaMalloc failed|cannot allocate|ErrorOutOfDeviceMemory", re.IGNORECASE)


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
    larger than host memory). ``acceptance_replay`` (benchmarks only, with a ``draft``:
    ``speculative.acceptance``) makes each verification accept as many drafts as a rate
    measured for a real pair of models says, its tokens then meaningless. ``routing_trace``
    (benchmarks only)
    replays a trace's routing (a path, or a ``Routing`` already mapped onto this model) in every
    expert matmul instead of the router's (``trace.replay``;
    the tokens are then meaningless, and each batch is one ubatch). ``cache`` passes a ready
    ``CacheConfig`` (or None for no cache). The others above are the fields of ``Options``
    (``placement.options``, which holds their defaults); ``options`` passes them ready, keywords
    beside it replacing its fields. Every other keyword goes to ``llama_cpp.Llama``;
    ``n_gpu_layers`` defaults to all layers when a cache is used. The load is planned before
    llama.cpp loads the model (``load_plan``: ``placement.before.plan_load``) and finished after
    it (``placement.after.finish``).
    """

    def __init__(self, model_path: str | os.PathLike[str], *, options: Options | None = None,
                 cache: CacheConfig | None = AUTO,
                 routing_trace: str | os.PathLike[str] | Routing | None = None,
                 acceptance_replay: AcceptanceReplay | str | None = None,
                 **kwargs: Any) -> None:
        self.expert_cache: ExpertCache | None = None
        self.replay: RoutingReplay | None = None
        self._spec: Speculator | None = None
        # MoBiLE: (little-pass experts, gamma, resident experts only)
        self._mobile: tuple[int, float, bool] | None = None
        # little passes, big passes (fallbacks), copies the big passes prefetched: since reset_stats
        self.mobile_passes = [0, 0, 0]
        # per model layer, the device whose link the split prices that layer's copies by
        # (None: the cache's own device for every layer)
        self.split_devices: list[Device | None] | None = None
        self.disk_rate: DiskRate | None = None  # the disk tier's reads, measured at start
        options = Options.take(kwargs, options)  # forecache's keywords; llama.cpp's stay
        if isinstance(acceptance_replay, str):
            acceptance_replay = AcceptanceReplay.parse(acceptance_replay)
        if acceptance_replay is not None and options.draft is None:
            raise ValueError("an acceptance replay replays how many of a draft's tokens each "
                             f"verification accepts: give {setting('draft')} too")
        self._acceptance = acceptance_replay
        if options.draft is not None and options.draft not in SELF_DRAFTS and \
                not os.path.isfile(options.draft):
            # a draft is named as a model is (a catalog name such as qwen2-0.5b-instruct,
            # OWNER/REPO[:QUANT] pulled, a path)
            try:
                options = replace(options, draft=str(resolve_model_arg(options.draft)))
            except ModelNotFoundError as e:
                raise ModelNotFoundError(f"{setting('draft', options.draft)}: {e}") from None
        if routing_trace is not None and options.draft in SELF_DRAFTS:
            # a model draft runs in a context of its own; a little pass routes the model itself
            raise ValueError(f"{setting('routing_trace')} replays every expert of the trace's "
                             f"rows: it cannot go with {setting('draft', options.draft)}, whose "
                             "little pass chooses experts of its own; give a draft model")
        self.model_file: ModelFile = require_moe(resolve_model_arg(model_path))
        patch_version()  # refuses a stock llama-cpp-python before llama.cpp touches the file
        abort_in_one_line()
        plan = self.load_plan = plan_load(self.model_file, options, cache, routing_trace, kwargs)
        self.placement: Placement | None = plan.placement  # as planned; as loaded after finish
        self._load(plan)
        try:
            self._finish(plan)
        except BaseException:
            self.close()
            raise

    def _load(self, plan: LoadPlan) -> None:
        """llama_cpp.Llama's load with ``plan``'s keywords; a failure in one line."""
        on_disk = plan.placement is not None and plan.placement.disk is not None
        with load_log(not plan.load_kwargs.get("verbose", True)) as log, \
                experts_left_on_disk(on_disk):
            try:
                super().__init__(str(self.model_file.path), **plan.load_kwargs)
            except (ValueError, RuntimeError) as e:
                failure = e
            else:
                failure = None
        if failure is not None:
            raise ModelLoadError(self._load_failure(failure, log)) from failure

    def _finish(self, plan: LoadPlan) -> None:
        """After the load: the placement as the load turned out, then the expert cache, the
        routing replayed, MoBiLE's little pass and the draft attached."""
        self._vocab = llama_cpp_module().llama_model_get_vocab(self.model)
        done = finish(self.ctx, self.model_file, plan, say=lambda msg: print(msg, file=sys.stderr),
                      profile=lambda: self.routing_profile(
                          self.tokenize(CALIBRATION_TEXT.encode() * 2), 16))
        self.placement, self.expert_cache = done.placement, done.cache
        self.split_devices, self.disk_rate = done.split_devices, done.disk_rate
        if done.cache is not None:
            cache = done.cache

            def on_batch(tokens: Sequence[int]) -> None:  # predictors that read token ids
                cache.begin_ubatch(np.asarray(tokens, dtype=np.int32))

            self.on_batch = on_batch
        cfg = self.cache_config
        if plan.routing is not None:
            self._attach_replay(plan.routing, plan.n_ubatch)
        if cfg is not None and cfg.little_k:
            self._mobile = (self._little_k(cfg.little_k, cfg.little_resident), cfg.gamma,
                            cfg.little_resident)
        draft = plan.options.draft
        if (draft is not None or self._mobile is not None) and self.is_recurrent:
            raise ValueError(
                f"{self.model_file.path.name} ({self.model_file.arch}) keeps a recurrent state, "
                f"which llama.cpp cannot take back to an earlier token: "
                f"{setting('draft') if draft is not None else setting('mode', 'mobile')} "
                "recomputes tokens and needs that; run without it")
        if draft is not None:
            self._spec = Speculator(self, draft, plan.options.draft_k, self._acceptance)

    @property
    def cache_config(self) -> CacheConfig | None:
        """The configuration the model runs (None: llama.cpp's own placement)."""
        return self.load_plan.cache

    @property
    def policy_choice(self) -> Choice | None:
        """The default placement's choice and why, when it chose."""
        return self.load_plan.choice

    @property
    def rpc(self) -> list[str]:
        """The RPC servers the layers were split over."""
        return self.load_plan.rpc

    @property
    def n_seq_max(self) -> int:
        """Sequences the context decodes together."""
        return self.load_plan.options.n_seq_max

    @property
    def is_recurrent(self) -> bool:
        """The model keeps a recurrent state (a state-space or convolution layer): llama.cpp
        cannot remove its last tokens from a sequence."""
        low = llama_cpp_module()
        return bool(low.llama_model_is_recurrent(self.model) or
                    low.llama_model_is_hybrid(self.model))

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
            raise ValueError("MoBiLE decoding runs in forecache's expert cache, which this run "
                             f"does not have (policy {policy}); give {setting('policy')} promoe "
                             "(or lru, lfu, static, infinity)")
        if not 1 <= m <= top:
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

    @classmethod
    def open(cls, model_path: str | os.PathLike[str], *, cache: CacheConfig | None = AUTO,
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

    def split_costs(self) -> dict[str, dict[str, float]]:
        """Each device the host/device split prices, with what it prices now: its copy rate
        (``copy_gbps``) and its expert groups' measured over modelled compute time
        (``device_scale``; 1 where not measured); empty without a split."""
        cache = self.expert_cache
        return priced_devices(cache.policy if cache is not None else None, self.placement,
                              self.split_devices)

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
                                      "copy_s", "hook_s", "hook_calls", "decode_gate_s",
                                      "decode_gates", "banked", "bank_bytes")})
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
        replay.attach(libllama(), self.ctx, cache_device().index)
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

"""Loading a GGUF MoE model on the patched llama.cpp and generating text from it."""

from __future__ import annotations

import codecs
import contextlib
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from forecache.bindings import llama_cpp_module, patch_version
from forecache.cache.runtime import ExpertCache
from forecache.cache.setup import (
    CacheConfig,
    Placement,
    attach,
    attach_observer,
    expert_overrides,
    make_policy,
    place,
)
from forecache.gguf_inspect import ModelFile, require_moe

# Text routed once to build the static policy's profile when none is given.
CALIBRATION_TEXT = (
    "The history of science is the study of how people came to understand the natural world: "
    "measuring the stars, mixing metals, growing crops, curing illness and writing it all down. "
)


class ModelLoadError(RuntimeError):
    """llama.cpp refused the model; the message says what to try."""


@dataclass
class SamplingParams:
    """How the next token is chosen; ``greedy`` overrides the rest."""

    greedy: bool = False
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0

    def llama_kwargs(self) -> dict:
        if self.greedy:
            return {"temp": 0.0, "repeat_penalty": 1.0}
        return {"temp": self.temperature, "top_k": self.top_k, "top_p": self.top_p,
                "min_p": self.min_p, "repeat_penalty": self.repeat_penalty}


@dataclass
class GenerationResult:
    """Generated token ids and text with their timings."""

    tokens: list[int]
    text: str
    prompt_tokens: int
    finish_reason: str  # "length" or "stop"
    ttft_s: float
    tpot_s: float
    stats: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {
            "tokens": self.tokens,
            "text": self.text,
            "finish_reason": self.finish_reason,
            "stats": {
                "prompt_tokens": self.prompt_tokens,
                "gen_tokens": len(self.tokens),
                "ttft_s": self.ttft_s,
                "tpot_s": self.tpot_s,
                **self.stats,
            },
        }


@contextlib.contextmanager
def _quiet_stderr(enabled: bool) -> Iterator[None]:
    """Silence llama.cpp's C-level log output (it writes to fd 2 directly)."""
    if not enabled:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


class Engine:
    """A loaded model: llama.cpp context plus the model file's header facts."""

    def __init__(self, model_path: str | os.PathLike[str], *, n_ctx: int = 4096,
                 n_threads: int | None = None, n_gpu_layers: int = -1, seed: int = 0,
                 n_batch: int = 512, verbose: bool = False,
                 cache: CacheConfig | None = None) -> None:
        self.model_file: ModelFile = require_moe(model_path)
        self.cache_config = cache
        self.expert_cache: ExpertCache | None = None
        self.placement: Placement | None = None
        patch_version()  # refuses a stock llama-cpp-python before llama.cpp touches the file
        from llama_cpp import Llama

        ctx_train = int(self.model_file.arch_kv("context_length", n_ctx) or n_ctx)
        self.n_ctx = min(n_ctx, ctx_train)
        threads = n_threads or os.cpu_count() or 1
        if cache is not None:
            self.placement = place(self.model_file, cache, n_ctx=self.n_ctx, n_ubatch=n_batch)
        try:
            with _quiet_stderr(not verbose), (expert_overrides(self.placement) if self.placement
                                              else contextlib.nullcontext()):
                self.llm = Llama(model_path=str(model_path), n_ctx=self.n_ctx, n_batch=n_batch,
                                 n_threads=threads, n_threads_batch=threads,
                                 n_gpu_layers=n_gpu_layers, seed=seed, verbose=verbose)
        except (ValueError, RuntimeError) as e:
            raise ModelLoadError(f"llama.cpp could not load {model_path}: {e} (run with "
                                 "--verbose for llama.cpp's log; check free memory)") from e
        low = llama_cpp_module()
        self._vocab = low.llama_model_get_vocab(self.llm.model)
        self._is_eog = low.llama_vocab_is_eog
        if cache is not None and cache.policy in ("lru", "static", "promoe"):
            self._attach_cache(cache)

    def _attach_cache(self, cfg: CacheConfig) -> None:
        assert self.placement is not None
        if cfg.policy == "static" and cfg.profile is None:
            cfg.profile = self.routing_profile(self.tokenize(CALIBRATION_TEXT * 2), 16)
        self.expert_cache = attach(self.llm.ctx, self.placement, cfg,
                                   make_policy(cfg, self.placement.n_slots, self.model_file,
                                               self.placement.device),
                                   self.model_file,
                                   say=lambda msg: print(msg, file=sys.stderr))
        if self.expert_cache.worker is not None:
            self._watch_batches(self.expert_cache)
        self.expert_cache.wait_idle()  # the static policy's pinned experts
        self.expert_cache.reset_stats()

    def _watch_batches(self, cache: ExpertCache) -> None:
        """Give the cache the token ids of each batch llama-cpp-python decodes (for predictors
        that use them); llama-cpp-python has no hook for it, so its batch setter is wrapped."""
        batch = self.llm._batch
        original = batch.set_batch

        def set_batch(batch, n_past, logits_all):  # type: ignore[no-untyped-def]
            cache.batch_tokens = np.asarray(batch, dtype=np.int32)
            return original(batch=batch, n_past=n_past, logits_all=logits_all)

        batch.set_batch = set_batch  # type: ignore[method-assign]

    def routing_profile(self, tokens: list[int], n_gen: int) -> np.ndarray:
        """Routed-expert counts [n_layer, n_expert] of a greedy run over ``tokens``, computed from
        host memory with an observing hook."""
        assert self.placement is not None
        counts = np.zeros((self.model_file.n_layer, self.model_file.n_expert), dtype=np.int64)

        def count(layer: int, ids: np.ndarray, _w: object, _x: object) -> None:
            np.add.at(counts[layer], ids.ravel(), 1)

        observer = attach_observer(self.llm.ctx, self.model_file, self.placement.device.index,
                                   count)
        try:
            self.generate(tokens, n_gen, SamplingParams(greedy=True), ignore_eos=True)
        finally:
            observer.close()
        return counts

    @property
    def path(self) -> Path:
        return self.model_file.path

    def tokenize(self, text: str, special: bool = True) -> list[int]:
        """Token ids of text (special tokens such as <|im_start|> are parsed)."""
        return self.llm.tokenize(text.encode("utf-8"), add_bos=True, special=special)

    def format_chat(self, messages: list[dict[str, str]]) -> str:
        """Render messages with the model's own chat template (tokenizer.chat_template)."""
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter

        template = self.llm.metadata.get("tokenizer.chat_template")
        if not template:
            raise ValueError(f"{self.path.name} has no chat template (tokenizer.chat_template)")
        model = self.llm._model
        eos, bos = self.llm.token_eos(), self.llm.token_bos()
        fmt = Jinja2ChatFormatter(template, model.token_get_text(eos) if eos >= 0 else "",
                                  model.token_get_text(bos) if bos >= 0 else "")
        return fmt(messages=messages).prompt

    def generate(self, prompt: str | list[int], max_tokens: int, sampling: SamplingParams,
                 on_text: Callable[[str], None] | None = None, ignore_eos: bool = False,
                 ) -> GenerationResult:
        """Prefill the prompt, then decode up to max_tokens, streaming text to on_text."""
        tokens = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        if not tokens:
            raise ValueError("the prompt is empty")
        if len(tokens) + max_tokens > self.n_ctx:
            raise ValueError(f"prompt ({len(tokens)} tokens) + {max_tokens} generated tokens "
                             f"exceed the context of {self.n_ctx}; use a shorter prompt, fewer "
                             "tokens or a larger --ctx")
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        out: list[int] = []
        pieces: list[str] = []
        finish = "length"
        t0 = time.perf_counter()
        t_first = t0
        worker = self.expert_cache.worker if self.expert_cache is not None else None
        if worker is not None:
            worker.begin_request()
        if max_tokens > 0:
            gen = self.llm.generate(tokens, reset=True, **sampling.llama_kwargs())
            for tok in gen:
                if self.expert_cache is not None:
                    self.expert_cache.check_interrupt()
                if not out:
                    t_first = time.perf_counter()
                if not ignore_eos and self._is_eog(self._vocab, tok):
                    finish = "stop"
                    break
                out.append(tok)
                piece = decoder.decode(self.llm.detokenize([tok], prev_tokens=tokens + out[:-1]))
                if piece:
                    pieces.append(piece)
                    if on_text:
                        on_text(piece)
                if len(out) >= max_tokens:
                    break
            gen.close()
        if worker is not None:
            worker.end_request()
        tail = decoder.decode(b"", final=True)
        if tail:
            pieces.append(tail)
            if on_text:
                on_text(tail)
        t_end = time.perf_counter()
        ttft = t_first - t0
        tpot = (t_end - t_first) / (len(out) - 1) if len(out) > 1 else 0.0
        return GenerationResult(out, "".join(pieces), len(tokens), finish, ttft, tpot,
                                self.cache_stats())

    def last_logits(self) -> np.ndarray:
        """A copy of the logits of the last token evaluated (n_vocab floats)."""
        low = llama_cpp_module()
        n_vocab = low.llama_vocab_n_tokens(self._vocab)
        ptr = low.llama_get_logits_ith(self.llm.ctx, -1)
        return np.ctypeslib.as_array(ptr, shape=(n_vocab,)).copy()

    def cache_stats(self) -> dict:
        """Expert-cache counters since the last reset (zeros without a cache)."""
        policy = self.cache_config.policy if self.cache_config else "none"
        out = {"policy": policy, "hits": 0, "misses": 0, "h2d_bytes": 0, "stall_s": 0.0,
               "cache_slots": 0, "host_layers": 0, "copy_s": 0.0, "hook_s": 0.0}
        if self.expert_cache is not None:
            s = self.expert_cache.stats()
            out.update({k: s[k] for k in ("hits", "misses", "h2d_bytes", "stall_s", "host_layers",
                                          "copy_s", "hook_s")})
            out["cache_slots"] = self.expert_cache.n_slots_total
        return out

    def close(self) -> None:
        """Free the llama.cpp model and context now rather than at garbage collection."""
        cache = getattr(self, "expert_cache", None)
        if cache is not None:
            cache.close()
            self.expert_cache = None
        llm = getattr(self, "llm", None)
        if llm is not None:
            llm.close()
            self.llm = None  # type: ignore[assignment]

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

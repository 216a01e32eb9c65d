"""Loading a GGUF MoE model on the patched llama.cpp and generating text from it."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from forecache.cache.runtime import ExpertCache
from forecache.cache.setup import CacheConfig, Placement
from forecache.gguf.header import ModelFile
from forecache.llama import Llama, ModelLoadError, Streamed  # noqa: F401  (re-exported)
from forecache.native import llama_cpp_module


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


class Engine:
    """A loaded model: llama.cpp context plus the model file's header facts."""

    def __init__(self, model_path: str | os.PathLike[str], *, n_ctx: int = 4096,
                 n_threads: int | None = None, n_gpu_layers: int = -1, seed: int = 0,
                 n_batch: int = 512, verbose: bool = False,
                 cache: CacheConfig | None = None) -> None:
        self.llm = Llama.open(model_path, cache=cache, n_ctx=n_ctx, n_threads=n_threads,
                              n_batch=n_batch, n_gpu_layers=n_gpu_layers, seed=seed,
                              verbose=verbose)
        self.n_ctx = self.llm.n_ctx()
        self.model_file: ModelFile = self.llm.model_file

    @property
    def cache_config(self) -> CacheConfig | None:
        return self.llm.cache_config

    @property
    def expert_cache(self) -> ExpertCache | None:
        return self.llm.expert_cache if self.llm is not None else None

    @property
    def placement(self) -> Placement | None:
        return self.llm.placement

    def routing_profile(self, tokens: list[int], n_gen: int) -> np.ndarray:
        """Routed-expert counts [n_layer, n_expert] of a greedy run over ``tokens``."""
        return self.llm.routing_profile(tokens, n_gen)

    @property
    def path(self) -> Path:
        return self.model_file.path

    def tokenize(self, text: str, special: bool = True) -> list[int]:
        """Token ids of text (special tokens such as <|im_start|> are parsed)."""
        return self.llm.tokenize(text.encode("utf-8"), add_bos=True, special=special)

    def format_chat(self, messages: list[dict[str, str]]) -> str:
        """Render messages with the model's own chat template (tokenizer.chat_template)."""
        return self.llm.format_chat(messages)

    def generate(self, prompt: str | list[int], max_tokens: int, sampling: SamplingParams,
                 on_text: Callable[[str], None] | None = None, ignore_eos: bool = False,
                 stop: object = None) -> GenerationResult:
        """Prefill the prompt, then decode up to max_tokens, streaming text to on_text; a true
        ``stop`` (a flag checked before each token) ends it early, finish reason "interrupted"."""
        tokens = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        if not tokens:
            raise ValueError("the prompt is empty")
        if len(tokens) + max_tokens > self.n_ctx:
            raise ValueError(f"prompt ({len(tokens)} tokens) + {max_tokens} generated tokens "
                             f"exceed the context of {self.n_ctx}; use a shorter prompt, fewer "
                             "tokens or a larger --ctx")
        if max_tokens > 0:
            done = self.llm.complete(tokens, max_tokens, on_text, ignore_eos=ignore_eos,
                                     stop=stop, **sampling.llama_kwargs())
        else:
            now = time.perf_counter()
            done = Streamed(t_start=now, t_end=now)
        t_first = done.t_first if done.t_first is not None else done.t_start
        out = done.tokens
        ttft = t_first - done.t_start
        tpot = (done.t_end - t_first) / (len(out) - 1) if len(out) > 1 else 0.0
        return GenerationResult(out, done.text, len(tokens), done.finish, ttft, tpot,
                                self.cache_stats())

    def last_logits(self) -> np.ndarray:
        """A copy of the logits of the last token evaluated (n_vocab floats)."""
        low = llama_cpp_module()
        n_vocab = low.llama_vocab_n_tokens(self.llm._vocab)
        ptr = low.llama_get_logits_ith(self.llm.ctx, -1)
        return np.ctypeslib.as_array(ptr, shape=(n_vocab,)).copy()

    def cache_stats(self) -> dict:
        """Expert-cache counters since the last reset (zeros without a cache)."""
        return self.llm.expert_stats()

    def close(self) -> None:
        """Free the llama.cpp model and context now rather than at garbage collection."""
        llm = getattr(self, "llm", None)
        if llm is not None:
            llm.close()
            self.llm = None  # type: ignore[assignment]

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

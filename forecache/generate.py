"""Generating text from a loaded ``forecache.Llama``: sampling settings, one completion with its
timings and the expert cache's counters, and the logits of the last token.

This module loads no llama.cpp when imported (the command line imports it to build its options);
llama.cpp is reached through the ``Llama`` passed in.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from forecache.errors import setting
from forecache.native import llama_cpp_module

if TYPE_CHECKING:
    from forecache.llama import Llama


@dataclass
class Streamed:
    """What ``Llama.stream`` generated: the tokens, why it ended and when the first came;
    ``Llama.complete`` adds the text and the start and end times."""

    tokens: list[int] = field(default_factory=list)
    finish: str = "length"  # "length", "stop" (end of generation) or "interrupted"
    t_first: float | None = None
    text: str = ""
    t_start: float = 0.0
    t_end: float = 0.0


@dataclass
class SamplingParams:
    """How the next token is chosen; ``greedy`` overrides the rest. The defaults are
    llama-cpp-python's ``generate()`` defaults, and the one place forecache states them."""

    greedy: bool = False
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0

    def llama_kwargs(self) -> dict:
        """These settings as llama-cpp-python's sampling keyword arguments."""
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
    finish_reason: str  # "length", "stop" or "interrupted"
    ttft_s: float
    tpot_s: float
    stats: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        """The result as ``forecache generate --json`` prints it."""
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


def text_tokens(llm: Llama, text: str, special: bool = True) -> list[int]:
    """Token ids of ``text`` with the model's BOS first; special tokens such as <|im_start|> are
    parsed unless ``special`` is false."""
    return llm.tokenize(text.encode("utf-8"), add_bos=True, special=special)


def context_advice(llm: Llama, n_prompt: int, max_tokens: int, tokens_flag: str = "-n") -> str:
    """What to change when ``n_prompt`` tokens and ``max_tokens`` new ones do not fit ``llm``'s
    context. A larger context only where it helps: forecache's commands cap the context at the
    length the model was trained for, so past that the model's own limit is the answer (the most
    new tokens that fit after this prompt). ``tokens_flag``: the command's flag for the number of
    new tokens (``max_tokens=`` in Python)."""
    n_ctx = llm.n_ctx()
    trained = int(llm.model_file.arch_kv("context_length", 0) or 0)
    fewer = setting("max_tokens", flag=tokens_flag)
    if trained and n_prompt + max_tokens > trained:  # no context the model takes is enough
        room = trained - n_prompt
        limit = ("that is the model's own context (the length it was trained for)"
                 if n_ctx >= trained else
                 f"the model's own context is {trained} tokens (the length it was trained for)")
        if room <= 0:
            return f"{limit}, which the prompt alone fills: shorten it"
        larger = f", with {setting('n_ctx', trained)}" if n_ctx < trained else ""
        return (f"{limit}: at most {room} new tokens after this prompt{larger}; lower {fewer} "
                "or shorten the prompt")
    upto = f" (the model takes up to {trained})" if trained else ""
    room = n_ctx - n_prompt
    other = f"lower {fewer} to {room}" if room > 0 else "shorten the prompt"
    return f"raise {setting('n_ctx')} to {n_prompt + max_tokens} or more{upto}, or {other}"


def generate(llm: Llama, prompt: str | list[int], max_tokens: int, sampling: SamplingParams,
             on_text: Callable[[str], None] | None = None, ignore_eos: bool = False,
             stop: object = None, tokens_flag: str = "-n") -> GenerationResult:
    """Prefill the prompt (text or token ids), then decode up to ``max_tokens``, streaming text to
    ``on_text``; a true ``stop`` (a flag checked before each token) ends it early, with finish
    reason "interrupted". The result's stats are the expert cache's counters since the last
    ``reset_stats()``. A prompt and ``max_tokens`` that do not fit the context are refused with
    what to change (``context_advice``; ``tokens_flag``: the command's flag for
    ``max_tokens``)."""
    tokens = text_tokens(llm, prompt) if isinstance(prompt, str) else list(prompt)
    if not tokens:
        raise ValueError("the prompt is empty")
    n_ctx = llm.n_ctx()
    if len(tokens) + max_tokens > n_ctx:
        raise ValueError(f"prompt ({len(tokens)} tokens) + {max_tokens} generated tokens "
                         f"exceed the context of {n_ctx}; "
                         f"{context_advice(llm, len(tokens), max_tokens, tokens_flag)}")
    if max_tokens > 0:
        done = llm.complete(tokens, max_tokens, on_text, ignore_eos=ignore_eos, stop=stop,
                            **sampling.llama_kwargs())
    else:
        now = time.perf_counter()
        done = Streamed(t_start=now, t_end=now)
    t_first = done.t_first if done.t_first is not None else done.t_start
    out = done.tokens
    ttft = t_first - done.t_start
    tpot = (done.t_end - t_first) / (len(out) - 1) if len(out) > 1 else 0.0
    return GenerationResult(out, done.text, len(tokens), done.finish, ttft, tpot,
                            llm.expert_stats())


def last_logits(llm: Llama) -> np.ndarray:
    """A copy of the logits of the last token ``llm`` evaluated (n_vocab floats)."""
    low = llama_cpp_module()
    n_vocab = llm.n_vocab()
    ptr = low.llama_get_logits_ith(llm.ctx, -1)
    return np.ctypeslib.as_array(ptr, shape=(n_vocab,)).copy()

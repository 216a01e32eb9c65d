"""A multi-turn chat with a model, reusing the KV cache across turns."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from forecache.cache.budget import format_size
from forecache.cache.policies import hit_rate
from forecache.generate import SamplingParams, Streamed, context_advice
from forecache.interrupt import deferred_signals
from forecache.llama import Llama
from forecache.paths import write_atomic


@dataclass
class Turn:
    """What one answer cost."""

    text: str
    tokens: int
    prompt_tokens: int  # the whole conversation, as rendered by the template
    reused_tokens: int  # of those, already in the KV cache from earlier turns
    ttft_s: float
    decode_s: float
    stopped: bool  # interrupted by the user
    signum: int | None  # the signal that stopped it (SIGINT or SIGTERM)
    dropped_turns: int  # earliest turns left out to fit the context
    stats: dict
    # False: stopped before its first token; no answer, and the message was not kept
    answered: bool = True

    @property
    def tokens_per_s(self) -> float:
        return (self.tokens - 1) / self.decode_s if self.tokens > 1 and self.decode_s > 0 else 0.0


class ChatSession:
    """The conversation with ``llm`` and its rendering through the model's chat template.

    Each answer renders the whole conversation, and llama-cpp-python's prefix match keeps the KV
    cache of the tokens that did not change, so only the new turn is prefilled.
    """

    def __init__(self, llm: Llama, system: str | None = None, max_tokens: int = 512,
                 sampling: SamplingParams | None = None) -> None:
        self.llm = llm
        self.system = system
        self.max_tokens = max_tokens
        self.sampling = sampling or SamplingParams()
        self.history: list[dict[str, str]] = []
        self.turns: list[Turn] = []

    def _head(self) -> list[dict[str, str]]:
        return [{"role": "system", "content": self.system}] if self.system else []

    def messages(self) -> list[dict[str, str]]:
        """The conversation so far, the system message first."""
        return self._head() + self.history

    def reset(self) -> None:
        """Forget the conversation (the system message stays) and the statistics."""
        self.history.clear()
        self.turns.clear()
        self.llm.reset()
        self.llm.reset_stats()

    def _prompt(self, user: str) -> tuple[list[int], int]:
        """Tokens of the conversation plus ``user``'s message, leaving out the earliest turns
        until the answer fits in the context; and how many turns were left out."""
        n_ctx = self.llm.n_ctx()
        dropped = 0
        while True:
            msgs = self._head() + self.history[2 * dropped:] + [{"role": "user", "content": user}]
            tokens = self.llm.tokenize(self.llm.format_chat(msgs).encode("utf-8"), add_bos=True,
                                       special=True)
            if len(tokens) + self.max_tokens <= n_ctx:
                return tokens, dropped
            if 2 * dropped >= len(self.history):
                advice = context_advice(self.llm, len(tokens), self.max_tokens, "--max-tokens")
                raise ValueError(f"the message ({len(tokens)} tokens) and an answer of "
                                 f"{self.max_tokens} tokens exceed the context of {n_ctx}; "
                                 f"{advice}")
            dropped += 1  # a user message and its answer

    def _reused(self, tokens: list[int]) -> int:
        """How many of ``tokens`` lead the KV cache already (the prefix llama-cpp-python keeps)."""
        llm = self.llm
        reused = 0
        for a, b in zip(llm.input_ids[:llm.n_tokens], tokens[:-1], strict=False):
            if a != b:
                break
            reused += 1
        return reused

    def ask(self, user: str, on_text: Callable[[str], None] | None = None) -> Turn:
        """Answer ``user``, streaming text to ``on_text``. Ctrl-C stops the answer: what was
        generated so far is kept in the conversation and returned with ``stopped``. Stopped
        before its first token, there is no answer: the turn comes back with ``answered``
        false and the conversation stays as it was, ``user``'s message left out (a user turn
        without a reply would otherwise be sent again with the next message). SIGTERM stops it
        the same way (``signum`` tells them apart)."""
        llm = self.llm
        # signals are deferred from the start: Ctrl-C while a long conversation is rendered
        # stops this answer, as one during the prefill does, rather than ending the chat
        with deferred_signals() as stop:
            tokens, dropped = self._prompt(user)
            reused = self._reused(tokens)
            llm.reset_stats()
            if stop:  # nothing prefilled yet: no need to
                now = time.perf_counter()
                done = Streamed(finish="interrupted", t_start=now, t_end=now)
            else:
                done = llm.complete(tokens, self.max_tokens, on_text, stop=stop,
                                    **self.sampling.llama_kwargs())
        if done.t_first is None:  # stopped before its first token: no TTFT, nothing kept
            return Turn("", 0, len(tokens), reused, 0.0, 0.0, True, stop.signum, 0,
                        llm.expert_stats(), answered=False)
        t_first = done.t_first
        out, text = done.tokens, done.text
        if dropped:
            self.history = self.history[2 * dropped:]
        self.history += [{"role": "user", "content": user},
                         {"role": "assistant", "content": text}]
        turn = Turn(text, len(out), len(tokens), reused, t_first - done.t_start,
                    done.t_end - t_first if out else 0.0, bool(stop), stop.signum, dropped,
                    llm.expert_stats())
        self.turns.append(turn)
        return turn

    def save(self, path: Path) -> None:
        """Write the conversation as JSON (``{"model", "messages"}``), atomically."""
        doc = {"model": self.llm.model_file.path.name, "messages": self.messages()}
        write_atomic(path, json.dumps(doc, indent=2, ensure_ascii=False) + "\n")


def status_line(turn: Turn) -> str:
    """One line after each answer: speed, TTFT, expert hit rate and GPU cache use; for an answer
    stopped before its first token, that it was (no speed or TTFT: there was no token)."""
    if not turn.answered:
        return f"[interrupted before the first token: no answer | {expert_summary(turn.stats)}]"
    parts = [f"{turn.tokens_per_s:.1f} tokens/s", f"TTFT {turn.ttft_s * 1000:.0f} ms",
             f"{turn.tokens} tokens",
             f"prompt {turn.prompt_tokens - turn.reused_tokens} new + {turn.reused_tokens} cached"]
    parts.append(expert_summary(turn.stats))
    if turn.stats.get("mode") == "mobile":
        parts.append(mobile_summary(turn.stats))
    if "draft" in turn.stats:
        parts.append(spec_summary(turn.stats))
    if turn.stopped:
        parts.insert(0, "stopped")
    if turn.dropped_turns:
        parts.append(f"{turn.dropped_turns} earliest turn(s) left out to fit the context")
    return "[" + " | ".join(parts) + "]"


def spec_summary(stats: dict) -> str:
    """Speculative decoding in a few words: the draft, how much of it the model accepted."""
    rate, mean = stats.get("acceptance"), stats.get("mean_accepted")
    if rate is None:
        return f"speculative ({stats['draft']} drafts): nothing verified yet"
    return (f"speculative ({stats['draft']} drafts): {rate * 100:.0f}% of drafted tokens "
            f"accepted, {mean + 1:.1f} tokens a verification")


def mobile_summary(stats: dict) -> str:
    """MoBiLE decoding in a few words: lossy, and how often the full model recomputed."""
    little, big = stats.get("little_passes", 0), stats.get("big_passes", 0)
    share = f"{big / little * 100:.0f}%" if little else "-"
    kind = ("resident-expert" if stats.get("little_resident") else
            f"{stats['little_k']}-expert")
    return (f"mode mobile (lossy): {kind} little pass, full model for "
            f"{share} of tokens (gamma {stats['gamma']})")


def expert_summary(stats: dict) -> str:
    """Expert hit rate and GPU cache use in a few words."""
    if stats["policy"] == "none":
        return "experts: llama.cpp placement, no expert cache"
    if not stats["cache_slots"]:
        return f"experts: {stats['policy']}, computed from host memory"
    rate = stats["hit_rate"]
    hit = f"hit {rate * 100:.0f}%" if rate is not None else "hit -"
    text = (f"experts: {stats['policy']} {hit}, cache {stats['slots_filled']}/"
            f"{stats['cache_slots']} slots ({format_size(stats['slot_bytes'])} on "
            f"{stats['device']})")
    if "devices" in stats:  # slots on several devices: each one's share
        text += "; " + ", ".join(f"{name} {device_summary(d)}"
                                 for name, d in stats["devices"].items())
    if "disk_reads" in stats:
        host = stats["host_hit_rate"]
        text += (f"; disk tier: host hit {host * 100:.0f}%, " if host is not None else
                 "; disk tier: ") + \
            (f"{stats['disk_reads']} experts read ({format_size(stats['disk_bytes'])}), "
             f"waited {stats['disk_wait_s'] * 1000:.0f} ms")
    return text


def device_summary(d: dict) -> str:
    """One device's slots and hit rate (``Llama.expert_stats()["devices"]``)."""
    rate = hit_rate(d["hits"], d["misses"])
    return f"{d['slots']} slots, hit {rate * 100:.0f}%" if rate is not None else \
        f"{d['slots']} slots, hit -"


def stats_report(session: ChatSession) -> str:
    """The /stats text: the session's totals and the expert cache's counters of the last turn."""
    turns = session.turns
    lines = [f"turns: {len(turns)}, generated tokens: {sum(t.tokens for t in turns)}, "
             f"context: {session.llm.n_tokens}/{session.llm.n_ctx()} tokens"]
    if turns:
        t = turns[-1]
        s = t.stats
        lines.append(f"last answer: {t.tokens} tokens, {t.tokens_per_s:.1f} tokens/s, TTFT "
                     f"{t.ttft_s * 1000:.0f} ms, prompt {t.prompt_tokens} tokens of which "
                     f"{t.reused_tokens} reused from the KV cache")
        lines.append(f"expert cache ({s['policy']}): hits {s['hits']}, misses {s['misses']}, "
                     f"copied {format_size(s['h2d_bytes'])}, stalled {s['stall_s'] * 1000:.1f} ms, "
                     f"slots {s['slots_filled']}/{s['cache_slots']}, "
                     f"layers on host {s['host_layers']}")
        for name, d in s.get("devices", {}).items():
            cpu = f", {d['host_entries']} computed here" if d.get("host_entries") else ""
            lines.append(f"  {name}: {device_summary(d)}, copied {format_size(d['h2d_bytes'])}"
                         f"{cpu}")
    return "\n".join(lines)

"""Speculative decoding (SP-MoE): a draft proposes k tokens, the model verifies them in one
k+1-token pass, and the output is exactly the model's.

At batch 1 an offloaded MoE is bound by expert bytes: one verification pass copies each missed
expert once for all k+1 tokens, and while the draft runs the copy engine can bring in the experts
the verification will route. Greedy output is the non-speculative greedy output; sampled output
follows the standard rejection rule (accept a draft token d with probability min(1, p(d)/q(d)),
else sample from max(p - q, 0)), so every token is distributed as the model's sampler would draw
it. The sampler is llama.cpp's chain as llama-cpp-python builds it (repetition penalties over
the tokens generated so far, top-k, top-p, min-p, then temperature), computed here in numpy over
the full vocabulary.

Drafts:

- ``self-little``: the model's own little pass (each token routed to the top half of its
  experts; ``forecache_cache_set_little``), whose routing also tells the copy engine which experts
  the verification needs (MoBiLE's prefetch), so the correspondence is exact.
- ``self-cached``: the little pass over the top expert and those already in device slots: it
  never waits for a copy.
- a GGUF path: a second model with the same vocabulary, in a context of its own whose cache follows
  the accepted tokens.
"""

from __future__ import annotations

import os
import time
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from forecache.errors import setting
from forecache.generate import SamplingParams
from forecache.gguf.header import read_model_file
from forecache.gguf.identity import fingerprint
from forecache.native import llama_cpp_module
from forecache.speculative.acceptance import AcceptanceReplay
from forecache.speculative.draft import (
    CrossModelPredictor,
    DraftContext,
    fill_batch,
    vocab_mismatch,
)

if TYPE_CHECKING:
    from forecache.llama import Llama

SELF_DRAFTS = ("self-little", "self-cached")
DEFAULT_K = 4  # the first draft length of the adaptive schedule
MAX_K = 16

# llama-cpp-python generate() arguments speculation leaves at their defaults; any other value
# (typical sampling, mirostat, grammars, processors, stopping criteria) decodes without it
_NEUTRAL = {"typical_p": 1.0, "mirostat_mode": 0, "logits_processor": None,
            "stopping_criteria": None, "grammar": None}


# llama-cpp-python's generate() defaults, as forecache's sampling settings default to them
_DEFAULTS = SamplingParams()


@dataclass(frozen=True)
class Sampler:
    """llama.cpp's sampling chain as llama-cpp-python builds it, as a distribution over the
    vocabulary: repetition penalties over the last ``penalty_last_n`` tokens generated, then
    top-k, top-p and min-p over the softmax at temperature 1, then the temperature (``temp`` 0:
    greedy, < 0: plain softmax)."""

    temp: float = _DEFAULTS.temperature
    top_k: int = _DEFAULTS.top_k
    top_p: float = _DEFAULTS.top_p
    min_p: float = _DEFAULTS.min_p
    repeat_penalty: float = _DEFAULTS.repeat_penalty
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    penalty_last_n: int = 64

    @property
    def greedy(self) -> bool:
        return self.temp == 0.0

    def penalized(self, logits: np.ndarray, history: Sequence[int]) -> np.ndarray:
        """``logits`` after the penalties for the tokens in ``history`` (the generated ones)."""
        z = logits.astype(np.float64)
        neutral = (self.repeat_penalty == 1.0 and self.frequency_penalty == 0.0 and
                   self.presence_penalty == 0.0)
        window = list(history)[-self.penalty_last_n:] if self.penalty_last_n > 0 else []
        if neutral or not window:
            return z
        ids, counts = np.unique(np.asarray(window, dtype=np.int64), return_counts=True)
        v = z[ids]
        v = np.where(v <= 0, v * self.repeat_penalty, v / self.repeat_penalty)
        z[ids] = v - counts * self.frequency_penalty - self.presence_penalty
        return z

    def probs(self, logits: np.ndarray, history: Sequence[int] = ()) -> np.ndarray:
        """The distribution the chain samples from (zero outside the tokens it keeps)."""
        z = self.penalized(logits, history)
        keep = np.arange(len(z))
        if self.temp > 0.0:
            if 0 < self.top_k < len(z):
                keep = np.argpartition(-z, self.top_k - 1)[:self.top_k]
            keep = keep[np.argsort(-z[keep], kind="stable")]
            p = np.exp(z[keep] - z[keep[0]])
            p /= p.sum()
            if self.top_p < 1.0:
                cut = int(np.searchsorted(np.cumsum(p), self.top_p)) + 1
                keep, p = keep[:cut], p[:cut]
            if self.min_p > 0.0:
                n = max(int(np.count_nonzero(p >= self.min_p * p[0])), 1)
                keep = keep[:n]
            t = z[keep] / self.temp
        else:
            t = z
        out = np.zeros(len(z))
        e = np.exp(t - t.max())
        out[keep] = e / e.sum()
        return out

    def pick(self, logits: np.ndarray, rng: np.random.Generator, history: Sequence[int] = ()
             ) -> tuple[int, np.ndarray | None]:
        """A token drawn from ``logits`` after ``history`` and the distribution it was drawn
        from (None when greedy)."""
        if self.greedy:
            return int(np.argmax(self.penalized(logits, history))), None
        p = self.probs(logits, history)
        return int(rng.choice(len(p), p=p)), p


def sampler_for(kwargs: dict[str, Any], penalty_last_n: int = 64) -> Sampler | None:
    """The Sampler of llama-cpp-python generate() keywords, or None when they ask for something
    speculation does not reproduce."""
    for key, neutral in _NEUTRAL.items():
        if key in kwargs and kwargs[key] != neutral:
            return None
    d = _DEFAULTS
    return Sampler(temp=float(kwargs.get("temp", d.temperature)),
                   top_k=int(kwargs.get("top_k", d.top_k)),
                   top_p=float(kwargs.get("top_p", d.top_p)),
                   min_p=float(kwargs.get("min_p", d.min_p)),
                   repeat_penalty=float(kwargs.get("repeat_penalty", d.repeat_penalty)),
                   frequency_penalty=float(kwargs.get("frequency_penalty", 0.0)),
                   presence_penalty=float(kwargs.get("presence_penalty", 0.0)),
                   penalty_last_n=penalty_last_n)


def verify(rows: np.ndarray, drafts: Sequence[int], qs: Sequence[np.ndarray | None],
           sampler: Sampler, rng: np.random.Generator, history: Sequence[int] = ()
           ) -> tuple[list[int], int]:
    """The draft tokens the model accepts and the token it adds: ``rows[i]`` are the model's
    logits after the i-th token of [x, d1, ..., dk], ``qs[i]`` the distribution d(i+1) was drawn
    from, ``history`` the tokens generated up to x (penalties). Greedy: the drafts that equal
    the model's argmax, then its argmax. Sampled: the rejection rule, whose output is
    distributed as the model's sampler."""
    accepted: list[int] = []
    hist = list(history)
    for i, d in enumerate(drafts):
        if sampler.greedy:
            t = sampler.pick(rows[i], rng, hist)[0]
            if t != d:
                return accepted, t
        else:
            p, q = sampler.probs(rows[i], hist), qs[i]
            assert q is not None
            if rng.random() >= min(1.0, p[d] / q[d]):
                r = np.maximum(p - q, 0.0)
                total = r.sum()
                r = r / total if total > 0 else p
                return accepted, int(rng.choice(len(r), p=r))
        accepted.append(d)
        hist.append(d)
    return accepted, sampler.pick(rows[len(drafts)], rng, hist)[0]


@dataclass
class SpecStats:
    """Counters of speculative decoding since the last reset."""

    steps: int = 0  # verification passes
    drafted: int = 0
    accepted: int = 0
    undrafted: int = 0  # tokens decoded without drafts while drafting did not pay

    def add(self, drafted: int, accepted: int) -> None:
        """One verification of ``drafted`` tokens that accepted ``accepted``."""
        self.steps += 1
        self.drafted += drafted
        self.accepted += accepted

    def to_json(self, kind: str, k: int) -> dict:
        return {"draft": kind, "draft_k": k, "verify_passes": self.steps,
                "drafted": self.drafted, "accepted": self.accepted, "undrafted": self.undrafted,
                "acceptance": self.accepted / self.drafted if self.drafted else None,
                "mean_accepted": self.accepted / self.steps if self.steps else None}


# Adaptive drafting is judged by time: a drafted step's seconds per token it yields against a
# plain token's. After MIN_SPEC_STEPS steps, PLAIN_PROBE plain tokens measure the plain rate
# (again every REPROBE steps); while drafting costs more a token, BACKOFF tokens are decoded plain
# before drafting is measured afresh.
MIN_SPEC_STEPS = 4
PLAIN_PROBE = 2
REPROBE = 64
BACKOFF = 32
EMA = 0.3  # weight of the newest step in the running per-token times


def _ema(old: float | None, new: float) -> float:
    return new if old is None else (1 - EMA) * old + EMA * new


class DraftLength:
    """The draft length: fixed when given, else adaptive from the acceptance (two more after a
    step that accepted every draft, one fewer after one that did not, within 1..MAX_K); adaptive
    drafting also stops while a drafted step yields tokens more slowly than plain decoding
    (``next_k`` 0: decode the next token plain), since acceptance times the draft's cost decides
    whether it pays, not acceptance alone."""

    def __init__(self, k: int | None, most: int = MAX_K) -> None:
        self.fixed = k is not None
        self.most = max(min(most, MAX_K), 1)  # what one verification ubatch can hold
        self.k = min(k if k is not None else DEFAULT_K, self.most)
        self.spec_s: float | None = None  # seconds a token, drafted steps (running)
        self.plain_s: float | None = None  # seconds a token, plain decoding (running)
        self.spec_steps = 0  # drafted steps since drafting (re)started
        self.plain_left = 0  # plain tokens before drafting again
        self.probing = False  # those plain tokens measure the plain rate (not a back-off)
        self.backoffs = 0

    def next_k(self) -> int:
        """Tokens to draft for the next step; 0: decode it plain."""
        return 0 if self.plain_left > 0 else self.k

    def update(self, accepted: int, drafted: int, seconds: float | None = None) -> None:
        """A drafted step that accepted ``accepted`` of ``drafted`` in ``seconds`` (drafts,
        verification and the rule; None: not timed)."""
        if self.fixed:
            return
        self.k = min(self.k + 2, self.most) if accepted == drafted else max(self.k - 1, 1)
        if seconds is None:
            return
        self.spec_s = _ema(self.spec_s, seconds / (accepted + 1))
        self.spec_steps += 1
        if self.spec_steps < MIN_SPEC_STEPS:
            return
        if self.plain_s is None or self.spec_steps % REPROBE == 0:
            self.plain_left, self.probing = PLAIN_PROBE, True
        elif self.spec_s > self.plain_s:
            self._back_off()

    def plain(self, seconds: float) -> None:
        """A token decoded plain in ``seconds``, as ``next_k`` asked."""
        self.plain_s = _ema(self.plain_s, seconds)
        self.plain_left = max(self.plain_left - 1, 0)
        if self.plain_left:
            return
        if self.probing:
            self.probing = False
            if self.spec_s is not None and self.spec_s > self.plain_s:
                self._back_off()
        else:  # a back-off ended: drafting is measured afresh
            self.spec_s, self.spec_steps = None, 0

    def _back_off(self) -> None:
        self.plain_left, self.probing = BACKOFF, False
        self.backoffs += 1


class _Rows:
    """One llama_batch of up to MAX_K + 1 tokens of sequence 0, all with logits."""

    def __init__(self, llm: Llama) -> None:
        self.low, self.llm = llama_cpp_module(), llm
        self.batch = self.low.llama_batch_init(MAX_K + 1, 0, 1)
        self.n_vocab = llm.n_vocab()

    def decode(self, tokens: Sequence[int], pos: int) -> np.ndarray:
        """The model's logits after each of ``tokens``, placed at ``pos`` (the KV cells from
        ``pos`` on are replaced)."""
        low, llm, b = self.low, self.llm, self.batch
        low.llama_memory_seq_rm(low.llama_get_memory(llm.ctx), -1, pos, -1)
        fill_batch(b, tokens, pos, every_logit=True)
        if llm.expert_cache is not None:
            llm.expert_cache.begin_ubatch(np.asarray(tokens, dtype=np.int32))
        if llm.replay is not None:  # (benchmarks) the rows route as plain decoding's would
            llm.replay.before_rows_of_decode(pos, len(tokens))
        rc = low.llama_decode(llm.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode failed ({rc}) verifying {len(tokens)} tokens")
        llm.input_ids[pos:pos + len(tokens)] = tokens
        llm.n_tokens = pos + len(tokens)
        return np.stack([np.ctypeslib.as_array(low.llama_get_logits_ith(llm.ctx, i),
                                               shape=(self.n_vocab,))
                         for i in range(len(tokens))])

    def close(self) -> None:
        self.low.llama_batch_free(self.batch)


def _last_logits(llm: Any) -> np.ndarray:
    ptr = llama_cpp_module().llama_get_logits_ith(llm.ctx, -1)
    return np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),))


class SelfDraft:
    """Drafts with the model's own little pass, in the model's context: the draft tokens' KV
    cells are dropped before the verification computes them again."""

    def __init__(self, llm: Llama, kind: str) -> None:
        if llm.expert_cache is None:
            raise ValueError(f"{setting('draft', kind)} drafts with forecache's expert cache, "
                             "which this run does not have; give "
                             f"{setting('policy')} promoe (or lru, lfu, static, infinity)")
        self.kind = kind
        self.resident = kind == "self-cached"
        k = llm.model_file.n_expert_used
        self.m = k if self.resident else k // 2
        if self.m < 1:
            raise ValueError(f"{setting('draft', kind)}: {llm.model_file.path.name} routes "
                             f"{k} expert a token; a little pass needs at least 2")

    def propose(self, llm: Llama, x: int, pos: int, k: int, sampler: Sampler,
                rng: np.random.Generator, history: list[int]
                ) -> tuple[list[int], list[np.ndarray | None]]:
        """k draft tokens after ``x`` (at ``pos``; ``history``: the tokens generated up to it)
        and the distributions they came from."""
        cache = llm.expert_cache
        assert cache is not None
        drafts: list[int] = []
        qs: list[np.ndarray | None] = []
        cur = x
        cache.set_little(self.m, self.resident)
        try:
            for _ in range(k):
                llm.eval([cur])
                cur, q = sampler.pick(_last_logits(llm), rng, history + drafts)
                drafts.append(cur)
                qs.append(q)
        finally:
            cache.set_little(0)
            llm.n_tokens = pos  # the verification replaces the draft's cells
        # what the little passes routed is what the verification will: copy it meanwhile
        cache.prefetch_little(llm.model_file.n_expert_used)
        return drafts, qs

    def observe(self, layer: int, experts: np.ndarray) -> None:
        pass

    def stats(self) -> dict:
        return {}

    def close(self) -> None:
        pass


class ModelDraft:
    """Drafts with a second GGUF that shares the model's vocabulary, in a context of its own
    whose KV cache follows the accepted tokens. Where it has the model's width, its per-layer
    states go through the model's routers as it drafts (SP-MoE's cross-model predictor), and the
    experts they name for layers up to the cutoff are queued at low priority: copied while the
    draft runs, before the verification routes them."""

    def __init__(self, llm: Llama, path: str) -> None:
        if not os.path.isfile(path):
            raise ValueError(f"{setting('draft', path)}: no such file; give a GGUF with the "
                             f"model's vocabulary, or {' or '.join(SELF_DRAFTS)}")
        self.kind = os.path.basename(path)
        cache = llm.expert_cache
        # under a routing replay (benchmarks) the verification routes the trace's rows, which no
        # draft state predicts: the cross-model prefetch is off rather than guessing
        self.replayed = llm.replay is not None
        mf = llm.model_file
        try:
            width = int(read_model_file(path).arch_kv("embedding_length", 0))
        except ValueError:
            width = 0  # (the load below says what is wrong with it)
        # states are captured only where the predictor reads them: each capture is a sync
        # point in the draft's graph
        capture = cache is not None and not self.replayed and \
            width == int(mf.arch_kv("embedding_length", -1))
        try:
            # its ubatch is the one the budget paid for (``budget.draft_ubatch``)
            self.ctx = DraftContext(Path(path), n_ctx=llm.n_ctx(), n_batch=llm.n_batch,
                                    n_threads=llm.n_threads, capture=capture,
                                    n_ubatch=llm.load_plan.draft_ubatch or None)
        except ValueError as e:
            raise ValueError(f"{setting('draft', path)}: {e}") from e
        bad = vocab_mismatch(llm, self.ctx)
        if bad is not None:
            self.ctx.close()
            raise ValueError(f"{setting('draft', path)}: its vocabulary differs from "
                             f"{llm.model_file.path.name}'s ({bad}); use a draft made with the "
                             "same tokenizer")
        self.predictor: CrossModelPredictor | None = None
        # a draft cut from the model (make-draft) is read layer for layer, beside that model only
        own = self.ctx.source_layers
        self.other_source = own is not None and self.ctx.source_fingerprint is not None and \
            self.ctx.source_fingerprint != fingerprint(mf)
        if capture:
            pred = CrossModelPredictor(mf, mf.moe_layers(), mf.n_layer, mf.n_expert_used,
                                       self.ctx.n_layer,
                                       source_layers=None if self.other_source else own)
            if pred.layers:  # (its width is the model's: ``capture`` says so)
                self.predictor = pred
        self.cutoff = len(self.predictor.layers) if self.predictor else 0
        # what the reports say of the cross-model prefetch
        self.prefetch_mode = ("cross-model, at relative depth: the draft was cut from another "
                              "model" if self.predictor is not None and self.other_source else
                              "cross-model" if self.predictor is not None else
                              "off: no expert cache" if cache is None else
                              "off: routing replayed" if self.replayed else
                              "off: the draft's width is not the model's")
        self.token_s = 0.0  # a draft token's decode time (moving average)
        self._predicted: dict[int, set[int]] = {}
        self.prefetched = 0  # copies the predictions queued
        self.hits = self.n_predicted = self.n_routed = 0  # precision and recall counts
        self._chance: list[float] = []  # a random guess's precision, per layer verified

    def propose(self, llm: Llama, x: int, pos: int, k: int, sampler: Sampler,
                rng: np.random.Generator, history: list[int]
                ) -> tuple[list[int], list[np.ndarray | None]]:
        self._predicted = {}
        self.ctx.sync([*llm.input_ids[:pos].tolist(), x])
        self._prefetch(llm)
        drafts: list[int] = []
        qs: list[np.ndarray | None] = []
        for i in range(k):
            t, q = sampler.pick(self.ctx.logits(), rng, history + drafts)
            drafts.append(t)
            qs.append(q)
            if i + 1 < k:
                t0 = time.perf_counter()
                self.ctx.step(t)
                dt = time.perf_counter() - t0
                self.token_s = dt if self.token_s == 0 else 0.8 * self.token_s + 0.2 * dt
                self._prefetch(llm)
        self.cutoff = self._cutoff(llm, k)
        return drafts, qs

    def _prefetch(self, llm: Llama) -> None:
        """The experts the draft's last token names for the model's layers up to the cutoff,
        queued at low priority (one request a layer)."""
        cache, pred = llm.expert_cache, self.predictor
        if cache is None or pred is None:
            return
        warm = getattr(cache.policy, "warm", None)
        for il in pred.layers[:self.cutoff]:
            state = self.ctx.state(pred.source[il])
            if state is None:
                continue
            experts = pred.predict(il, state)
            self._predicted.setdefault(il, set()).update(experts)
            if warm is not None:
                self.prefetched += warm(il, experts, cache)

    def _cutoff(self, llm: Llama, k: int) -> int:
        """SP-MoE's cutoff layer: the most layers whose predicted misses fit in the layers' spare
        slots (memory) and whose copies fit in the drafting time (time), from the cost model's
        copy time and the measured miss rate and draft speed. Every layer without a cost model
        (a CPU build, where a copy is a memcpy)."""
        cache, pred = llm.expert_cache, self.predictor
        if cache is None or pred is None:
            return 0
        n = len(pred.layers)
        cost = getattr(cache.policy, "cost", None)
        if cost is None or self.token_s <= 0:
            return n
        hits, misses = cache.decode_counts()
        miss = misses / (hits + misses) if hits + misses else 1.0
        n_used = pred.n_used
        per_layer = miss * min(n_used * k, cache.n_experts(pred.layers[0]))
        spare = min(cache.layers[il].n_slots - n_used for il in pred.layers)
        if per_layer > spare:
            return 0
        if per_layer <= 0:
            return n
        return min(n, int(k * self.token_s / (per_layer * cost.copy_s())))

    def observe(self, layer: int, experts: np.ndarray) -> None:
        """A verification's routing of ``layer``: precision and recall of the predictions."""
        if layer not in self._predicted:
            return
        routed = {int(e) for e in experts.tolist()}
        pred = self._predicted[layer]
        if self.predictor is not None:
            self._chance.append(len(routed) / self.predictor.gates[layer].shape[0])
        self.hits += len(pred & routed)
        self.n_predicted += len(pred)
        self.n_routed += len(routed)

    def stats(self) -> dict:
        return {"spec_cutoff": self.cutoff, "spec_prefetched": self.prefetched,
                "spec_prefetch": self.prefetch_mode,
                "prefetch_precision": self.hits / self.n_predicted if self.n_predicted else None,
                "prefetch_recall": self.hits / self.n_routed if self.n_routed else None,
                # what guessing would reach: the share of a layer's experts a verification routes
                "prefetch_precision_chance": float(np.mean(self._chance)) if self._chance
                else None}

    def close(self) -> None:
        self.ctx.close()


class Speculator:
    """Speculative decoding for one forecache.Llama: the draft, its length and the counters."""

    def __init__(self, llm: Llama, draft: str, draft_k: int | None,
                 acceptance: AcceptanceReplay | None = None) -> None:
        if draft_k is not None and not 1 <= draft_k <= MAX_K:
            raise ValueError(f"{setting('draft_k', draft_k)}: draft 1 to {MAX_K} tokens")
        self.draft: SelfDraft | ModelDraft = (SelfDraft(llm, draft) if draft in SELF_DRAFTS
                                              else ModelDraft(llm, draft))
        self.length = DraftLength(draft_k, llm.n_batch - 1)
        self.stats = SpecStats()
        # benchmarks only: how many drafts each verification accepts, replayed
        self.acceptance = acceptance
        self._replayed = acceptance.player() if acceptance is not None else None

    def stats_json(self) -> dict:
        out = {**self.stats.to_json(self.draft.kind, self.length.k), **self.draft.stats()}
        if self.acceptance is not None:
            out["acceptance_replay"] = self.acceptance.label()
        return out

    def generate(self, llm: Llama, tokens: Sequence[int], sampler: Sampler, reset: bool,
                 seed: int) -> Generator[int, Any, None]:
        """llama-cpp-python's generate() with speculation: yields the model's tokens after
        ``tokens`` (reusing the cached prefix, as generate() does) until closed."""
        low = llama_cpp_module()
        rng = np.random.default_rng(seed)
        tokens = list(tokens)
        keep = 0
        if reset and llm.n_tokens > 0:
            for a, b in zip(llm.input_ids[:llm.n_tokens], tokens, strict=False):
                if a != b:
                    break
                keep += 1
        llm.n_tokens = min(keep, len(tokens) - 1)  # at least one token evaluated for logits
        rows = _Rows(llm)
        generated: list[int] = []  # the penalties' history, as the sampler chain accepts tokens
        try:
            llm.eval(tokens[llm.n_tokens:])
            x, _ = sampler.pick(_last_logits(llm), rng)
            while True:
                generated.append(x)
                yield x
                pos = llm.n_tokens
                t0 = time.perf_counter()
                k = min(self.length.next_k(), llm.n_ctx() - pos - 1)  # the drafts fit the context
                if k < 1:
                    llm.eval([x])
                    x, _ = sampler.pick(_last_logits(llm), rng, generated)
                    if self.length.next_k() == 0:
                        self.length.plain(time.perf_counter() - t0)
                        self.stats.undrafted += 1
                    continue
                drafts, qs = self.draft.propose(llm, x, pos, k, sampler, rng, generated)
                cache = llm.expert_cache
                if cache is not None:
                    cache.route_observer = self.draft.observe
                try:
                    logits = rows.decode([x, *drafts], pos)
                finally:
                    if cache is not None:
                        cache.route_observer = None
                if self._replayed is not None:
                    # the replay decides how many drafts stand; the sampler still picks the
                    # model's token after them
                    accepted = list(drafts[:self._replayed.accepted(drafts)])
                    new = sampler.pick(logits[len(accepted)], rng, [*generated, *accepted])[0]
                else:
                    accepted, new = verify(logits, drafts, qs, sampler, rng, generated)
                keep_to = pos + 1 + len(accepted)
                if llm.replay is not None:
                    llm.replay.advance_decode(1 + len(accepted))
                low.llama_memory_seq_rm(low.llama_get_memory(llm.ctx), -1, keep_to, -1)
                llm.n_tokens = keep_to
                self.stats.add(len(drafts), len(accepted))
                self.length.update(len(accepted), len(drafts), time.perf_counter() - t0)
                for t in accepted:
                    generated.append(t)
                    yield t
                x = new
        finally:
            rows.close()
            llm._requires_eval = True  # the context's logits are not the last token's

    def close(self) -> None:
        self.draft.close()

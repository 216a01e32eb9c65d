"""Acceptance replay (benchmarks only): the speculative twin of routing replay.

A model of random weights accepts almost none of a draft's tokens, so its speed with a draft says
nothing about a real pair. Under an acceptance replay the verification pass still runs, with its
routers and its sampler, but how many of a step's draft tokens it accepts comes from a rate
measured for a real pair of models, or from a sequence of accepted counts: the step's copies and
compute are a real pair's, its tokens are meaningless. Only ``forecache bench`` and the
benchmarks take it, and their reports say so.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Published:
    """A published acceptance of a real draft/target pair, as llama.cpp reports it: accepted
    drafts over drafts tested (``share``, the low end where a range is quoted), at a draft
    length of ``n_draft`` (None where the source leaves it to llama.cpp's defaults)."""

    pair: str
    share: float
    n_draft: int | None
    source: str


# What the acceptance replays are swept around (no published figure pairs a Qwen2-0.5B draft
# with Qwen2-57B-A14B; these are its family's nearest, and the classic pair of llama.cpp's own
# speculative example)
PUBLISHED = (
    Published("Qwen2.5-Coder-0.5B -> Qwen2.5-Coder-14B (q8_0 / q4_k_m)", 0.26, None,
              "inventivehq.com/blog/speculative-decoding-draft-model-size-sweep"),
    Published("Qwen2.5-Coder-1.5B -> Qwen2.5-Coder-14B (q4_k_m)", 0.40, None,
              "inventivehq.com/blog/speculative-decoding-draft-model-size-sweep"),
    Published("Qwen2.5-Coder-3B -> Qwen2.5-Coder-14B (q4_k_m)", 0.87, None,
              "inventivehq.com/blog/speculative-decoding-draft-model-size-sweep"),
    Published("Qwen2.5-1.5B -> Qwen2.5-32B (quoted 65-80%)", 0.65, None,
              "svah-x.github.io/mac-playbooks/playbooks/speculative-decoding"),
    Published("CodeLlama-7B -> CodeLlama-34B (q4_k_m, greedy, code)", 0.878, 16,
              "github.com/ggml-org/llama.cpp/pull/3006"),
)


def per_token_rate(share: float, n_draft: int) -> float:
    """The per-token acceptance (each draft accepted with it until the first rejection, as the
    replay draws) whose expected accepted share of ``n_draft`` drafts is ``share``: the inverse
    of sum(p**i, i = 1..n) / n (the relation llama.cpp's maintainers give for its reported
    rate, github.com/ggml-org/llama.cpp/issues/3649)."""
    if not 0.0 <= share <= 1.0 or n_draft < 1:
        raise ValueError(f"a share of {share} of {n_draft} drafts: give 0 to 1 of at least 1")
    lo, hi = 0.0, 1.0
    for _ in range(60):  # the share grows with p: bisect
        p = (lo + hi) / 2
        if sum(p ** i for i in range(1, n_draft + 1)) / n_draft < share:
            lo = p
        else:
            hi = p
    return (lo + hi) / 2


@dataclass(frozen=True)
class AcceptanceReplay:
    """How many draft tokens each verification accepts: each token with probability ``rate``,
    the first rejection ending the step (the per-token rate that published measurements of
    speculative decoding give), or ``counts`` in turn (cycled, at most the step's drafts)."""

    rate: float | None = None
    counts: tuple[int, ...] = ()
    seed: int = 0

    def __post_init__(self) -> None:
        if (self.rate is None) == (not self.counts):
            raise ValueError("an acceptance replay takes a rate or a sequence of accepted counts")
        if self.rate is not None and not 0.0 <= self.rate <= 1.0:
            raise ValueError(f"acceptance rate {self.rate}: give a rate from 0 to 1")
        if any(c < 0 for c in self.counts):
            raise ValueError(f"accepted counts {list(self.counts)}: none may be negative")

    @classmethod
    def parse(cls, text: str, seed: int = 0) -> AcceptanceReplay:
        """``0.7`` (a rate a token) or ``3,0,2`` (each verification's accepted count in turn)."""
        parts = [p.strip() for p in text.split(",") if p.strip()]
        try:
            rate = float(parts[0]) if len(parts) == 1 and "." in parts[0] else None
            counts = () if rate is not None else tuple(int(p) for p in parts)
        except ValueError:
            raise ValueError(f"cannot read acceptance {text!r}: give a rate such as 0.7, or "
                             "accepted counts such as 3,0,2") from None
        return cls(rate=rate, counts=counts, seed=seed)

    def label(self) -> str:
        """What the reports say of it."""
        what = f"{self.rate:.2f} a token" if self.rate is not None else \
            f"counts {','.join(map(str, self.counts))}"
        return f"acceptance replayed ({what}): the drafts' tokens are meaningless"

    def player(self) -> AcceptancePlayer:
        """A fresh replay from its start."""
        return AcceptancePlayer(self)


class AcceptancePlayer:
    """One run's replay of an ``AcceptanceReplay``."""

    def __init__(self, spec: AcceptanceReplay) -> None:
        self.spec = spec
        self._rng = np.random.default_rng(spec.seed)
        self._at = 0

    def accepted(self, drafts: Sequence[int]) -> int:
        """How many of ``drafts`` (from the first) this verification accepts."""
        if self.spec.rate is None:
            n = self.spec.counts[self._at % len(self.spec.counts)]
            self._at += 1
            return min(n, len(drafts))
        n = 0
        while n < len(drafts) and self._rng.random() < self.spec.rate:
            n += 1
        return n

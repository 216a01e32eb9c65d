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

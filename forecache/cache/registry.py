"""Every placement by name: what it needs, and the one way the runtime and the simulator build it.

A placement is either llama.cpp's own (``offload``, ``ncmoe`` and its mmap'd run: no expert
cache) or an expert cache driven by a ``Policy`` class. The classes say what they need
(``Policy.proactive``, ``needs_profile``, ``layer_slots``, ``create``) and this module names them:
callers ask a ``PolicySpec`` what a placement needs, and compare names only where the name is the
point (the default's choice between promoe and ncmoe, a batch plan's ncmoe layers, reports and the
simulator's runs by name).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from forecache.cache.infinity import InfinityPolicy
from forecache.cache.policies import LFUPolicy, LRUPolicy, Policy, PolicyInputs, StaticPolicy
from forecache.cache.prefetcher import ProMoEPolicy

__all__ = ["NCMOE_RUNS", "POLICIES", "SIM_POLICIES", "PolicyInputs", "PolicySpec",
           "build_policy", "policy_spec"]


@dataclass(frozen=True)
class PolicySpec:
    """One placement: where routed experts live and which policy (if any) fills device slots."""

    name: str
    #: "host": every routed expert in host memory, computed where llama.cpp's rules put it
    #: (``-ot exps=CPU``); "layers": whole layers on the device as the budget allows, the rest in
    #: host memory (``--n-cpu-moe N``); "slots": host experts with a device cache the policy fills
    placement: Literal["host", "layers", "slots"]
    policy: type[Policy] | None = None  # None: llama.cpp's own placement, no expert cache
    #: host experts mmap'd from the file (llama.cpp's default) instead of pinned (``--no-mmap``):
    #: a prompt copies them up at pageable memory's rate
    mmap: bool = False
    #: a ``--policy`` users run; False: a stock run only benchmarks and the simulator make
    runtime: bool = True

    @property
    def cached(self) -> bool:
        """forecache's expert cache runs (slots and a gate hook)."""
        return self.policy is not None

    @property
    def proactive(self) -> bool:
        """Forecasts ahead, computes cache-first and holds stage slots for prompt passes."""
        return self.policy is not None and self.policy.proactive

    @property
    def ranks_experts(self) -> bool:
        """Acts on whole forecast rankings of every expert (EAM's), not a top few."""
        return self.policy is not None and self.policy.ranks_experts

    @property
    def needs_profile(self) -> bool:
        """Pins experts from a routing profile (static)."""
        return self.policy is not None and self.policy.needs_profile


# In the order reports compare them: stock llama.cpp's best first (--n-cpu-moe with host experts
# pinned and mmap'd: a ratio over ncmoe is over the faster of the two), then the rest.
_SPECS = (
    PolicySpec("ncmoe", "layers"),
    PolicySpec("ncmoe-mmap", "layers", mmap=True, runtime=False),
    PolicySpec("offload", "host"),
    PolicySpec("lru", "slots", LRUPolicy),
    PolicySpec("lfu", "slots", LFUPolicy),
    PolicySpec("static", "slots", StaticPolicy),
    PolicySpec("promoe", "slots", ProMoEPolicy),
    PolicySpec("infinity", "slots", InfinityPolicy),
)
SPECS = {s.name: s for s in _SPECS}
#: what ``--policy`` takes at run time
POLICIES = tuple(s.name for s in _SPECS if s.runtime)
#: what the simulator replays: every placement
SIM_POLICIES = tuple(SPECS)
#: stock llama.cpp's --n-cpu-moe two ways: host experts pinned ("ncmoe": --no-mmap, as forecache
#: loads them) or mmap'd from the file ("ncmoe-mmap": llama.cpp's default). Speedups over ncmoe
#: are over the faster of the two, figure by figure.
NCMOE_RUNS = tuple(s.name for s in _SPECS if s.placement == "layers")


def policy_spec(name: str, *, simulated: bool = False) -> PolicySpec:
    """The placement called ``name``; a ValueError naming the choices for any other name
    (``simulated``: the simulator's choices, which add stock runs users do not pick)."""
    spec = SPECS.get(name)
    choices = SIM_POLICIES if simulated else POLICIES
    if spec is None or spec.name not in choices:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(choices)}")
    return spec


def build_policy(name: str, n_slots: list[int], inputs: PolicyInputs) -> Policy | None:
    """The slot policy of placement ``name`` over ``n_slots`` (None for llama.cpp's own
    placements): the runtime and the simulator both build policies here."""
    spec = policy_spec(name, simulated=True)
    return spec.policy.create(n_slots, inputs) if spec.policy is not None else None

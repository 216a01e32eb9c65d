"""Costs for tests of the host/device split on the tiny models."""

from __future__ import annotations

from forecache.cache.cost import CostModel, ExpertShape, Profile


def split_costs(shape: ExpertShape) -> CostModel:
    """Costs under which the split sends one or two of a token's misses to the host."""
    cost = CostModel.from_profile(Profile.load("rtx4090"), shape)
    cost.copy_gbps = cost.expert.nbytes / 40e-6 / 1e9  # one copy 40 us
    cost.cpu_mem_gbps = cost.expert.nbytes / 60e-6 / 1e9  # one expert on the CPU ~60 us
    cost.cpu_launch_s = cost.thread_s = 0.0
    cost.gpu_launch_s = cost.chunk_latency_s = 1e-6
    return cost

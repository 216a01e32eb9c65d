"""Which of a layer's missing experts to copy to the device and which to compute on the host CPU.

A missing expert either streams through a slot (its copy is on the critical path of the device
side) or has its tokens computed by the CPU from host memory while the device computes the rest of
the layer (patch 0005: schedule entries with slot -1). Per layer, the choice minimises the later of
the two sides finishing, by the costs of a machine profile; at run time the measured copy rate and
host compute time correct the profile as they come in.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from forecache.sim_profile import ExpertShape, Profile

# measurements below these are too small to correct the profile with
MIN_CALIBRATION_S = 0.02


@dataclass(frozen=True)
class Split:
    """A layer's plan: experts computed on the host beside the slots, or the whole layer there."""

    host: list[int]
    whole_layer: bool = False


@dataclass
class CostModel:
    """Seconds of the two sides of a layer (rooflines per projection, as the simulator's): the
    device copying missing experts and computing from slots, and the host CPU computing experts
    from host memory."""

    expert: ExpertShape
    copy_gbps: float
    chunk_latency_s: float
    gpu_mem_gbps: float
    gpu_tflops: float
    gpu_launch_s: float
    cpu_mem_gbps: float
    cpu_gflops: float
    cpu_launch_s: float
    host_scale: float = 1.0  # measured / modelled host compute time
    predicted_host_s: float = 0.0  # modelled time of what was sent to the host so far

    @classmethod
    def from_profile(cls, profile: Profile, expert: ExpertShape) -> CostModel:
        p = profile
        return cls(expert, p.h2d_gbps, p.chunk_latency_s, p.gpu_mem_gbps, p.gpu_tflops,
                   p.gpu_launch_s, p.cpu_mem_gbps, p.cpu_gflops, p.cpu_launch_s)

    def copy_s(self) -> float:
        """One whole expert, host to device."""
        n = len(self.expert.proj_bytes)
        return self.expert.nbytes / (self.copy_gbps * 1e9) + n * self.chunk_latency_s

    def dev_s(self, n_experts: int, pairs: int) -> float:
        """``pairs`` token-expert rows over ``n_experts`` experts in slots, every projection."""
        if n_experts == 0:
            return 0.0
        fl = pairs * self.expert.proj_flops / (self.gpu_tflops * 1e12)
        return sum(self.gpu_launch_s + max(n_experts * nb / (self.gpu_mem_gbps * 1e9), fl)
                   for nb in self.expert.proj_bytes)

    def host_s(self, n_experts: int, pairs: int) -> float:
        """``pairs`` token-expert rows over ``n_experts`` experts, every projection, on the host."""
        if n_experts == 0:
            return 0.0
        fl = pairs * self.expert.proj_flops / (self.cpu_gflops * 1e9)
        t = sum(self.cpu_launch_s + max(n_experts * nb / (self.cpu_mem_gbps * 1e9), fl)
                for nb in self.expert.proj_bytes)
        return t * self.host_scale

    def merge_proj_s(self, pairs: int) -> float:
        """Host rows of one projection of a split layer: inputs read back, results written into
        the device's (a copy each way and a scatter launch)."""
        nbytes = 4.0 * pairs * (self.expert.d_model + self.expert.expert_ff)
        return self.gpu_launch_s + self.chunk_latency_s + nbytes / (self.copy_gbps * 1e9)

    def merge_s(self, pairs: int) -> float:
        """Host rows of a split layer, every projection."""
        return len(self.expert.proj_bytes) * self.merge_proj_s(pairs)

    def plan(self, rows: Sequence[tuple[int, int, bool]], in_flight: int) -> Split:
        """The cheapest way to compute a layer whose experts are ``rows`` (expert, token rows,
        has a slot); ``in_flight`` of those with a slot are still being copied.

        Missing experts with the fewest rows go to the host first, as many as make the later
        side finish soonest (every prefix is tried: the host's launches and the merge are fixed
        costs worth paying only for enough experts); computing the whole layer on the host, as
        the reactive baselines do, is the alternative."""
        missing = sorted(((e, r) for e, r, slotted in rows if not slotted),
                         key=lambda m: (m[1], m[0]))
        n_all, pairs_all = len(rows), sum(r for _, r, _ in rows)
        c = self.copy_s()
        best_t = max(c * (in_flight + len(missing)), self.dev_s(n_all, pairs_all))
        best_k, best_pairs, pairs = 0, 0, 0
        for k, (_, r) in enumerate(missing, start=1):
            pairs += r
            dev = max(c * (in_flight + len(missing) - k), self.dev_s(n_all - k, pairs_all - pairs))
            t = max(dev, self.host_s(k, pairs)) + self.merge_s(pairs)
            if t < best_t:
                best_t, best_k, best_pairs = t, k, pairs
        whole = self.host_s(n_all, pairs_all)
        if whole < best_t:
            self.predicted_host_s += whole / self.host_scale
            return Split([], whole_layer=True)
        if best_k:
            self.predicted_host_s += self.host_s(best_k, best_pairs) / self.host_scale
        return Split([e for e, _ in missing[:best_k]])

    def calibrate(self, h2d_bytes: int, copy_s: float, host_s: float) -> None:
        """Correct the profile with the engine's totals: copy rate, and host time against the
        modelled time of what was sent to the host (``predicted_host_s``)."""
        if copy_s >= MIN_CALIBRATION_S and h2d_bytes > 0:
            n = len(self.expert.proj_bytes)
            per_expert = copy_s / (h2d_bytes / self.expert.nbytes) - n * self.chunk_latency_s
            if per_expert > 0:
                self.copy_gbps = self.expert.nbytes / per_expert / 1e9
        if host_s >= MIN_CALIBRATION_S and self.predicted_host_s > 0:
            self.host_scale = host_s / self.predicted_host_s

"""What the disk tier's reads cost the split (``CostModel.best_split`` with a row's fourth field):
a missing expert not in host memory is read whichever side computes it, and a whole layer on the
host first reads the experts only the device holds, priced by the read rate measured at start on
the model's own experts (``probe_expert_reads``)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from forecache.cache.cost import CostModel, Profile
from forecache.cache.disk import probe_expert_reads, probe_ranges
from forecache.diskprobe import measure_reads
from forecache.gguf.header import read_model_file
from forecache.sim.shapes import shape_of


def _cost() -> CostModel:
    """A 24 GiB card's costs at Qwen3.5-397B-A17B's expert, its profile's 7 GB/s disk."""
    return CostModel.from_profile(Profile.load("rtx4090"),
                                  shape_of("qwen3.5-397b-a17b", "q4_k").expert)


def test_experts_in_host_memory_plan_as_without_a_disk() -> None:
    cost = _cost()
    assert cost.disk_gbps > 0
    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(1, 40))
        rows = [(e, int(rng.integers(1, 64)), bool(rng.random() < 0.6)) for e in range(n)]
        in_flight = int(rng.integers(0, sum(r[2] for r in rows) + 1))
        assert cost.best_split([(*r, True) for r in rows], in_flight) == \
            cost.best_split(rows, in_flight)


def test_a_read_every_choice_makes_leaves_the_split_as_it_was() -> None:
    """A missing expert not in host memory is read whether the host computes it or the device
    copies it: the split is the one without a disk."""
    cost = _cost()
    rng = np.random.default_rng(1)
    for _ in range(200):
        n = int(rng.integers(1, 40))
        rows = [(e, int(rng.integers(1, 64)), bool(rng.random() < 0.6)) for e in range(n)]
        on_disk = [(e, r, s, s or bool(rng.random() < 0.5)) for e, r, s in rows]
        assert cost.best_split(on_disk, 0) == cost.best_split(rows, 0)


def test_computing_a_whole_layer_on_the_host_pays_for_its_reads() -> None:
    """A fast CPU takes the whole layer while every expert is in host memory; when the experts
    with device slots are on disk it would first read them, and the device computes them."""
    cost = _cost()
    cost.cpu_mem_gbps, cost.cpu_launch_s, cost.thread_s, cost.gpu_launch_s = 2000, 1e-6, 0, 1e-3
    whole, t_whole = cost.best_split([(e, 1, e < 4, True) for e in range(10)], 0)
    split, t_split = cost.best_split([(e, 1, e < 4, e >= 4) for e in range(10)], 0)
    assert whole.whole_layer and not split.whole_layer
    assert t_whole < cost.reads_s(4) and t_split < cost.reads_s(4)


def test_the_probe_reads_whole_experts_of_the_model(tiny_model: Callable[..., Path]) -> None:
    mf = read_model_file(tiny_model("q4_k"))
    ranges = probe_ranges(mf)
    tensors = [(mf.data_offset + t.offset, t.nbytes) for il in mf.moe_layers()
               for t in mf.expert_tensors(il)]
    per_expert = {size // mf.n_expert for _, size in tensors}
    assert len(ranges) >= 2 * 3
    for path, off, n in ranges:
        assert path == mf.path
        start, size = next((s, z) for s, z in tensors if s <= off < s + z)
        assert n in per_expert and (off - start) % n == 0 and off + n <= start + size
    layers = {next(il for il in mf.moe_layers() for t in mf.expert_tensors(il)
                   if mf.data_offset + t.offset <= off < mf.data_offset + t.offset + t.nbytes)
              for _, off, _ in ranges}
    assert len(layers) > 1  # spread over the layers, not one tensor's first bytes
    rate = probe_expert_reads(mf, 4)
    assert rate.gbps > 0 and rate.latency_s >= 0 and rate.depth == 4
    assert "GB/s with 4 reads in flight" in rate.describe()


def test_measure_file_reads_unaligned_ranges(tmp_path: Path) -> None:
    path = tmp_path / "blob"
    path.write_bytes(os.urandom(3 << 20))
    rate = measure_reads([(path, 4096 * k + 17, 100_000 + k) for k in range(12)], 3)
    assert rate.gbps > 0 and rate.depth == 3
    with pytest.raises(ValueError, match="at least one range"):
        measure_reads([], 2)

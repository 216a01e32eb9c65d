"""Several devices in the simulator: llama.cpp's layer split, a link per device, and one device
unchanged."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from forecache.cache.cost import Profile
from forecache.sim.devices import (
    device_layers,
    device_slots,
    layer_devices,
    split_of,
    stock_split,
)
from forecache.sim.engine import SimEngine
from forecache.sim.run import buffer_bytes
from forecache.sim.shapes import shape_of
from forecache.sim.simulate import SimConfig, simulate
from forecache.trace.format import Request


def test_layer_split_is_contiguous_and_proportional() -> None:
    # llama.cpp: layer il on the first device whose cumulative share exceeds il / (n + 1)
    d = layer_devices(28, [1.0, 1.0])
    assert d == [0] * 15 + [1] * 14  # 15 layers, then 13 and the output
    assert layer_devices(28, [3.0, 1.0]).count(0) == 22  # il/29 < 0.75: il <= 21
    assert layer_devices(10, [1.0]) == [0] * 11
    for counts in ([17, 11], [78, 16], [0, 28], [5, 5, 18]):
        devs = layer_devices(sum(counts), split_of(counts))
        assert [len(ls) for ls in device_layers(devs[:-1], len(counts))] == counts
        assert devs == sorted(devs)  # contiguous ranges in device order
        assert devs[-1] == len(counts) - 1
    with pytest.raises(ValueError):
        layer_devices(4, [0.0, 0.0])


def test_stock_split_fits_each_card() -> None:
    sh = shape_of("qwen2-57b-a14b", "q8_0")
    gib = 1 << 30
    reserve = buffer_bytes(sh)
    got = stock_split(sh, [24 * gib, 24 * gib], reserve)
    assert got.n_cpu_moe > 0
    layers = device_layers(got.layer_device, 2)
    assert layers[0][0] == 0 and layers[1][-1] == sh.layers - 1
    for d, ls in enumerate(layers):
        used = reserve + (sh.head_bytes if d == 1 else 0) + sum(
            sh.layer_bytes + (0 if il < got.n_cpu_moe else sh.experts * sh.expert_bytes)
            for il in ls)
        assert used <= 24 * gib
    # one host layer fewer fits no split: N is the fewest
    assert sum(got.n_slots(sh)) == (sh.layers - got.n_cpu_moe) * sh.experts
    # a model that fits takes llama.cpp's default (even) split and keeps no host layer
    q4 = shape_of("qwen2-57b-a14b", "q4_k")
    small = stock_split(q4, [24 * gib] * 2, buffer_bytes(q4))
    assert small.n_cpu_moe == 0 and small.split == [24.0 * gib] * 2
    slots = device_slots(sh, layer_devices(sh.layers, [1.0, 1.0]), [24 * gib] * 2,
                         reserve)
    assert min(slots) >= 1 and len(set(slots[:15])) == 1 and len(set(slots[15:])) == 1


def _replay(shape, n_rows: int, seed: int = 0) -> list[Request]:
    rng = np.random.default_rng(seed)
    ex = np.stack([np.stack([rng.choice(shape.experts, shape.top_k, replace=False)
                             for _ in range(shape.layers)]) for _ in range(n_rows)])
    phase = np.r_[np.zeros(40, np.int8), np.ones(n_rows - 40, np.int8)]
    return [Request(experts=ex.astype(np.int16), phase=phase)]


def test_two_devices_copy_over_their_own_links() -> None:
    sh = shape_of("qwen1.5-moe-a2.7b", "q4_k")
    prof = replace(Profile.load("rtx3090x2"), dram_gbps=0.0)
    reqs = _replay(sh, 72)
    devs = tuple(layer_devices(sh.layers, [1.0, 1.0])[:-1])
    cfg = SimConfig("lru", sh.experts // 4, n_ubatch=16, layer_device=devs)
    two = simulate(reqs, sh, prof, cfg).to_json()
    per = [two["h2d_bytes_dev0"], two["h2d_bytes_dev1"]]
    assert all(b > 0 for b in per) and sum(per) == two["h2d_bytes"]
    assert two["devices"] == 2 and two["device_hops"] == 3 + 32  # a boundary per ubatch
    # the same run on one device: the same copies (lru's wait on the critical path layer by
    # layer either way), the two-device run longer by a token's activations through the host
    one = simulate(reqs, sh, prof, replace(cfg, layer_device=None)).to_json()
    assert one["h2d_bytes"] == two["h2d_bytes"] and "h2d_bytes_dev0" not in one
    hop = 2 * (prof.chunk_latency_s + sh.d_model * 4 / (prof.h2d_gbps * 1e9))
    assert two["decode_s"] - one["decode_s"] == pytest.approx(32 * hop, rel=1e-3)
    # stock --n-cpu-moe copies a prompt's host experts up to the card that owns the layer
    ncmoe = SimConfig("ncmoe", [0] * 4 + [sh.experts] * (sh.layers - 4), n_ubatch=32,
                      layer_device=devs)
    r = simulate(reqs, sh, prof, ncmoe).to_json()
    assert r["h2d_bytes_dev0"] == r["h2d_bytes"] > 0 and r["h2d_bytes_dev1"] == 0


def test_engine_links_run_at_once() -> None:
    sh = shape_of("qwen1.5-moe-a2.7b", "q4_k")
    prof = replace(Profile.load("rtx3090x2"), dram_gbps=0.0)
    bus = [0] * (sh.layers // 2) + [1] * (sh.layers - sh.layers // 2)
    n = [2] * sh.layers
    ends = []
    for b in (None, bus):
        eng = SimEngine(sh, n, prof, whole_expert_chunks=True, bus_of=b)
        eng.load(0, 1, 0, 1)
        eng.load(sh.layers - 1, 1, 0, 1)
        ends.append(eng.wait_until(lambda eng=eng: eng.running is None and not any(eng.queue)))
    # two links copy the two experts side by side: half the time of one link
    assert ends[1] == pytest.approx(ends[0] / 2)
    # sharing host DRAM: two links at once keep what DRAM leaves each
    slow = replace(prof, dram_gbps=prof.h2d_gbps * 1.5)
    eng = SimEngine(sh, n, slow, whole_expert_chunks=True, bus_of=bus)
    eng.load(0, 1, 0, 1)
    eng.load(sh.layers - 1, 1, 0, 1)
    t = eng.wait_until(lambda: eng.running is None and not any(eng.queue))
    assert t > ends[1] * 1.1


def test_one_device_unchanged() -> None:
    # a layer_device of one device is the default run, figure for figure
    sh = shape_of("qwen1.5-moe-a2.7b", "q4_k")
    prof = Profile.load("rtx4090")
    reqs = _replay(sh, 60, seed=1)
    for policy in ("lru", "ncmoe"):
        cfg = SimConfig(policy, sh.experts // 4, n_ubatch=16)
        a = simulate(reqs, sh, prof, cfg).to_json()
        b = simulate(reqs, sh, prof, replace(cfg, layer_device=(0,) * sh.layers)).to_json()
        assert a == b

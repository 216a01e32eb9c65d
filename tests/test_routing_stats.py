"""routing_stats returns the known statistics of synthetic traces; the CLI reports them."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from cli_helpers import run_cli

from forecache.trace.format import TraceFile, TraceWriter
from forecache.trace.stats import routing_stats

SHARED_QWEN = Path(__file__).resolve().parents[2] / "shared" / "traces" / \
    "qwen15_moe_a27b_chat_gsm8k25_5layers_batched.npz"


def _save(path: Path, experts: np.ndarray, seq: np.ndarray, **extra: np.ndarray) -> TraceFile:
    """A trace in the shared format (np.savez), opened for reading."""
    n = experts.shape[0]
    np.savez(path, experts=experts.astype(np.int16), seq=seq.astype(np.int32),
             pos=np.zeros(n, np.int32), phase=np.zeros(n, np.int8), **extra)
    return TraceFile(path)


def _random_sets(rng: np.random.Generator, n: int, n_expert: int, k: int) -> np.ndarray:
    """n rows of k distinct experts, uniformly at random."""
    return np.argsort(rng.random((n, n_expert)), axis=1)[:, :k]


def _fixed_set_trace() -> tuple[np.ndarray, np.ndarray]:
    """8 requests of 20 tokens, 2 layers; request r always routes to experts 4j..4j+3 of 16,
    j = r // 2, so the even (training) and the odd (test) requests use the same four sets."""
    rows, seq = [], []
    for r in range(8):
        s = np.arange(4 * (r // 2), 4 * (r // 2) + 4)
        rows.append(np.broadcast_to(s, (20, 2, 4)))
        seq.append(np.full(20, r))
    return np.concatenate(rows), np.concatenate(seq)


def test_round_robin_is_balanced(tmp_path: Path) -> None:
    e, k, n = 8, 2, 64
    ex = (np.arange(n)[:, None] * k + np.arange(k)) % e
    s = routing_stats(_save(tmp_path / "rr.npz", ex[:, None, :], np.zeros(n)))
    layer = s.layers[0]
    assert layer.load_entropy == pytest.approx(1.0, abs=1e-12)
    assert layer.max_share == pytest.approx(1 / e)
    assert layer.share == pytest.approx([1 / e] * e)
    # uniform load: an independent token holds a given expert with probability k/E
    for w in (1, 4, 16):
        assert layer.reuse_independent[w] == pytest.approx(1 - (1 - k / e) ** w)
    assert s.summary()["max_share_vs_uniform"] == pytest.approx(1.0)


def test_fixed_set_per_request(tmp_path: Path) -> None:
    ex, seq = _fixed_set_trace()
    s = routing_stats(_save(tmp_path / "fixed.npz", ex, seq))
    assert (s.n_requests, s.n_expert, s.top_k) == (8, 16, 4)
    for layer in s.layers:
        assert layer.reuse == {1: 1.0, 4: 1.0, 16: 1.0}
        assert layer.request_entropy == pytest.approx(math.log(4) / math.log(16))
        assert layer.load_entropy == pytest.approx(1.0)  # the 4 sets cover all 16 experts evenly
        assert layer.reuse_independent[1] == pytest.approx(0.25)
    # identical layers: every test set was seen in training and predicts itself
    (pair,) = s.pairs
    assert pair.cond_accuracy == 1.0 and pair.seen_fraction == 1.0
    # all experts tie in training; the popular four (0-3) are right for 1 test request of 4
    assert pair.popular_accuracy == pytest.approx(0.25)


def test_reuse_windows_by_hand(tmp_path: Path) -> None:
    ex = np.array([0, 1, 0, 2, 2])[:, None, None]
    s = routing_stats(_save(tmp_path / "hand.npz", ex, np.zeros(5)), windows=(1, 2, 4, 5))
    # w=1: t=0..3, only t=3 (2 -> 2) reuses; w=2: t=0..2, only t=0 (0 again at t=2)
    # w=4: only t=0 qualifies; w=5 would need a token past the request's end
    assert s.layers[0].reuse[1] == pytest.approx(0.25)
    assert s.layers[0].reuse[2] == pytest.approx(1 / 3)
    assert s.layers[0].reuse[4] == 1.0
    assert math.isnan(s.layers[0].reuse[5])


def test_reuse_stops_at_request_boundary(tmp_path: Path) -> None:
    # each request uses one expert, the next request another: no reuse crosses the boundary
    ex = np.repeat(np.arange(10), 3)[:, None, None]
    s = routing_stats(_save(tmp_path / "b.npz", ex, np.repeat(np.arange(10), 3)))
    assert s.layers[0].reuse[1] == 1.0
    assert math.isnan(s.layers[0].reuse[4])  # no request is 5 tokens long


def test_permuted_layer_agrees_fully(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    e, k, n = 16, 4, 2000
    perm = rng.permutation(e)
    l0 = _random_sets(rng, n, e, k)
    ex = np.stack([l0, perm[l0]], axis=1)
    s = routing_stats(_save(tmp_path / "perm.npz", ex, np.arange(n) // 100))
    (pair,) = s.pairs
    assert pair.nmi == pytest.approx(1.0)
    assert pair.nmi_adjusted == pytest.approx(1.0)
    assert pair.cond_accuracy == 1.0
    assert pair.seen_fraction < 1.0  # most sets are new: the pairwise back-off carries them
    assert pair.popular_accuracy < 0.5


def test_independent_layers_do_not_agree(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    e, k, n = 8, 2, 20000
    ex = np.stack([_random_sets(rng, n, e, k), _random_sets(rng, n, e, k)], axis=1)
    s = routing_stats(_save(tmp_path / "ind.npz", ex, np.arange(n) // 200))
    (pair,) = s.pairs
    assert abs(pair.nmi_adjusted) < 0.01
    assert pair.nmi < 0.01
    assert pair.cond_accuracy == pytest.approx(pair.popular_accuracy, abs=0.03)
    # independent tokens: reuse matches its independent expectation
    for layer in s.layers:
        for w in (1, 4, 16):
            assert layer.reuse[w] == pytest.approx(layer.reuse_independent[w], abs=0.02)


def test_unknown_rows_are_skipped(tmp_path: Path) -> None:
    rng = np.random.default_rng(6)
    n = 200
    seq = np.arange(n) // 20
    ex = np.stack([_random_sets(rng, n, 8, 2), _random_sets(rng, n, 8, 2),
                   np.full((n, 2), -1)], axis=1)  # layer 2 never known
    ex[::3, 1] = -1
    ex[5, 0, 1] = -1  # one unknown slot drops the whole row of that layer
    s = routing_stats(_save(tmp_path / "holes.npz", ex, seq))
    assert [x.layer for x in s.layers] == [0, 1]
    for layer in s.layers:
        keep = (ex[:, layer.layer] >= 0).all(1)
        # the same layer with its unknown rows deleted outright
        ref = routing_stats(_save(tmp_path / f"ref{layer.layer}.npz",
                                  ex[keep][:, [layer.layer]], seq[keep])).layers[0]
        assert layer.tokens == ref.tokens == keep.sum()
        assert layer.reuse == ref.reuse and layer.share == pytest.approx(ref.share)
        assert layer.load_entropy == pytest.approx(ref.load_entropy)
        assert layer.request_entropy == pytest.approx(ref.request_entropy)
    assert s.pairs[0].tokens == n - 67 - 1


def test_partial_layers_and_batched_units(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    n = 300
    ex = np.full((n, 6, 2), -1)
    ex[:, 1] = _random_sets(rng, n, 8, 2)
    ex[:, 4] = ex[:, 1]
    s = routing_stats(_save(tmp_path / "p.npz", ex, np.full(n, -1), step=np.arange(n) // 10))
    assert s.n_requests == 30
    assert [(p.src, p.dst) for p in s.pairs] == [(1, 4)]
    assert any("apart" in note for note in s.notes)
    assert any("forward pass" in note for note in s.notes)


def test_single_request_splits_in_halves(tmp_path: Path) -> None:
    rng = np.random.default_rng(4)
    l0 = _random_sets(rng, 400, 8, 2)
    s = routing_stats(_save(tmp_path / "one.npz", np.stack([l0, l0], 1), np.zeros(400)))
    assert s.n_requests == 1 and s.pairs[0].test_tokens == 200
    assert s.pairs[0].cond_accuracy == 1.0
    assert any("half" in note for note in s.notes)


def _written_trace(path: Path) -> Path:
    rng = np.random.default_rng(5)
    with TraceWriter(path, n_layers=3, top_k=2, meta={"n_expert": 8, "model_name": "t.gguf"}) \
            as w:
        for _ in range(6):
            t = 12
            w.add_request(_random_sets(rng, t * 3, 8, 2).reshape(t, 3, 2),
                          token_ids=np.arange(t), phase=(np.arange(t) >= 4).astype(np.int8))
    return path


def test_cli_json(tmp_path: Path) -> None:
    path = _written_trace(tmp_path / "w.npz")
    res = run_cli("routing-stats", str(path), "--json", check=True)
    d = json.loads(res.stdout)
    assert d["model"] == "t.gguf"
    assert (d["n_tokens"], d["n_requests"], d["n_expert"], d["top_k"]) == (72, 6, 8, 2)
    assert (d["prefill_tokens"], d["decode_tokens"]) == (24, 48)
    assert d["layers_with_data"] == [0, 1, 2] and len(d["pairs"]) == 2
    assert len(d["layers"][0]["share"]) == 8
    assert sum(d["layers"][0]["share"]) == pytest.approx(1.0, abs=1e-5)
    assert set(d["summary"]["reuse"]) == {"1", "4", "16"}
    assert 0 < d["summary"]["load_entropy"] <= 1


def test_cli_text(tmp_path: Path) -> None:
    path = _written_trace(tmp_path / "w.npz")
    res = run_cli("routing-stats", str(path), "--per-layer", check=True)
    assert res.stdout.startswith("w.npz, model t.gguf: 72 tokens (24 prefill, 48 decode)")
    assert "load entropy" in res.stdout and "0->1" in res.stdout


@pytest.mark.parametrize("content", [b"not a zip", None])
def test_cli_bad_file(tmp_path: Path, content: bytes | None) -> None:
    path = tmp_path / "bad.npz"
    if content is None:
        n = 5
        np.savez(path, experts=np.full((n, 2, 2), -1, np.int16), seq=np.zeros(n, np.int32))
    else:
        path.write_bytes(content)
    res = run_cli("routing-stats", str(path))
    assert res.returncode == 1
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("forecache: error: ")


@pytest.mark.skipif(not SHARED_QWEN.is_file(), reason="shared traces absent")
def test_shared_qwen_trace_reads() -> None:
    with TraceFile(SHARED_QWEN) as tr:
        s = routing_stats(tr)
    assert [x.layer for x in s.layers] == [0, 8, 12, 18, 23]
    assert s.n_tokens == 4357

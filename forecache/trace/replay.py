"""Routing replay: run a model on a recorded routing instead of its own router's.

A model made with random weights routes a handful of experts, which flatters any cache; benchmarks
replay a real model's routing instead (a shared trace, or ``synth-trace`` fitted to one). Every
expert matmul then reads the experts and router weights of the trace's rows (``forecache.h``,
``forecache_replay_*``): llama.cpp's kernels, copies and CPU compute run as they would on that
routing, for every placement alike, stock ones included. The tokens computed are meaningless.

The trace is mapped onto the model: model MoE layer j reads trace layer ``j * L_trace // L_model``;
expert ids past the model's experts and unknown ones (-1) are replaced, and rows with fewer
experts than the model routes are completed, by the experts the same layer routed at the closest
earlier rows (then the lowest free ids), so a token never names an expert twice; such rows, and
weights the trace lacks (0), weigh each expert ``1 / k``. Prompt tokens (a batch of more than one
token) read the trace's prefill rows and generated tokens its decode rows, each in order and from
the start again when used up; a trace with one phase serves both. In a batch job each request
reads each phase's rows in order from a start of its own, found by (sequence, position) in
whichever ubatch llama.cpp computes it.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from forecache.trace.format import Request, TraceError, TraceFile
from forecache.trace.stats import lru_hit_rate

# rows between the starts of two requests of a batch job in a phase's rows (a prime: successive
# requests start far apart, and wrap onto rows no earlier request started at)
REQUEST_STRIDE = 7919


class ReplayError(ValueError):
    """A routing replay that cannot run; the message names the trace or the model and the fix."""


@dataclass
class Routing:
    """A trace's routing at a model's shape: one row per token, one column per MoE layer."""

    experts: np.ndarray  # int32 [N, L, k]: distinct valid ids in every row and layer
    weights: np.ndarray  # float32 [N, L, k]
    phase: np.ndarray  # int8 [N]: 0 prefill, 1 decode
    source: str = ""

    def rows(self, decode: bool) -> np.ndarray:
        """Indices of the rows that tokens of this phase read, in order."""
        want = 1 if decode else 0
        rows = np.flatnonzero(self.phase == want)
        return rows if rows.size else np.arange(len(self.phase))

    def decode_hit_rate(self, n_slots: int) -> tuple[float, int]:
        """The hit rate of a per-layer LRU cache of ``n_slots`` experts over this routing's decode
        rows (every row passing through it), and the decode lookups it counts."""
        req = Request(experts=self.experts, phase=self.phase)
        lookups = int((self.phase == 1).sum()) * self.experts.shape[1] * self.experts.shape[2]
        return lru_hit_rate([req], n_slots, phase=1), lookups

    def counts(self, moe_layers: list[int], n_layer: int, n_expert: int) -> np.ndarray:
        """Routed-expert counts [n_layer, n_expert] over every row (llama.cpp's blocks; the
        static policy's profile of this routing)."""
        out = np.zeros((n_layer, n_expert), dtype=np.int64)
        for j, il in enumerate(moe_layers):
            out[il] = np.bincount(self.experts[:, j, :].ravel(), minlength=n_expert)[:n_expert]
        return out


def _complete(row: np.ndarray, prev: list[np.ndarray], n_expert: int, k: int) -> np.ndarray:
    """``row``'s valid distinct ids, completed to ``k`` from the earlier rows ``prev`` (latest
    first), then the lowest ids not used."""
    out: list[int] = []
    seen: set[int] = set()
    for e in row.tolist():
        if 0 <= e < n_expert and e not in seen:
            out.append(e)
            seen.add(e)
        if len(out) == k:
            return np.asarray(out, dtype=np.int32)
    for p in prev:
        for e in p.tolist():
            if e not in seen:
                out.append(e)
                seen.add(e)
                if len(out) == k:
                    return np.asarray(out, dtype=np.int32)
    e = 0
    while len(out) < k:
        if e not in seen:
            out.append(e)
        e += 1
    return np.asarray(out, dtype=np.int32)


def map_routing(experts: np.ndarray, weights: np.ndarray | None, phase: np.ndarray | None, *,
                n_layers: int, n_expert: int, top_k: int, source: str = "") -> Routing:
    """A trace's rows (``experts`` int [N, L_t, k_t], ``weights`` the same or None) at a model
    with ``n_layers`` MoE layers of ``n_expert`` experts, ``top_k`` per token (module docstring)."""
    if experts.ndim != 3 or experts.shape[0] == 0:
        raise ReplayError(f"{source or 'the trace'} has no routed rows to replay")
    n, lt, kt = experts.shape
    out = np.empty((n, n_layers, top_k), dtype=np.int32)
    w = np.full((n, n_layers, top_k), 1.0 / top_k, dtype=np.float32)
    for j in range(n_layers):
        src = j * lt // n_layers
        ex = experts[:, src, :].astype(np.int32)
        direct = np.zeros(n, dtype=bool)
        if kt >= top_k:
            head = ex[:, :top_k]
            direct = ((head >= 0) & (head < n_expert)).all(axis=1)
            direct &= (np.diff(np.sort(head, axis=1), axis=1) != 0).all(axis=1)
            out[direct, j, :] = head[direct]
        recent: list[np.ndarray] = []
        for t in range(n):
            if not direct[t]:
                out[t, j, :] = _complete(ex[t], recent, n_expert, top_k)
            recent.insert(0, out[t, j, :])
            del recent[8:]
        if weights is not None:
            wt = weights[:, src, :].astype(np.float32)
            m = min(kt, top_k)
            keep = direct[:, None] & (wt[:, :m] > 0)
            w[:, j, :m] = np.where(keep, wt[:, :m], w[:, j, :m])
    ph = np.zeros(n, dtype=np.int8) if phase is None else np.asarray(phase, dtype=np.int8)
    return Routing(out, w, ph, source)


def load_routing(path: str | Path, *, n_layers: int, n_expert: int, top_k: int) -> Routing:
    """The routing of the trace at ``path`` mapped onto a model's shape."""
    p = Path(path)
    if not p.is_file():
        raise ReplayError(f"routing trace {p} does not exist: give a trace written by "
                          "`forecache trace` or `forecache synth-trace`, or a shared one")
    try:
        with TraceFile(p) as tf:
            ex = np.asarray(tf.array("experts"))
            wt = np.asarray(tf.array("weights")) if tf.has("weights") else None
            ph = np.asarray(tf.array("phase")) if tf.has("phase") else None
    except TraceError as e:
        raise ReplayError(str(e)) from e  # names the file and the fix
    except (OSError, ValueError, KeyError) as e:
        raise ReplayError(f"routing trace {p} cannot be read ({e}): give a .npz trace") from e
    return map_routing(ex, wt, ph, n_layers=n_layers, n_expert=n_expert, top_k=top_k,
                       source=p.name)


@dataclass
class RoutingReplay:
    """Feeds a :class:`Routing` to a llama.cpp context, one ubatch at a time.

    ``attach`` installs it (after the expert cache, if any). Before each llama_decode, either
    ``before_batch`` (a batch that is one ubatch, read in order) or ``before_rows`` (a batch
    job's rows by sequence and position, however llama.cpp splits them)."""

    routing: Routing
    moe_layers: list[int]  # llama.cpp block of each MoE layer
    n_layer: int  # llama.cpp blocks
    n_ubatch: int
    _lib: ctypes.CDLL | None = None
    _handle: int | None = None
    _next: dict[bool, int] = field(default_factory=lambda: {False: 0, True: 0})
    tokens: int = 0  # rows fed so far
    _dev: int = 0

    def attach(self, lib: ctypes.CDLL, ctx: int, dev_index: int) -> None:
        """Install the replay in llama.cpp context ``ctx`` (tables on device ``dev_index``)."""
        err = ctypes.create_string_buffer(512)
        h = lib.forecache_replay_init(ctx, self.n_ubatch, dev_index, err, len(err))
        if not h:
            raise ReplayError(f"routing replay: {err.value.decode(errors='replace')}")
        self._lib, self._handle, self._dev = lib, h, dev_index

    def sibling(self, ctx: int) -> RoutingReplay:
        """The same routing replayed in another context of the model (a micro-batch's)."""
        if self._lib is None:
            raise ReplayError("routing replay used before attach")
        other = RoutingReplay(self.routing, self.moe_layers, self.n_layer, self.n_ubatch)
        other.attach(self._lib, ctx, self._dev)
        return other

    def table(self, n_tokens: int) -> tuple[np.ndarray, np.ndarray]:
        """The next ``n_tokens`` tokens' ids and weights, [n_layer, n_tokens, k] each (blocks
        without experts left 0), advancing the phase's row cursor."""
        decode = n_tokens == 1
        rows = self.routing.rows(decode)
        start = self._next[decode]
        pick = rows[(start + np.arange(n_tokens)) % rows.size]
        self._next[decode] = (start + n_tokens) % rows.size
        self.tokens += n_tokens
        ids, w = self._rows(pick)
        return (np.ascontiguousarray(ids.transpose(1, 0, 2)),
                np.ascontiguousarray(w.transpose(1, 0, 2)))

    def _rows(self, pick: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Routing rows ``pick``'s ids and weights, [len(pick), n_layer, k] each (blocks
        without experts left 0)."""
        k = self.routing.experts.shape[2]
        ids = np.zeros((len(pick), self.n_layer, k), dtype=np.int32)
        w = np.zeros((len(pick), self.n_layer, k), dtype=np.float32)
        ids[:, self.moe_layers] = self.routing.experts[pick]
        w[:, self.moe_layers] = self.routing.weights[pick]
        return ids, w

    def pick(self, request: int, decode: bool, offset: int) -> int:
        """The routing row that token ``offset`` of a phase of a batch job's request reads: the
        ``request``-th request admitted reads the phase's rows in order from a start of its own
        (``REQUEST_STRIDE`` rows after the previous request's), so each sequence keeps the
        trace's token-to-token locality and the sequences of a step route like different
        requests; a request's rows are the same whichever sequences it shares steps with."""
        rows = self.routing.rows(decode)
        return int(rows[(request * REQUEST_STRIDE + offset) % rows.size])

    def before_rows(self, seqs: Sequence[int], pos: Sequence[int], picks: Sequence[int]) -> None:
        """Set the routing of the rows of the batch about to be decoded, which llama.cpp may
        split into several ubatches: row i, sequence ``seqs[i]`` at position ``pos[i]``, reads
        routing row ``picks[i]`` (``pick``)."""
        if self._lib is None or self._handle is None:
            raise ReplayError("routing replay used before attach")
        n = len(picks)
        ids, w = self._rows(np.asarray(picks, dtype=np.int64))
        q = np.ascontiguousarray(seqs, dtype=np.int32)
        p = np.ascontiguousarray(pos, dtype=np.int32)
        i32 = ctypes.POINTER(ctypes.c_int32)
        rc = self._lib.forecache_replay_set_rows(
            self._handle, n, q.ctypes.data_as(i32), p.ctypes.data_as(i32),
            ids.ctypes.data_as(i32), w.ctypes.data_as(ctypes.POINTER(ctypes.c_float)))
        if rc != 0:
            raise ReplayError(f"routing replay: could not set a batch of {n} rows (a sequence "
                              "at the same position twice)")
        self.tokens += n

    def before_rows_of_decode(self, pos: int, n_tokens: int) -> None:
        """Set the routing of a verification: ``n_tokens`` rows of sequence 0 from position
        ``pos``, reading the decode rows that plain decoding would give the same positions
        (from the phase's cursor on, which ``advance_decode`` moves past the tokens kept), so a
        token routes alike however many of it were drafted, accepted or computed again."""
        rows = self.routing.rows(True)
        start = self._next[True]
        picks = rows[(start + np.arange(n_tokens)) % rows.size]
        self.before_rows([0] * n_tokens, range(pos, pos + n_tokens), picks.tolist())

    def advance_decode(self, n_tokens: int) -> None:
        """``n_tokens`` decode rows used by tokens kept (``before_rows_of_decode``)."""
        rows = self.routing.rows(True)
        self._next[True] = (self._next[True] + n_tokens) % rows.size

    def before_batch(self, n_tokens: int) -> None:
        """Set the routing of the batch about to be decoded."""
        if self._lib is None or self._handle is None:
            raise ReplayError("routing replay used before attach")
        if n_tokens > self.n_ubatch:
            raise ReplayError(f"a batch of {n_tokens} tokens is more than one ubatch "
                              f"({self.n_ubatch}); replay needs n_batch == n_ubatch")
        ids, w = self.table(n_tokens)
        rc = self._lib.forecache_replay_set(
            self._handle, n_tokens, ids.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)),
            w.ctypes.data_as(ctypes.POINTER(ctypes.c_float)))
        if rc != 0:
            raise ReplayError(f"routing replay: could not set a batch of {n_tokens} tokens")

    def check(self) -> int:
        """Expert matmuls rewritten so far; raises if a graph could not be rewritten (its ubatch
        ran the model's own routing)."""
        if self._lib is None or self._handle is None:
            return 0
        n = int(self._lib.forecache_replay_rewritten(self._handle))
        if n < 0:
            raise ReplayError("routing replay: a graph could not be rewritten (llama.cpp's log "
                              "says why); the run did not replay the trace")
        return n

    def close(self) -> None:
        """Remove the replay from its context."""
        if self._lib is not None and self._handle is not None:
            self._lib.forecache_replay_free(self._handle)
        self._handle = None

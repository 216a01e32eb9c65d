"""Routing traces on disk: one ``.npz`` format, written as a stream and read without loading it.

A trace is a zip of ``.npy`` arrays, one row per token in execution order (requests one after the
other), a superset of the format of ../shared/traces:

========== ========================= ====================================================
array      dtype / shape             meaning
========== ========================= ====================================================
experts    int16 [N, L, k]           routed expert ids of each MoE layer, in router order;
                                     -1 = unknown
seq        int32 [N]                 request index (-1 = unknown)
pos        int32 [N]                 position of the token in its request
phase      int8  [N]                 0 prefill, 1 decode (a generated token fed back)
weights    float16 [N, L, k]         router weight of each routed expert (0 = unknown)
token_ids  int32 [N]                 the token that entered the model at that row
gate_input float16 [N, L, d]         router input (the normed hidden state) per MoE layer;
                                     only with ``forecache trace --gate-input``
meta       0-d str (JSON)            format version, model identity and shape, MoE layer
                                     indices (``moe_layers``), prompt source, ...
========== ========================= ====================================================

Layer index l is the l-th MoE layer. Arrays are stored uncompressed, so readers memory-map them
(a trace may be larger than memory); compressed members (the shared traces) are loaded whole.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import zipfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.lib.format as npformat

FORMAT_VERSION = 1
ROW_ARRAYS: dict[str, np.dtype] = {
    "experts": np.dtype(np.int16),
    "seq": np.dtype(np.int32),
    "pos": np.dtype(np.int32),
    "phase": np.dtype(np.int8),
    "weights": np.dtype(np.float16),
    "token_ids": np.dtype(np.int32),
    "gate_input": np.dtype(np.float16),
}
_COPY_CHUNK = 16 << 20


@dataclass
class Request:
    """One request's rows of a trace (tokens in execution order)."""

    experts: np.ndarray  # int16 [T, L, k]; -1 = unknown
    token_ids: np.ndarray | None = None  # int32 [T]
    weights: np.ndarray | None = None  # float16 [T, L, k]
    gate_input: np.ndarray | None = None  # float16 [T, L, d] (may be a memory map)
    phase: np.ndarray | None = None  # int8 [T]: 0 prefill, 1 decode

    @property
    def n_tokens(self) -> int:
        return int(self.experts.shape[0])


def logged_layers(requests: Sequence[Request], n_layers: int) -> list[int]:
    """The layers of ``n_layers`` whose routing ``requests`` logged somewhere."""
    return [il for il in range(n_layers) if any((r.experts[:, il] >= 0).any() for r in requests)]


class TraceError(ValueError):
    """A trace file is missing, corrupt or not what a tool needs; the message says which."""


class TraceWriter:
    """Appends requests to a trace; ``close`` assembles the ``.npz`` and renames it into place.

    Rows go to one raw file per array in a side directory, so memory stays bounded by one request.
    Leaving the ``with`` block through an exception removes everything unless ``keep_partial``
    is set, in which case the requests completed so far are kept as a valid (shorter) trace.
    """

    def __init__(self, path: str | os.PathLike[str], *, n_layers: int, top_k: int,
                 n_embd: int | None = None, meta: dict[str, Any] | None = None) -> None:
        self.path = Path(path)
        if self.path.suffix != ".npz":
            raise TraceError(f"{self.path}: a trace file name must end in .npz")
        if not self.path.parent.is_dir():
            raise TraceError(f"{self.path.parent} is not a directory; create it first")
        self.n_layers, self.top_k, self.n_embd = n_layers, top_k, n_embd
        self.meta = dict(meta or {})
        self.n_rows = 0
        self.n_requests = 0
        self.keep_partial = False
        self._dir = self.path.with_name(f".{self.path.name}.{os.getpid()}.parts")
        shutil.rmtree(self._dir, ignore_errors=True)
        self._dir.mkdir()
        names = [n for n in ROW_ARRAYS if n != "gate_input" or n_embd is not None]
        self._files = {n: open(self._dir / n, "wb") for n in names}  # noqa: SIM115

    def add_request(self, experts: np.ndarray, *, token_ids: np.ndarray, phase: np.ndarray,
                    weights: np.ndarray | None = None, gate_input: np.ndarray | None = None,
                    ) -> None:
        """Append one request's rows (experts [T, L, k]; gate_input [T, L, d] when the writer
        was made with ``n_embd``)."""
        t = int(experts.shape[0])
        if experts.shape[1:] != (self.n_layers, self.top_k):
            raise TraceError(f"experts shape {experts.shape[1:]} != ({self.n_layers}, "
                             f"{self.top_k})")
        if weights is None:
            weights = np.zeros(experts.shape, np.float16)
        rows = {
            "experts": experts, "seq": np.full(t, self.n_requests), "pos": np.arange(t),
            "phase": phase, "weights": weights, "token_ids": token_ids,
        }
        if "gate_input" in self._files:
            if gate_input is None or gate_input.shape != (t, self.n_layers, self.n_embd):
                raise TraceError("this trace records gate inputs: give [T, L, n_embd] for each "
                                 "request")
            rows["gate_input"] = gate_input
        for name, arr in rows.items():
            a = np.ascontiguousarray(arr, dtype=ROW_ARRAYS[name])
            if a.shape[0] != t:
                raise TraceError(f"{name} has {a.shape[0]} rows, experts has {t}")
            self._files[name].write(a.tobytes())
        self.n_rows += t
        self.n_requests += 1

    def close(self) -> Path:
        """Write the ``.npz`` (atomically) and remove the side directory."""
        for f in self._files.values():
            f.close()
        meta = {**self.meta, "format_version": FORMAT_VERSION, "n_layers": self.n_layers,
                "top_k": self.top_k, "n_requests": self.n_requests}
        if self.n_embd is not None:
            meta["n_embd"] = self.n_embd
        tail = {"experts": (self.n_layers, self.top_k), "weights": (self.n_layers, self.top_k),
                "gate_input": (self.n_layers, self.n_embd or 0)}
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.partial")
        try:
            with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
                for name in self._files:
                    shape = (self.n_rows, *tail.get(name, ()))
                    with open(self._dir / name, "rb") as src, \
                            zf.open(f"{name}.npy", "w", force_zip64=True) as dst:
                        _write_npy_header(dst, ROW_ARRAYS[name], shape)
                        shutil.copyfileobj(src, dst, _COPY_CHUNK)
                with zf.open("meta.npy", "w") as dst:
                    np.lib.format.write_array(dst, np.array(json.dumps(meta, sort_keys=True)))
            os.replace(tmp, self.path)
        finally:
            tmp.unlink(missing_ok=True)
            shutil.rmtree(self._dir, ignore_errors=True)
        return self.path

    def abort(self) -> None:
        """Drop everything written."""
        for f in self._files.values():
            f.close()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None or (self.keep_partial and self.n_requests > 0):
            self.close()
        else:
            self.abort()


def _write_npy_header(fp: Any, dtype: np.dtype, shape: tuple[int, ...]) -> None:
    header = {"descr": npformat.dtype_to_descr(dtype), "fortran_order": False, "shape": shape}
    npformat.write_array_header_2_0(fp, header)


@dataclass
class TraceInfo:
    """Shape and provenance of a trace."""

    n_tokens: int
    n_layers: int
    top_k: int
    n_expert: int
    n_requests: int
    has_gate_input: bool
    meta: dict[str, Any]
    arrays: tuple[str, ...] = ()


class TraceFile:
    """A trace opened for reading; arrays are memory-mapped where the file allows it."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise TraceError(f"{self.path}: no such trace file (record one with `forecache "
                             "trace`)")
        try:
            self._zip = zipfile.ZipFile(self.path)
        except (zipfile.BadZipFile, OSError) as e:
            raise TraceError(f"{self.path}: not a trace file ({e}); record it again with "
                             "`forecache trace`") from e
        self._members = {Path(n).stem: n for n in self._zip.namelist()}
        if "experts" not in self._members:
            raise TraceError(f"{self.path}: no `experts` array, so it is not a routing trace")
        self._cache: dict[str, np.ndarray] = {}
        self.meta: dict[str, Any] = {}
        if "meta" in self._members:
            try:
                self.meta = json.loads(str(self._load("meta")))
            except ValueError as e:
                raise TraceError(f"{self.path}: unreadable meta ({e})") from e
            if int(self.meta.get("format_version", 1)) > FORMAT_VERSION:
                raise TraceError(f"{self.path}: trace format {self.meta['format_version']} is "
                                 "newer than this forecache reads; upgrade forecache")
        ex = self.array("experts")
        if ex.ndim != 3:
            raise TraceError(f"{self.path}: experts must be [tokens, layers, k], got {ex.shape}")
        n = ex.shape[0]
        for name in ROW_ARRAYS:
            if name in self._members and self.array(name).shape[0] != n:
                raise TraceError(f"{self.path}: {name} has {self.array(name).shape[0]} rows, "
                                 f"experts has {n}; the file is damaged")

    # -- arrays ---------------------------------------------------------------------------------
    def has(self, name: str) -> bool:
        return name in self._members

    def array(self, name: str) -> np.ndarray:
        """The named array (memory-mapped when stored uncompressed)."""
        if name not in self._cache:
            if name not in self._members:
                raise TraceError(f"{self.path}: no `{name}` array in this trace")
            self._cache[name] = self._load(name)
        return self._cache[name]

    def _load(self, name: str) -> np.ndarray:
        member = self._members[name]
        info = self._zip.getinfo(member)
        try:
            if info.compress_type == zipfile.ZIP_STORED and name != "meta":
                return self._memmap(info)
            with self._zip.open(member) as f:
                return np.lib.format.read_array(f, allow_pickle=False)
        except (ValueError, OSError, zipfile.BadZipFile, EOFError) as e:
            raise TraceError(f"{self.path}: array {name} is unreadable ({e}); the file is "
                             "damaged") from e

    def _memmap(self, info: zipfile.ZipInfo) -> np.ndarray:
        with open(self.path, "rb") as f:
            f.seek(info.header_offset)
            local = f.read(30)
            if local[:4] != b"PK\x03\x04":
                raise ValueError("bad local header")
            name_len, extra_len = struct.unpack("<HH", local[26:30])
            start = info.header_offset + 30 + name_len + extra_len
            f.seek(start)
            major, _ = npformat.read_magic(f)
            if major == 1:
                shape, fortran, dtype = npformat.read_array_header_1_0(f)
            else:
                shape, fortran, dtype = npformat.read_array_header_2_0(f)
            if fortran:
                raise ValueError("Fortran-ordered arrays are not used in traces")
            offset = f.tell()
        if int(np.prod(shape)) == 0:
            return np.zeros(shape, dtype)
        return np.memmap(self.path, dtype=dtype, mode="r", offset=offset, shape=shape)

    # -- shape ----------------------------------------------------------------------------------
    def info(self) -> TraceInfo:
        ex = self.array("experts")
        n_expert = int(self.meta.get("n_expert") or (int(ex.max()) + 1 if ex.size else 0))
        return TraceInfo(int(ex.shape[0]), int(ex.shape[1]), int(ex.shape[2]), n_expert,
                         len(self.units()), self.has("gate_input"), self.meta,
                         tuple(sorted(self._members)))

    def units(self) -> list[np.ndarray]:
        """Row indices of each request, in order. Rows with an unknown request (seq -1) are
        grouped by forward pass (``step``) where the trace has it, else by contiguous run."""
        n = self.array("experts").shape[0]
        seq = np.asarray(self.array("seq")) if self.has("seq") else np.zeros(n, np.int32)
        key = seq.astype(np.int64)
        unknown = key < 0
        if unknown.any():
            if self.has("step"):
                key[unknown] = -1 - np.asarray(self.array("step"), np.int64)[unknown]
            else:
                key[unknown] = -1
        # a new unit starts wherever the key changes (requests are contiguous in execution order)
        starts = np.flatnonzero(np.r_[True, key[1:] != key[:-1]])
        ends = np.r_[starts[1:], n]
        return [np.arange(s, e) for s, e in zip(starts, ends, strict=True)]

    def request(self, rows: np.ndarray, *, gate_input: bool = True) -> Request:
        """The rows of one request as a :class:`Request` (a view when the rows are contiguous)."""
        sl: slice | np.ndarray = rows
        if len(rows) and rows[-1] - rows[0] + 1 == len(rows):
            sl = slice(int(rows[0]), int(rows[-1]) + 1)

        def get(name: str) -> np.ndarray | None:
            return self.array(name)[sl] if self.has(name) else None

        return Request(experts=np.asarray(self.array("experts")[sl]), token_ids=get("token_ids"),
                       weights=get("weights"), phase=get("phase"),
                       gate_input=get("gate_input") if gate_input else None)

    def requests(self, *, gate_input: bool = True) -> Iterator[Request]:
        """Every request in order, read lazily."""
        for rows in self.units():
            yield self.request(rows, gate_input=gate_input)

    def close(self) -> None:
        self._cache.clear()
        self._zip.close()

    def __enter__(self) -> TraceFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

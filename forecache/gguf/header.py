"""Reading a GGUF file's header without loading it, and refusing files forecache cannot run.

Every command checks its model here first, so a missing, truncated, non-GGUF or non-MoE file gets a
one-line error instead of a crash inside llama.cpp.

Why a reader of our own beside gguf-py's ``GGUFReader`` (which forecache uses where it needs
tensor data, e.g. ``predictor.skip``): ``GGUFReader`` builds numpy parts for every element of
every array (the vocabulary and the merges) and a view for every tensor, which takes about 35x as
long on the default model (370 ms against 10 ms, growing with the vocabulary), and a damaged
file surfaces as numpy's errors ("cannot reshape array ...", an IndexError, "cannot mmap an empty
file"). This reader walks the header once, keeps only the lengths of long arrays, never reads
tensor data, checks counts against the file's size and the tensors' extent against its length
(a file cut short, or one with more than a few bytes after its tensors, is refused),
and raises :class:`GGUFError` with one line naming the fix; as it reads it also records for
``checks`` what llama.cpp asserts on (each key's value type, the first duplicated token).

A split model (llama.cpp's ``NAME-00001-of-0000N.gguf``, written by gguf-split or GGUFWriter's
split limits: the metadata in the first file, ``split.*`` keys in every one) is read from its
first file as llama.cpp reads it: the other shards are found by name, each is checked as a file
of its own and against the first, and the model is their tensors together, each knowing its
file (:attr:`TensorInfo.shard`). Everything that reads a model therefore sees the same model
whether it is one file or several.
"""

from __future__ import annotations

import dataclasses
import functools
import mmap
import os
import re
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from forecache.errors import setting
from forecache.gguf.base import (  # noqa: F401  (re-exported: the names readers import)
    EXPERT_TENSOR_PATTERN,
    EXPERT_TENSOR_SUFFIX,
    GGUFError,
    is_expert_tensor,
)
from forecache.gguf.checks import check_header

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# Arrays longer than this (token lists, merges) are not materialised; only their length is kept.
MAX_ARRAY_KEEP = 64
MAX_ARRAY_DEPTH = 2  # GGUF writers nest arrays one level at most
# Bytes a file may hold after its last tensor: writers pad it to the alignment at most, and a
# little more costs nothing, but llama.cpp maps the whole file and, prefetching, faults every
# page of it in, tail included (8 GiB of zeros after a 17 MB model: 8.2 GB resident at once).
MAX_TRAILING_BYTES = 1 << 20

# value types of the GGUF key-value section
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
            11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9

#: llama.cpp's split file names (llama_split_prefix): PREFIX-00001-of-00004.gguf
SPLIT_NAME = re.compile(r"^(.*)-(\d{5})-of-(\d{5})\.gguf$")

MOE_ARCHES_TESTED = ("qwen2moe", "qwen3moe", "llama (Mixtral)", "olmoe", "granitemoe",
                     "deepseek2", "gpt-oss", "lfm2moe")


@dataclass
class TensorInfo:
    """One tensor's entry in the GGUF header."""

    name: str
    shape: tuple[int, ...]  # ggml order: ne[0] is the row length
    type: GGMLQuantizationType
    offset: int  # relative to the data section of its file
    nbytes: int
    shard: int = 0  # which file of a split model holds it (ModelFile.shards)


@dataclass(frozen=True)
class Shard:
    """One file of a model: where it is, where its tensor data starts, its size."""

    path: Path
    data_offset: int
    file_size: int


@dataclass
class ModelFile:
    """What forecache needs to know about a GGUF model before loading it (one file, or a split
    model's files together; ``path`` is the file llama.cpp is given: the first)."""

    path: Path
    version: int
    kv: dict[str, Any]
    array_lengths: dict[str, int]
    tensors: list[TensorInfo]
    data_offset: int  # of the first file
    file_size: int  # every file's bytes
    kv_types: dict[str, int] = field(default_factory=dict)  # GGUF value type of each key
    duplicate_token: str | None = None  # a token that tokenizer.ggml.tokens lists twice
    kv_spans: dict[str, tuple[int, int]] = field(default_factory=dict)  # each key's bytes
    shards: tuple[Shard, ...] = ()  # every file, in order (one for a model in one file)

    @property
    def files(self) -> list[Path]:
        """The model's files in order: ``[path]``, or a split model's shards."""
        return [s.path for s in self.shards] or [self.path]

    @property
    def is_split(self) -> bool:
        return len(self.shards) > 1

    @property
    def name(self) -> str:
        """The model's file name, without a split model's ``-00001-of-0000N`` part."""
        m = SPLIT_NAME.match(self.path.name)
        return f"{m.group(1)}.gguf" if m and self.is_split else self.path.name

    def locate(self, t: TensorInfo) -> tuple[Path, int]:
        """The file holding ``t`` and the offset of its data there."""
        if not self.shards:
            return self.path, self.data_offset + t.offset
        s = self.shards[t.shard]
        return s.path, s.data_offset + t.offset

    @property
    def arch(self) -> str:
        return str(self.kv.get("general.architecture", ""))

    def arch_kv(self, key: str, default: Any = None) -> Any:
        """An architecture-scoped key, e.g. ``arch_kv("expert_count")``."""
        return self.kv.get(f"{self.arch}.{key}", default)

    def fit_context(self, n_ctx: int) -> int:
        """``n_ctx`` capped by the context the model was trained for."""
        return min(n_ctx, int(self.arch_kv("context_length", n_ctx) or n_ctx))

    @property
    def n_layer(self) -> int:
        return int(self.arch_kv("block_count", 0))

    @property
    def n_expert(self) -> int:
        return int(self.arch_kv("expert_count", 0) or 0)

    @property
    def n_expert_used(self) -> int:
        return int(self.arch_kv("expert_used_count", 0) or 0)

    @property
    def is_moe(self) -> bool:
        return self.n_expert > 1 and any(is_expert_tensor(t.name) for t in self.tensors)

    @property
    def n_vocab(self) -> int:
        return self.array_lengths.get("tokenizer.ggml.tokens", 0)

    def total_expert_bytes(self) -> int:
        """Bytes of all routed-expert tensors, every layer (those the expert cache manages)."""
        return sum(t.nbytes for t in self.tensors if is_expert_tensor(t.name))

    def moe_layers(self) -> list[int]:
        """Indices of the layers that have routed-expert tensors."""
        return sorted({int(t.name.split(".")[1]) for t in self.tensors
                       if is_expert_tensor(t.name)})

    def expert_tensors(self, layer: int) -> list[TensorInfo]:
        """The routed-expert tensors of ``layer`` (gate, up, down; experts stacked last)."""
        return [t for t in self.tensors
                if t.name.startswith(f"blk.{layer}.") and is_expert_tensor(t.name)]

    def expert_ff(self) -> int:
        """One routed expert's width: its down projection's rows (``ne`` [ff, d_model, n_expert];
        Mixtral-style headers have no expert_feed_forward_length, some give one per layer)."""
        return int(next(t for t in self.expert_tensors(self.moe_layers()[0])
                        if "_down_" in t.name).shape[0])

    def layer_expert_bytes(self) -> list[int]:
        """Bytes of one routed expert of each MoE layer, in ``moe_layers`` order: quantizers
        give some layers more bits (llama.cpp's Q4_K_M: Q6_K ffn_down in a third of them)."""
        return layer_expert_bytes(self.tensors, self.n_expert)

    def expert_proj_bytes(self) -> tuple[int, ...]:
        """Bytes of one routed expert's projections averaged over the MoE layers
        (:func:`expert_proj_bytes`); their sum is one expert's bytes."""
        return expert_proj_bytes(self.tensors, self.n_expert)

    def total_bytes(self) -> int:
        """Bytes of all tensors (the file is this plus header and padding)."""
        return sum(t.nbytes for t in self.tensors)

    def non_expert_bytes(self) -> int:
        """Bytes of every tensor but the routed experts: what every token needs resident."""
        return self.total_bytes() - self.total_expert_bytes()


def tensor_nbytes(shape: tuple[int, ...], qtype: GGMLQuantizationType) -> int:
    """Bytes of a tensor of that shape and type."""
    block, size = GGML_QUANT_SIZES[qtype]
    n = 1
    for d in shape:
        n *= d
    if shape and shape[0] % block:
        raise GGUFError(f"tensor row of {shape[0]} is not a multiple of the {qtype.name} block")
    return n // block * size


class SizedTensor(Protocol):
    """A tensor's name and bytes: a file's :class:`TensorInfo` or a spec's ``TensorPlan``."""

    @property
    def name(self) -> str: ...

    @property
    def nbytes(self) -> int: ...


def _expert_tensor_bytes(tensors: Iterable[SizedTensor]) -> dict[int, list[int]]:
    """Bytes of each routed-expert tensor (all experts of a layer stacked), by MoE layer, each
    layer's in file order (gate, up, down; gate_up, down where fused)."""
    per: dict[int, list[int]] = {}
    for t in tensors:
        if is_expert_tensor(t.name):
            per.setdefault(int(t.name.split(".")[1]), []).append(t.nbytes)
    return per


def layer_expert_bytes(tensors: Iterable[SizedTensor], n_expert: int) -> list[int]:
    """Bytes of one routed expert (all its projections) of each MoE layer, in layer order."""
    per = _expert_tensor_bytes(tensors)
    return [sum(per[il]) // n_expert for il in sorted(per)]


def expert_proj_bytes(tensors: Iterable[SizedTensor], n_expert: int) -> tuple[int, ...]:
    """Bytes of one routed expert's projections, each averaged over the MoE layers (rounded
    down): the one rule for "one expert's bytes", of a file (``ModelFile``) or of a spec's tensor
    plan (``specs.size_report``, the timing models' shapes). The sum is ``expert_bytes``: one
    expert of one layer, the same in every layer unless a quantizer mix gives some layers more
    bits (then ``layer_expert_bytes`` has each layer's)."""
    per = _expert_tensor_bytes(tensors)
    layers = sorted(per)
    n_proj = len(per[layers[0]])
    return tuple(sum(per[il][j] for il in layers) // (len(layers) * n_expert)
                 for j in range(n_proj))


class _Reader:
    def __init__(self, buf: mmap.mmap | bytes, path: Path) -> None:
        self.buf, self.pos, self.path = buf, 0, path
        self.duplicate_token: str | None = None

    def take(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise GGUFError(f"{self.path}: GGUF header is truncated (the file is cut short); "
                            "re-copy or re-create it")
        (val,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return val

    def string(self) -> str:
        n = self.take("<Q")
        if self.pos + n > len(self.buf):
            raise GGUFError(f"{self.path}: GGUF header is truncated (the file is cut short); "
                            "re-copy or re-create it")
        s = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return s.decode("utf-8", errors="replace")

    def skip_string(self) -> None:
        n = self.take("<Q")
        self.pos += n

    def _tokens(self, count: int) -> None:
        """Read the vocabulary, keeping only the first token listed twice (llama.cpp asserts
        that tokens are unique)."""
        seen: set[bytes] = set()
        for _ in range(count):
            n = self.take("<Q")
            tok = bytes(self.buf[self.pos:self.pos + n])
            self.pos += n
            if tok in seen and self.duplicate_token is None:
                self.duplicate_token = tok.decode("utf-8", errors="replace")
            seen.add(tok)

    def value(self, vtype: int, key: str, lengths: dict[str, int], depth: int = 0) -> Any:
        if vtype in _SCALARS:
            return self.take(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            if depth >= MAX_ARRAY_DEPTH:
                raise GGUFError(f"{self.path}: key {key!r} nests arrays {depth + 1} deep "
                                "(corrupt file?)")
            etype = self.take("<I")
            count = self.take("<Q")
            if count > len(self.buf):
                raise GGUFError(f"{self.path}: key {key!r} claims {count} entries, more than "
                                "the file has bytes (corrupt file?)")
            lengths[key] = count
            if key == "tokenizer.ggml.tokens" and etype == _STRING:
                self._tokens(count)
                return None
            if count <= MAX_ARRAY_KEEP:
                return [self.value(etype, key, {}, depth + 1) for _ in range(count)]
            if etype == _STRING:
                for _ in range(count):
                    self.skip_string()
            elif etype in _SCALARS:
                self.pos += struct.calcsize(_SCALARS[etype]) * count
            else:
                for _ in range(count):
                    self.value(etype, key, {}, depth + 1)
            return None
        raise GGUFError(f"{self.path}: unknown GGUF value type {vtype} for key {key!r} "
                        "(corrupt file?)")


def read_model_file(path: str | os.PathLike[str]) -> ModelFile:
    """Parse a GGUF header and check the file is complete; raises GGUFError with a one-line fix."""
    p = Path(path)
    if not p.exists():  # a typo, most likely: point at what exists, never make-model's output
        raise GGUFError(f"model file not found: {p}; give the path of a GGUF file, or a model "
                        f"name such as {setting('model_path', 'default')} (the built-in default "
                        "model; `forecache models` lists the names)")
    if p.is_dir():
        raise GGUFError(f"{p} is a directory, not a GGUF model file")
    first = _read_file(p)
    if "split.count" not in first.kv and "split.no" not in first.kv:
        return first
    return _join_shards(first)


def _read_file(p: Path) -> ModelFile:
    st = p.stat()
    return _read(str(p), st.st_size, st.st_mtime_ns, st.st_ino)


def _split_key(mf: ModelFile, key: str, lo: int, hi: int) -> int:
    value = mf.kv.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise GGUFError(f"{mf.path}: {key} is {value!r}; the split header is damaged: "
                        "re-download or re-split the model")
    return value


def split_name(prefix: str, index: int, count: int) -> str:
    """llama.cpp's name of shard ``index`` (from 0) of ``count``: PREFIX-0000i-of-0000N.gguf."""
    return f"{prefix}-{index + 1:05d}-of-{count:05d}.gguf"


def _join_shards(first: ModelFile) -> ModelFile:
    """The split model whose first file is ``first``: every shard found by llama.cpp's naming
    rule, read, checked against the first, and their tensors joined."""
    p = first.path
    count = _split_key(first, "split.count", 1, 65535)
    index = _split_key(first, "split.no", 0, count - 1) if "split.no" in first.kv else 0
    n_tensors = _split_key(first, "split.tensors.count", 1, 1 << 24) \
        if "split.tensors.count" in first.kv else len(first.tensors)
    m = SPLIT_NAME.match(p.name)
    if index != 0:
        hint = f": {p.with_name(split_name(m.group(1), 0, count)).name}" if m else ""
        raise GGUFError(f"{p} is shard {index + 1} of {count} of a split model; pass its first "
                        f"shard{hint}")
    if count == 1:
        return first
    if m is None or int(m.group(2)) != 1 or int(m.group(3)) != count:
        raise GGUFError(f"{p} is the first of {count} split files, but its name does not end "
                        f"in -00001-of-{count:05d}.gguf, so its other shards cannot be found "
                        "(llama.cpp finds them by name): give the files their split names again")
    shards = [first]
    for i in range(1, count):
        q = p.with_name(split_name(m.group(1), i, count))
        if not q.is_file():
            raise GGUFError(f"shard {i + 1} of {count} of {p.name} is missing: {q} not found; "
                            "put every shard of the model in the same directory (re-download it)")
        mf = _read_file(q)
        got = tuple(mf.kv.get(k) for k in ("split.no", "split.count", "split.tensors.count"))
        if got != (i, count, n_tensors):
            said = (f"shard {got[0] + 1} of {got[1]} of a model of {got[2]} tensors"
                    if None not in got and isinstance(got[0], int) else
                    "not a shard of a split model")
            raise GGUFError(f"{q} does not belong with {p.name}: it says it is {said}, where shard "
                            f"{i + 1} of {count} of {n_tensors} tensors belongs; the shards come "
                            "from different models or downloads: re-download the model")
        shards.append(mf)
    tensors, seen = [], {}
    for i, mf in enumerate(shards):
        for t in mf.tensors:
            if t.name in seen:
                raise GGUFError(f"{mf.path} and {shards[seen[t.name]].path.name} both hold tensor "
                                f"{t.name}; the shards come from different models or downloads: "
                                "re-download the model")
            seen[t.name] = i
            tensors.append(dataclasses.replace(t, shard=i))
    if len(tensors) != n_tensors:
        raise GGUFError(f"{p.name} and its shards hold {len(tensors)} tensors where its header "
                        f"says {n_tensors}; the shards come from different models or downloads: "
                        "re-download the model")
    return dataclasses.replace(
        first, tensors=tensors, file_size=sum(mf.file_size for mf in shards),
        shards=tuple(Shard(mf.path, mf.data_offset, mf.file_size) for mf in shards))


@functools.lru_cache(maxsize=16)
def _read(path: str, size: int, mtime_ns: int, inode: int) -> ModelFile:
    """The parsed header of ``path`` as it is on disk (a load checks its model in several places;
    a changed or replaced file has another size, time or inode and is parsed again)."""
    p = Path(path)
    with open(p, "rb") as f:
        head = f.read(4)
        if head != GGUF_MAGIC:
            raise GGUFError(f"{p} is not a GGUF file (starts with {head!r}, expected b'GGUF'); "
                            "convert the model to GGUF first")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            return _parse(mm, p, size)


def _parse(mm: mmap.mmap, p: Path, size: int) -> ModelFile:
    r = _Reader(mm, p)
    r.pos = 4
    version = r.take("<I")
    if version not in (2, 3):
        raise GGUFError(f"{p}: unsupported GGUF version {version} (llama.cpp reads 2 and 3)")
    n_tensors, n_kv = r.take("<Q"), r.take("<Q")
    if n_tensors > 1 << 24 or n_kv > 1 << 24:
        raise GGUFError(f"{p}: GGUF header is corrupt ({n_tensors} tensors, {n_kv} keys)")
    kv: dict[str, Any] = {}
    kv_types: dict[str, int] = {}
    lengths: dict[str, int] = {}
    spans: dict[str, tuple[int, int]] = {}
    for _ in range(n_kv):
        start = r.pos
        key = r.string()
        vtype = r.take("<I")
        kv_types[key] = vtype
        kv[key] = r.value(vtype, key, lengths)
        spans[key] = (start, r.pos)
    tensors = []
    for _ in range(n_tensors):
        name = r.string()
        n_dims = r.take("<I")
        if n_dims > 8:
            raise GGUFError(f"{p}: tensor {name!r} has {n_dims} dimensions (corrupt file?)")
        shape = tuple(r.take("<Q") for _ in range(n_dims))
        raw_type = r.take("<I")
        offset = r.take("<Q")
        try:
            qtype = GGMLQuantizationType(raw_type)
        except ValueError:
            raise GGUFError(f"{p}: tensor {name!r} has unknown type {raw_type}") from None
        tensors.append(TensorInfo(name, shape, qtype, offset, tensor_nbytes(shape, qtype)))
    align = kv.get("general.alignment", DEFAULT_ALIGNMENT)
    if isinstance(align, bool) or not isinstance(align, int) or align <= 0:
        raise GGUFError(f"{p}: general.alignment is {align!r}, not a positive integer; the "
                        "header is damaged: re-create or re-convert the model")
    data_offset = (r.pos + align - 1) // align * align
    end = max((data_offset + t.offset + t.nbytes for t in tensors), default=data_offset)
    if end > size:
        raise GGUFError(f"{p} is truncated: {size} bytes on disk, its tensors need {end}; "
                        "the download or copy did not finish, re-copy or re-create it")
    if size - end > MAX_TRAILING_BYTES:
        raise GGUFError(f"{p} has {size - end} bytes after its last tensor, which ends at "
                        f"byte {end}; llama.cpp would read them all: re-copy the model, or cut "
                        f"them off with `truncate -s {end} {p}`")
    return ModelFile(p, version, kv, lengths, tensors, data_offset, size, kv_types,
                     r.duplicate_token, spans, (Shard(p, data_offset, size),))


def require_moe(path: str | os.PathLike[str]) -> ModelFile:
    """read_model_file, and refuse models that have no routed experts."""
    mf = read_model_file(path)
    if not mf.arch or not isinstance(mf.arch, str):
        raise GGUFError(f"{mf.path}: GGUF has no general.architecture; it is not a model file")
    if any(is_expert_tensor(t.name) for t in mf.tensors):
        check_header(mf)  # before anything reads a hyperparameter
    if not mf.is_moe:
        raise GGUFError(f"{mf.path} is not a Mixture-of-Experts model (architecture {mf.arch!r} "
                        f"has no routed experts); forecache runs MoE GGUFs such as "
                        f"{', '.join(MOE_ARCHES_TESTED)}")
    return mf

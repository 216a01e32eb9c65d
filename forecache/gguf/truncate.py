"""A draft made from a MoE model itself: its token embedding, its first N blocks, its output norm
and head, written as a GGUF of the same architecture and vocabulary (``forecache make-draft``).

Such a draft computes, for its first N layers, exactly what the model computes: its FFN input at
layer ``il < N`` is the model's own, so SP-MoE's cross-model predictor (the model's routers over
the draft's states, ``speculative.draft``) names the experts the model will route there. The file
says so in ``forecache.draft.*`` keys, which the predictor reads to map layers one to one.

Everything is copied byte for byte: the metadata entries from the source's header (a split
model's first file holds them all; its ``split.*`` keys are dropped), the tensor data from
whichever file holds each tensor. Only ``block_count``, per-layer arrays (cut to N entries), the
``forecache.draft`` keys and, when experts are dropped, ``expert_count`` and the sliced expert
tensors differ.
"""

from __future__ import annotations

import os
import re
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from forecache.errors import setting
from forecache.gguf.header import (
    DEFAULT_ALIGNMENT,
    GGUF_MAGIC,
    ModelFile,
    require_moe,
)
from forecache.gguf.identity import fingerprint

#: How many of the source's layers the draft is: its first ``N`` (the draft's block_count).
FIRST_LAYERS_KEY = "forecache.draft.first_layers"
#: The block count of the model the draft was cut from (the layers it maps onto).
SOURCE_LAYERS_KEY = "forecache.draft.source_block_count"
#: The source model's file name (for whoever reads the draft's header).
SOURCE_NAME_KEY = "forecache.draft.source"
#: The source model's content fingerprint (``identity.fingerprint``): a draft is read layer for
#: layer only beside the model it was cut from.
SOURCE_FINGERPRINT_KEY = "forecache.draft.source_fingerprint"
#: With ``experts``: how many experts each layer kept, and which (N rows of that many ids).
EXPERTS_KEY = "forecache.draft.experts"
KEPT_EXPERTS_KEY = "forecache.draft.kept_experts"
#: Keys of the source that describe it as a whole and would be false of a part of it.
DROPPED_KEYS = ("forecache.valid_loss",)
#: Arch-scoped arrays of fixed length, even when that length happens to equal the layer count.
NOT_PER_LAYER = ("rope.dimension_sections",)

_U32, _STRING, _ARRAY, _U64 = 4, 8, 9, 10
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
            11: "<q", 12: "<d"}
# Tensors of a block whose last dimension runs over the routed experts (router, its bias, the
# expert weights and biases, deepseek's selection bias): sliced when experts are dropped.
_PER_EXPERT = re.compile(r"^blk\.\d+\.(ffn_gate_inp|ffn_exp_probs_b|ffn_\w+_exps)\.\w+$")
_CHUNK = 64 << 20  # bytes copied at a time

Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class DraftInfo:
    """What :func:`make_draft` wrote."""

    path: Path
    n_layer: int  # the draft's layers: the source's first ones
    source_n_layer: int
    n_tensors: int
    file_bytes: int
    n_expert: int  # routed experts a layer (the source's unless ``experts`` dropped some)


@dataclass(frozen=True)
class _Copy:
    """One tensor of the draft: its header entry and the source byte ranges it is made of."""

    name: str
    shape: tuple[int, ...]  # ggml order
    type: int
    nbytes: int
    parts: tuple[tuple[Path, int, int], ...]  # (file, offset, bytes), concatenated


def layer_of(name: str) -> int | None:
    """The block a tensor belongs to (``blk.3.ffn_norm.weight`` -> 3), None for the others."""
    m = re.match(r"^blk\.(\d+)\.", name)
    return int(m.group(1)) if m else None


def declared_first_layers(kv: dict[str, object]) -> tuple[int, int] | None:
    """(N, the source's block count) for a draft that says it is a model's first N layers
    (``make_draft``'s keys), else None."""
    n, of = kv.get(FIRST_LAYERS_KEY), kv.get(SOURCE_LAYERS_KEY)
    if isinstance(n, int) and isinstance(of, int) and 0 < n <= of:
        return n, of
    return None


def top_experts(counts: Sequence[Sequence[int]], n_layers: int, m: int) -> list[list[int]]:
    """Each of the first ``n_layers`` layers' ``m`` most-routed experts of a routing profile
    (routed counts [layer][expert], as the static policy's), in ascending id order; ties go to
    the lower id, as the static policy pins them."""
    out = []
    for il in range(n_layers):
        row = list(counts[il]) if il < len(counts) else []
        order = sorted(range(len(row)), key=lambda e: (-row[e], e))
        out.append(sorted(order[:m]))
    return out


def check_draft(source: str | os.PathLike[str], out: str | os.PathLike[str], layers: int, *,
                n_keep: int | None = None, force: bool = False) -> ModelFile:
    """The source model, once everything :func:`make_draft` would refuse is ruled out (each
    refusal one line): not a MoE model, ``out`` the model itself or existing without ``force``,
    ``layers`` out of range, ``n_keep`` experts not possible."""
    mf = require_moe(source)
    dst = Path(out)
    if dst.exists() and dst.resolve() in {p.resolve() for p in mf.files}:
        raise ValueError(f"{dst} is the model itself; write the draft to another file")
    if dst.is_dir():
        raise IsADirectoryError(f"{dst} is a directory; give a file name for the draft")
    if dst.exists() and not force:
        raise FileExistsError(f"{dst} exists; pass {setting('force')} to overwrite it")
    n = mf.n_layer
    if not 1 <= layers <= n:
        raise ValueError(f"{setting('layers', layers)}: {mf.name} has {n} layers; give 1 to {n}")
    nextn = int(mf.arch_kv("nextn_predict_layers", 0) or 0)
    if nextn and n - nextn < layers < n:
        raise ValueError(f"{setting('layers', layers)}: {mf.name}'s last {nextn} layers are "
                         f"its next-token predictors; give 1 to {n - nextn}, or {n}")
    if n_keep is None:
        return mf
    if int(mf.arch_kv("expert_group_count", 0) or 0) > 1:
        raise ValueError(f"{mf.name} routes experts in groups "
                         f"({mf.arch}.expert_group_count); its experts cannot be dropped: "
                         f"leave out {setting('experts')}")
    k, e = mf.n_expert_used, mf.n_expert
    if not k <= n_keep <= e:
        raise ValueError(f"{setting('experts', n_keep)}: {mf.name} routes {k} of {e} experts "
                         f"a token; keep {k} to {e}")
    return mf


def _check_experts(mf: ModelFile, layers: int, experts: Sequence[Sequence[int]]) -> None:
    widths = {len(row) for row in experts}
    if len(experts) != layers or len(widths) != 1:
        raise ValueError(f"the experts to keep need one list of the same length for each of the "
                         f"{layers} layers")
    m, e = widths.pop(), mf.n_expert
    for row in experts:
        if len(set(row)) != m or not all(0 <= x < e for x in row):
            raise ValueError(f"experts to keep {list(row)} are not {m} distinct ids below {e}")


def _plan(mf: ModelFile, layers: int, experts: Sequence[Sequence[int]] | None) -> list[_Copy]:
    """The draft's tensors in the source's order: everything outside the blocks, and the blocks
    below ``layers``; with ``experts``, each per-expert tensor cut to the kept experts' slices
    (the experts are its slowest dimension, so each is one contiguous run of bytes)."""
    out = []
    e = mf.n_expert
    for t in mf.tensors:
        il = layer_of(t.name)
        if il is not None and il >= layers:
            continue
        path, off = mf.locate(t)
        if experts is None or il is None or not _PER_EXPERT.match(t.name):
            out.append(_Copy(t.name, t.shape, int(t.type), t.nbytes, ((path, off, t.nbytes),)))
            continue
        if t.shape[-1] != e or t.nbytes % e:
            raise ValueError(f"{mf.name}: tensor {t.name} of shape {list(t.shape)} does not "
                             f"run over its {e} experts last; its experts cannot be dropped")
        per = t.nbytes // e
        keep = experts[il]
        out.append(_Copy(t.name, (*t.shape[:-1], len(keep)), int(t.type), per * len(keep),
                         tuple((path, off + x * per, per) for x in keep)))
    return out


def _string(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def _entry(key: str, vtype: int, value: int | str) -> bytes:
    """One metadata entry: a scalar of GGUF type ``vtype`` or a string."""
    body = _string(str(value)) if vtype == _STRING else struct.pack(_SCALARS[vtype], value)
    return _string(key) + struct.pack("<I", vtype) + body


def _u32_array(key: str, values: Sequence[int]) -> bytes:
    return (_string(key) + struct.pack("<IIQ", _ARRAY, _U32, len(values)) +
            struct.pack(f"<{len(values)}I", *values))


def _cut_array(raw: bytes, key: str, n: int) -> bytes | None:
    """A metadata entry holding an array of scalars cut to its first ``n`` elements (None when
    it holds something else)."""
    pos = 8 + len(key.encode())
    vtype, etype, count = struct.unpack_from("<IIQ", raw, pos)
    if vtype != _ARRAY or etype not in _SCALARS:
        return None
    size = struct.calcsize(_SCALARS[etype])
    head = raw[:pos] + struct.pack("<IIQ", vtype, etype, min(n, count))
    return head + raw[pos + 16:pos + 16 + size * min(n, count)]


def _metadata(mf: ModelFile, layers: int, experts: Sequence[Sequence[int]] | None
              ) -> list[bytes]:
    """The draft's metadata entries: the source's, byte for byte, with its layer count (and
    expert count) changed, per-layer arrays cut and the ``forecache.draft`` keys added."""
    with open(mf.path, "rb") as f:
        header = f.read(mf.data_offset)
    arch, n = mf.arch, mf.n_layer
    changed = {f"{arch}.block_count": layers}
    if layers < n and f"{arch}.nextn_predict_layers" in mf.kv:
        changed[f"{arch}.nextn_predict_layers"] = 0  # the predictor layers are the last
    if experts is not None:
        changed[f"{arch}.expert_count"] = len(experts[0])
    out = []
    for key, (a, b) in mf.kv_spans.items():
        if key.startswith("split.") or key in DROPPED_KEYS or key.startswith("forecache.draft."):
            continue
        if key in changed:
            out.append(_entry(key, mf.kv_types[key], changed[key]))
            continue
        raw = header[a:b]
        # llama.cpp reads these as one value a layer and wants exactly block_count of them
        per_layer = (key.startswith(arch + ".") and mf.array_lengths.get(key) == n and
                     not key.endswith(NOT_PER_LAYER) and layers < n)
        cut = _cut_array(raw, key, layers) if per_layer else None
        out.append(cut if cut is not None else raw)
    out.append(_entry(FIRST_LAYERS_KEY, _U32, layers))
    out.append(_entry(SOURCE_LAYERS_KEY, _U32, n))
    out.append(_entry(SOURCE_NAME_KEY, _STRING, mf.name))
    out.append(_entry(SOURCE_FINGERPRINT_KEY, _STRING, fingerprint(mf)))
    if experts is not None:
        out.append(_entry(EXPERTS_KEY, _U32, len(experts[0])))
        out.append(_u32_array(KEPT_EXPERTS_KEY, [x for row in experts for x in row]))
    return out


def _pad(n: int, align: int) -> int:
    return (n + align - 1) // align * align


def _header(mf: ModelFile, entries: list[bytes], copies: list[_Copy], align: int) -> bytes:
    """The draft's header, padded to where its data starts: each tensor at the next multiple of
    the alignment after the one before, as GGUFWriter places them."""
    out = [GGUF_MAGIC, struct.pack("<IQQ", 3, len(copies), len(entries)), *entries]
    offset = 0
    for c in copies:
        out.append(_string(c.name) + struct.pack("<I", len(c.shape)) +
                   struct.pack(f"<{len(c.shape)}Q", *c.shape) + struct.pack("<IQ", c.type, offset))
        offset = _pad(offset + c.nbytes, align)
    head = b"".join(out)
    return head + bytes(_pad(len(head), align) - len(head))


def make_draft(source: str | os.PathLike[str], out: str | os.PathLike[str], layers: int, *,
               experts: Sequence[Sequence[int]] | None = None, force: bool = False,
               progress: Progress | None = None) -> DraftInfo:
    """Write ``out``: the MoE model ``source`` (one file or a split model's first) cut to its
    first ``layers`` blocks, every kept tensor's bytes as they are in the source; ``experts``:
    the experts each of those layers keeps (ids, ascending order kept as given), all when None.
    ``progress(bytes_done, bytes_total)`` follows the tensor data. Written beside ``out`` and
    renamed into place when complete, so an interrupted run leaves nothing behind."""
    mf = check_draft(source, out, layers, force=force,
                     n_keep=len(experts[0]) if experts else None)
    if experts is not None:
        _check_experts(mf, layers, experts)
    dst = Path(out)
    copies = _plan(mf, layers, experts)
    align = mf.kv.get("general.alignment", DEFAULT_ALIGNMENT)
    head = _header(mf, _metadata(mf, layers, experts), copies, align)
    total = sum(c.nbytes for c in copies)
    tmp = dst.with_name(f".{dst.name}.partial")
    done = 0
    if progress:
        progress(0, total)
    files: dict[Path, int] = {}
    try:
        with open(tmp, "wb") as f:
            f.write(head)
            for c in copies:
                for path, off, n in c.parts:
                    fd = files.get(path)
                    if fd is None:
                        fd = files[path] = os.open(path, os.O_RDONLY)
                    while n > 0:
                        chunk = os.pread(fd, min(n, _CHUNK), off)
                        if not chunk:
                            raise OSError(f"{path} ended early while copying {c.name}")
                        f.write(chunk)
                        off, n, done = off + len(chunk), n - len(chunk), done + len(chunk)
                        if progress:
                            progress(done, total)
                f.write(bytes(_pad(c.nbytes, align) - c.nbytes))
        os.replace(tmp, dst)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        for fd in files.values():
            os.close(fd)
    return DraftInfo(dst, layers, mf.n_layer, len(copies), dst.stat().st_size,
                     len(experts[0]) if experts is not None else mf.n_expert)


"""Write a random-weight GGUF of a real MoE shape (or of a dense draft for one) that llama.cpp
loads and runs.

gguf.GGUFWriter writes the header, metadata and tensor infos; the tensor data is then
generated in fixed chunks (one expert slab, or a band of rows) by worker processes that
`os.pwrite` them at precomputed offsets. Each chunk's random stream is seeded from
(seed, tensor name, chunk index), so the file's bytes do not depend on the worker count, and a
model written as split files (llama.cpp's ``NAME-0000i-of-0000N.gguf``, cut as gguf-split and
GGUFWriter cut them) holds the same tensors as the same model in one file.
Quantized tensors are produced as random valid blocks directly, without quantizing floats.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import shutil
import signal
import sys
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import (
    GGML_QUANT_SIZES,
    GGML_QUANT_VERSION,
    ExpertGatingFuncType,
    GGMLQuantizationType,
    GGUFWriter,
)

from forecache.gguf.qtypes import QTYPES, parse_qtype
from forecache.gguf.specs import (
    ARCHES,
    FF_IS_EXPERT_FF,
    GATING,
    ModelSpec,
    SizeReport,
    TensorPlan,
    get_spec,
    size_report,
    tensor_plan,
)
from forecache.gguf.vocab import Vocab, make_vocab

Q = GGMLQuantizationType

#: Largest chunk one job generates, in weights (bounds each worker's memory to ~100 MB).
CHUNK_ELEMENTS = 1 << 24
#: Below this much tensor data the default (workers=None) writes in-process: a process pool
#: costs more to start than the tiny preset takes to generate.
POOL_MIN_BYTES = 64 << 20
EMBEDDING_STD = 0.02
BIAS_STD = 0.02


@dataclass(frozen=True)
class ModelInfo:
    """What `make_model` wrote."""

    path: Path  # the file llama.cpp is given: the model, or its first shard
    preset: str
    qtype: str
    seed: int
    layers: int
    n_tensors: int
    file_bytes: int
    seconds: float
    sizes: SizeReport
    shards: tuple[Path, ...] = ()  # every file, in order (the one file when not split)
    dense: bool = False  # a dense draft (no experts), not a MoE model


@dataclass(frozen=True)
class _Job:
    """One chunk of one tensor: `rows` rows of `row_len` weights, written at `offset` of file
    number `file`."""

    file: int
    offset: int
    ggml_type: int
    rows: int
    row_len: int
    std: float  # 0 means "all ones" (norm weights)
    seed: tuple[int, ...]


# --- random tensor data ----------------------------------------------------------------

def _rms(values: np.ndarray) -> float:
    return float(np.sqrt(np.mean(values.astype(np.float64) ** 2)))


# Root mean square of one block's integer quants when its bytes are uniformly random.
_Q8_0_RMS = _rms(np.arange(-128, 128))
_Q4_0_RMS = _rms(np.arange(16) - 8)
_Q5_0_RMS = _rms(np.arange(32) - 16)
_Q4_K_Q_STD = _rms(np.arange(16) - 7.5)
# Q4_K sub-block scales are 4 + byte % 16 (4..19) and mins 2 * scale (fit 6 bits); small
# scales keep the f16 super-block scale d well above the f16 subnormal range.
_Q4_K_SC_RMS = _rms(4 + np.arange(16))
_Q6_K_Q_RMS = _rms(np.arange(64) - 32)
_MXFP4_RMS = _rms(np.array([0, 1, 2, 3, 4, 6, 8, 12] * 2))


def _random_bytes(rng: np.random.Generator, n: int) -> np.ndarray:
    """n uniformly random bytes, writable (raw generator output is the fastest source)."""
    return rng.bit_generator.random_raw((n + 7) // 8).view(np.uint8)[:n]


def _set_f16(blocks: np.ndarray, col: int, value: float, random_sign: bool = False) -> None:
    """Store f16 `value` in bytes col..col+1 of every block, keeping a random sign if asked.

    A random sign per block makes the mean of block types with an offset zero point
    (Q4_0, Q5_0, Q8_0 quants have mean -0.5) zero over the tensor.
    """
    bits = np.uint16(np.float16(value).view(np.uint16))
    word = np.full(len(blocks), bits, dtype=np.uint16)
    if random_sign:
        word |= (blocks[:, col + 1].astype(np.uint16) & 0x80) << 8
    blocks[:, col] = word & 0xFF
    blocks[:, col + 1] = word >> 8


def _q4_k_scales(raw: np.ndarray) -> np.ndarray:
    """Pack 8 scales (4..19) and mins (2 * scale) per block into ggml's 12-byte layout."""
    sc = 4 + (raw[:, :8] & 15)
    m = sc * 2
    out = np.empty((len(raw), 12), dtype=np.uint8)
    out[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = m[:, 0:4] | ((m[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 0xF) | ((m[:, 4:8] & 0xF) << 4)
    return out


def random_blocks(
    ggml_type: GGMLQuantizationType, n_elements: int, std: float, rng: np.random.Generator
) -> np.ndarray:
    """Random valid quantized blocks whose dequantized values have mean ~0 and `std`.

    The quants are random bytes; only the f16 block scales (and Q4_K's packed sub-block
    scales and mins) are set, to the values that give the wanted spread.
    """
    block, block_bytes = GGML_QUANT_SIZES[ggml_type]
    if n_elements % block:
        raise ValueError(f"{n_elements} weights is not a whole number of {ggml_type.name} blocks")
    nb = n_elements // block
    blocks = _random_bytes(rng, nb * block_bytes).reshape(nb, block_bytes)
    if ggml_type == Q.Q8_0:
        _set_f16(blocks, 0, std / _Q8_0_RMS, random_sign=True)
    elif ggml_type == Q.Q4_0:
        _set_f16(blocks, 0, std / _Q4_0_RMS, random_sign=True)
    elif ggml_type == Q.Q4_1:
        # value = d*q + m with q in 0..15: m = -7.5*d centres it
        d = float(np.float16(std / _Q4_K_Q_STD))
        _set_f16(blocks, 0, d)
        _set_f16(blocks, 2, -7.5 * d)
    elif ggml_type == Q.Q5_0:
        _set_f16(blocks, 0, std / _Q5_0_RMS, random_sign=True)
    elif ggml_type == Q.Q4_K:
        d = float(np.float16(std / (_Q4_K_SC_RMS * _Q4_K_Q_STD)))
        blocks[:, 4:16] = _q4_k_scales(blocks[:, 4:16])
        _set_f16(blocks, 0, d)
        # value = d*sc*q - dmin*m with m = 2*sc: dmin = 3.75*d centres q (0..15) on 7.5.
        _set_f16(blocks, 2, 3.75 * d)
    elif ggml_type == Q.Q6_K:
        # value = d * scale * (q - 32), q six bits; sub-block scales 4..19 with random signs
        raw = blocks[:, 192:208].copy()
        blocks[:, 192:208] = ((4 + (raw & 15)) * np.where(raw & 0x80, -1, 1)).astype(np.int8) \
            .view(np.uint8)
        _set_f16(blocks, 208, std / (_Q4_K_SC_RMS * _Q6_K_Q_RMS))
    elif ggml_type == Q.MXFP4:
        # value = kvalue[nibble] * 2^(e - 128), kvalues the doubled E2M1 grid; each block takes
        # one of the two exponents around the wanted spread, mixed to hit it on average
        t = std / _MXFP4_RMS
        lo = int(np.floor(np.log2(t)))
        p_hi = (t * t - 4.0 ** lo) / (4.0 ** (lo + 1) - 4.0 ** lo)
        hi = blocks[:, 0] < round(256 * p_hi)
        blocks[:, 0] = 128 + lo + hi
    else:
        raise ValueError(f"no random block generator for {ggml_type.name}")
    return blocks.reshape(-1)


def _generate(job: _Job) -> np.ndarray:
    """The bytes of one chunk."""
    n = job.rows * job.row_len
    ggml_type = Q(job.ggml_type)
    if job.std == 0:
        return np.ones(n, dtype=np.float32 if ggml_type == Q.F32 else np.float16)
    rng = np.random.default_rng(job.seed)
    if ggml_type in (Q.F32, Q.F16):
        values = rng.standard_normal(n, dtype=np.float32)
        values *= job.std
        return values if ggml_type == Q.F32 else values.astype(np.float16)
    return random_blocks(ggml_type, n, job.std, rng)


# --- chunking and seeding --------------------------------------------------------------

def _init_std(plan: TensorPlan) -> float:
    """Spread of a tensor's weights, chosen to keep activations O(1) through the layers."""
    if plan.kind == "norm":
        return 0.0
    if plan.name == "token_embd.weight":
        return EMBEDDING_STD
    if plan.name.endswith(".bias"):
        return BIAS_STD
    # y = W x with W of shape {fan_in, fan_out}: std 1/sqrt(fan_in) keeps |y| ~ |x|.
    return 1.0 / float(np.sqrt(plan.ne[0]))


def _name_key(name: str) -> int:
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")


def _jobs(plans: Iterable[TensorPlan], places: Iterable[tuple[int, int]],
          seed: int) -> list[_Job]:
    """Split every tensor into chunks; 3-D tensors never mix experts within a chunk.
    ``places``: each tensor's (file, offset)."""
    jobs = []
    for plan, (file, offset) in zip(plans, places, strict=True):
        row_len = plan.ne[0]
        n_rows = plan.n_elements // row_len
        slab_rows = plan.ne[1] if len(plan.ne) == 3 else n_rows
        step = max(1, min(slab_rows, CHUNK_ELEMENTS // row_len))
        row_bytes = plan.nbytes // n_rows
        std = _init_std(plan)
        key = _name_key(plan.name)
        index = 0
        for slab_start in range(0, n_rows, slab_rows):
            for start in range(slab_start, slab_start + slab_rows, step):
                rows = min(step, slab_start + slab_rows - start)
                jobs.append(_Job(file, offset + start * row_bytes, int(plan.ggml_type), rows,
                                 row_len, std, (seed, key, index)))
                index += 1
    return jobs


# --- writing -----------------------------------------------------------------------------

_worker_fds: list[int] = []


def _pwrite_all(fd: int, data: np.ndarray, offset: int) -> int:
    view = memoryview(data).cast("B")
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)
    return done


def _init_worker(paths: list[str]) -> None:
    # The parent handles Ctrl-C and SIGTERM (removing the partial files) and terminates the
    # pool; workers just stop, without tracebacks of their own.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _worker_fds[:] = [os.open(p, os.O_WRONLY) for p in paths]


def _run_job(job: _Job) -> int:
    return _pwrite_all(_worker_fds[job.file], _generate(job), job.offset)


def _add_metadata(writer: GGUFWriter, spec: ModelSpec, qtype: str, seed: int,
                  vocab: Vocab) -> None:
    """Hyperparameter and tokenizer keys, as convert_hf_to_gguf.py writes them."""
    writer.add_type("model")
    writer.add_name(f"forecache-{spec.name}-random")
    writer.add_description(
        f"Random weights with the shape of {spec.hf_repo or spec.name}, made by forecache"
    )
    writer.add_string("forecache.preset", spec.name)
    writer.add_uint64("forecache.seed", seed)
    add_hparams(writer, spec, qtype)
    vocab.write_to(writer)


def add_hparams(writer: GGUFWriter, spec: ModelSpec, qtype: str) -> None:
    """The architecture's hyperparameter keys and the file type, as the HF converter writes
    them for Qwen2-MoE, Qwen3-MoE, Mixtral, OLMoE, Granite-MoE, DeepSeek-V2/V3, gpt-oss,
    LFM2-MoE and (dense, without expert keys) Qwen2."""
    writer.add_block_count(spec.layers)
    writer.add_context_length(spec.context_length)
    writer.add_embedding_length(spec.d_model)
    writer.add_feed_forward_length(spec.ff)
    writer.add_head_count(spec.heads)
    if spec.attention_layers is not None:  # no KV in the convolution layers
        writer.add_head_count_kv([spec.kv_heads if il in spec.attention_layers else 0
                                  for il in range(spec.layers)])
    else:
        writer.add_head_count_kv(spec.kv_heads)
    writer.add_rope_freq_base(spec.rope_theta)
    writer.add_layer_norm_rms_eps(spec.rms_eps)
    if not spec.is_dense:
        writer.add_expert_count(spec.experts)
        writer.add_expert_used_count(spec.top_k)
    if not spec.is_dense and (spec.arch not in FF_IS_EXPERT_FF or spec.arch == "gpt-oss"):
        writer.add_expert_feed_forward_length(spec.expert_ff)
    for value, add in ((spec.embedding_scale, writer.add_embedding_scale),
                       (spec.residual_scale, writer.add_residual_scale),
                       (spec.attention_scale, writer.add_attention_scale),
                       (spec.logit_scale, writer.add_logit_scale)):
        if value is not None:
            add(value)
    if spec.sliding_window is not None:
        writer.add_sliding_window(spec.sliding_window)
    if spec.arch == "lfm2moe":
        writer.add_leading_dense_block_count(spec.dense_layers)
        writer.add_expert_gating_func(ExpertGatingFuncType(GATING[spec.gating]))
        writer.add_vocab_size(spec.vocab)
        assert spec.conv_cache is not None
        writer.add_shortconv_l_cache(spec.conv_cache)
    if spec.arch == "deepseek2":
        _add_deepseek2(writer, spec)
    else:
        if spec.shared_experts:
            writer.add_expert_shared_feed_forward_length(spec.shared_expert_ff)
        if spec.key_length is not None:
            writer.add_key_length(spec.key_length)
            writer.add_value_length(spec.key_length)
    writer.add_file_type(int(QTYPES[qtype][1]))
    writer.add_quantization_version(GGML_QUANT_VERSION)


def _add_deepseek2(writer: GGUFWriter, spec: ModelSpec) -> None:
    """deepseek2's keys: latent attention is written as one kv head of the compressed width,
    the per-head sizes it decompresses to as the _mla lengths; then its routing."""
    assert spec.kv_lora_rank is not None and spec.rope_dim is not None
    assert spec.key_length is not None and spec.value_length is not None
    writer.add_leading_dense_block_count(spec.dense_layers)
    writer.add_vocab_size(spec.vocab)
    if spec.q_lora_rank:
        writer.add_q_lora_rank(spec.q_lora_rank)
    writer.add_kv_lora_rank(spec.kv_lora_rank)
    writer.add_key_length(spec.kv_lora_rank + spec.rope_dim)
    writer.add_value_length(spec.kv_lora_rank)
    writer.add_key_length_mla(spec.key_length)
    writer.add_value_length_mla(spec.value_length)
    writer.add_expert_shared_count(spec.shared_experts)
    if spec.expert_weights_scale is not None:
        writer.add_expert_weights_scale(spec.expert_weights_scale)
    if spec.expert_weights_norm:
        writer.add_expert_weights_norm(True)
    writer.add_rope_dimension_count(spec.rope_dim)
    writer.add_expert_group_count(spec.expert_groups)
    writer.add_expert_group_used_count(spec.expert_groups_used)
    writer.add_expert_gating_func(ExpertGatingFuncType(GATING[spec.gating]))


def _write_header(path: Path, spec: ModelSpec, qtype: str, seed: int, plans: list[TensorPlan],
                  split_max_size: int = 0, split_max_tensors: int = 0,
                  ) -> tuple[list[Path], list[tuple[int, int]], list[int]]:
    """Write header, metadata and tensor infos of ``path``, or of its shards when a split limit
    is given and the model exceeds it; return the files written, each tensor's (file, absolute
    data offset) and each file's size.

    Offsets follow the GGUF rule GGUFWriter also uses: each file's data section starts at the
    next multiple of the alignment, and every tensor is padded to the alignment. Shards are cut
    by GGUFWriter (a new one before the tensor that would pass either limit); the metadata goes
    in the first, and every shard carries the ``split.*`` keys llama.cpp reads.
    """
    writer = GGUFWriter(path, spec.arch, split_max_tensors=split_max_tensors,
                        split_max_size=split_max_size)
    _add_metadata(writer, spec, qtype, seed, make_vocab(spec.vocab, spec.text_tokens))
    for plan in plans:
        # Shapes go in numpy order; with an explicit raw_dtype GGUFWriter keeps them as given.
        writer.add_tensor_info(plan.name, tuple(reversed(plan.ne)), np.dtype(np.float32),
                               plan.nbytes, raw_dtype=plan.ggml_type)
    files = writer.format_shard_names(path)
    shard_of = {name: i for i, shard in enumerate(writer.tensors) for name in shard}
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    assert writer.fout is not None
    positions = [f.tell() for f in writer.fout]
    writer.close()
    align = writer.data_alignment
    ends = [GGUFWriter.ggml_pad(p, align) for p in positions]
    places = []
    for plan in plans:
        file = shard_of[plan.name]
        places.append((file, ends[file]))
        ends[file] += GGUFWriter.ggml_pad(plan.nbytes, align)
    return files, places, ends


def _mp_context() -> multiprocessing.context.BaseContext:
    """fork on Linux, spawn elsewhere.

    fork starts workers at once and, unlike spawn, does not re-run an unguarded caller's
    __main__. The children only generate random numbers and pwrite, so threads the caller
    may have (BLAS, llama.cpp) cannot leave them a lock they need; glibc's malloc is
    fork-safe.
    """
    if sys.platform.startswith("linux"):
        return multiprocessing.get_context("fork")
    return multiprocessing.get_context("spawn")


def _write_data(paths: list[Path], jobs: list[_Job], workers: int, total: int,
                progress: Callable[[int, int], None] | None) -> None:
    done = 0
    if progress:
        progress(0, total)
    if workers <= 1:
        fds = [os.open(p, os.O_WRONLY) for p in paths]
        try:
            for job in jobs:
                done += _pwrite_all(fds[job.file], _generate(job), job.offset)
                if progress:
                    progress(done, total)
        finally:
            for fd in fds:
                os.close(fd)
        return
    with warnings.catch_warnings():
        # Python >= 3.12 warns about fork in a threaded process; see _mp_context.
        warnings.filterwarnings("ignore", r".*fork\(\) may lead to deadlocks", DeprecationWarning)
        pool = _mp_context().Pool(workers, initializer=_init_worker,
                                    initargs=([str(p) for p in paths],))
    with pool:
        for n in pool.imap_unordered(_run_job, jobs, chunksize=1):
            done += n
            if progress:
                progress(done, total)


def make_model(
    out_path: str | os.PathLike[str],
    preset: str,
    qtype: str = "f16",
    seed: int = 0,
    *,
    n_layers: int | None = None,
    workers: int | None = None,
    progress: Callable[[int, int], None] | None = None,
    fuse_gate_up: bool = False,
    split_max_size: int = 0,
    split_max_tensors: int = 0,
) -> ModelInfo:
    """Write a random-weight GGUF of model `preset` (a models.yaml name) to `out_path`: a MoE
    model, or a dense draft (``ModelSpec.is_dense``) with the vocabulary of the MoE presets of
    its vocab and text_tokens.

    qtype is one of f16, q8_0, q4_0, q4_1, q4_k; `seed` fixes the weights; `n_layers` overrides
    the preset's layer count; `workers` is the number of writer processes (default: all
    CPUs, or in-process for small models); `progress(bytes_done, bytes_total)` is called as
    tensor data is written; `fuse_gate_up` writes each layer's gate and up experts as one
    tensor, as the converter's --fuse-gate-up-exps does. `split_max_size` (bytes of tensor data)
    and `split_max_tensors` write the model as split files, as gguf-split does, named
    ``STEM-00001-of-0000N.gguf`` beside `out_path` (a model within both limits stays one file);
    the tensors are those of the same model in one file. The files are written in a temporary
    directory beside `out_path` and renamed when complete. Raises ValueError for an unknown
    preset or type, a negative limit, or a preset whose architecture make-model does not write.
    """
    started = time.monotonic()
    qtype = qtype.lower()
    parse_qtype(qtype)
    spec = get_spec(preset).with_layers(n_layers)
    if not spec.writable:
        raise ValueError(f"make-model cannot write {spec.name}: its architecture {spec.arch} is "
                         f"a shape for the simulator only (make-model writes "
                         f"{', '.join(ARCHES)})")
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    if split_max_size < 0 or split_max_tensors < 0:
        raise ValueError("split limits must be >= 0 (0: no limit)")
    plans = tensor_plan(spec, qtype, fuse_gate_up)
    total = sum(p.nbytes for p in plans)
    if workers is None:
        workers = 1 if total < POOL_MIN_BYTES else (os.cpu_count() or 1)

    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    # shards keep their final names inside the temporary directory (GGUFWriter names them)
    tmp_dir = out.with_name(f".{out.name}.{os.getpid()}.partial")
    shutil.rmtree(tmp_dir, ignore_errors=True)
    tmp_dir.mkdir()
    try:
        tmp_files, places, sizes = _write_header(tmp_dir / out.name, spec, qtype, seed, plans,
                                                 split_max_size, split_max_tensors)
        file_bytes = sum(sizes)
        free = shutil.disk_usage(out.parent).free
        if free < file_bytes - sum(f.stat().st_size for f in tmp_files):
            raise OSError(f"{out.parent}: {file_bytes / 1e9:.1f} GB needed, "
                          f"{free / 1e9:.1f} GB free")
        for f, size in zip(tmp_files, sizes, strict=True):
            os.truncate(f, size)
        _write_data(tmp_files, _jobs(plans, places, seed), workers, total, progress)
        for f in tmp_files:
            fd = os.open(f, os.O_WRONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        files = [out.with_name(f.name) for f in tmp_files]
        for f, dest in zip(tmp_files, files, strict=True):
            os.replace(f, dest)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    return ModelInfo(
        path=files[0],
        preset=spec.name,
        qtype=qtype,
        seed=seed,
        layers=spec.layers,
        n_tensors=len(plans),
        file_bytes=file_bytes,
        seconds=time.monotonic() - started,
        sizes=size_report(spec, qtype),
        shards=tuple(files),
        dense=spec.is_dense,
    )

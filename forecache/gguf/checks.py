"""Header checks that keep a damaged or hand-edited GGUF from reaching llama.cpp's asserts.

llama.cpp trusts many header values: a zero or huge layer count, more used experts than experts,
a NaN epsilon or an SPM tokenizer over a BPE vocabulary abort the process (exit 134, nothing on
stderr while the load log is muted). Every value forecache or llama.cpp reads for a MoE model is
checked here first, each failure one line naming the key, the value and the fix.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Protocol

from forecache.gguf.base import GGUFError, is_expert_tensor


class ModelFile(Protocol):
    """What the checks read of a header (``gguf.header.ModelFile`` has it)."""

    path: Path
    kv: dict[str, Any]
    kv_types: dict[str, int]
    array_lengths: dict[str, int]
    tensors: list[Any]
    duplicate_token: Any

    @property
    def arch(self) -> str: ...

LLAMA_MAX_LAYERS = 512  # llama-hparams.h
LLAMA_MAX_EXPERTS = 1024  # llama-hparams.h
TENSOR_ALIGNMENT = 32  # ggml-impl.h: tensor data is mapped in place at this alignment
MAX_CONTEXT = 1 << 30
MAX_WIDTH = 1 << 20
# Tokenizer models llama.cpp knows (llama-vocab.cpp), and the arrays each needs besides tokens.
TOKENIZER_ARRAYS = {"llama": ("tokenizer.ggml.scores", "tokenizer.ggml.token_type"),
                    "gpt2": ("tokenizer.ggml.merges",), "bert": (), "t5": (), "rwkv": (),
                    "plamo2": (), "no_vocab": (), "none": ()}
SPECIAL_IDS = ("bos", "eos", "eot", "eom", "unknown", "separator", "padding", "mask")
UINT32 = 4  # GGUF value type of general.alignment


def _int(mf: ModelFile, key: str, lo: int, hi: int, required: bool = True,
         per_layer: bool = False) -> int | None:
    """An integer hyperparameter in [lo, hi]; with ``per_layer`` an array of one per layer is
    allowed too (llama.cpp reads head counts and widths so), and its largest entry is returned."""
    full = f"{mf.arch}.{key}"
    if full not in mf.kv:
        if required:
            raise _error(mf, f"has no {full}", "it is not a complete model header")
        return None
    value = mf.kv[full]
    values = value if per_layer and isinstance(value, list) else [value]
    if per_layer and isinstance(value, list) and len(value) != mf.array_lengths.get(full):
        raise _error(mf, f"{full} is an array of {mf.array_lengths.get(full)} entries", "")
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int):
            raise _error(mf, f"{full} is {_show(v)}, not an integer", "")
        if not lo <= v <= hi:
            raise _error(mf, f"{full} is {v}, outside {lo}..{hi}", "")
    return max(values) if values else None


def _show(v: Any) -> str:
    text = repr(v)
    return f"{type(v).__name__} {text[:40]}{'...' if len(text) > 40 else ''}"


def _error(mf: ModelFile, what: str, why: str) -> Exception:
    why = why or "the header is damaged or was edited by hand"
    return GGUFError(f"{mf.path}: {what}; {why}: re-create or re-convert the model")


def check_header(mf: ModelFile) -> None:
    """Refuse, in one line, a header whose values llama.cpp would assert on or forecache could
    not use."""
    align = mf.kv.get("general.alignment")
    if align is not None:
        if mf.kv_types.get("general.alignment") != UINT32 or isinstance(align, bool) or \
                not isinstance(align, int):
            raise _error(mf, f"general.alignment is {_show(align)}, not a uint32", "")
        if align < TENSOR_ALIGNMENT or align & (align - 1):
            raise _error(mf, f"general.alignment is {align}",
                         f"llama.cpp needs a power of two of at least {TENSOR_ALIGNMENT}")
    n_layer = _int(mf, "block_count", 1, LLAMA_MAX_LAYERS)
    _int(mf, "context_length", 1, MAX_CONTEXT)
    n_embd = _int(mf, "embedding_length", 1, MAX_WIDTH)
    n_expert = _int(mf, "expert_count", 1, LLAMA_MAX_EXPERTS)
    assert n_layer is not None and n_expert is not None
    _int(mf, "expert_used_count", 1, n_expert)
    _int(mf, "expert_feed_forward_length", 1, MAX_WIDTH, required=False, per_layer=True)
    _int(mf, "expert_shared_feed_forward_length", 0, MAX_WIDTH, required=False)
    _int(mf, "feed_forward_length", 0, MAX_WIDTH, required=False, per_layer=True)
    n_head = _int(mf, "attention.head_count", 1, 1 << 16, per_layer=True)
    n_head_kv = _int(mf, "attention.head_count_kv", 0, 1 << 16, required=False, per_layer=True)
    if n_head is not None and n_head_kv is not None and n_head_kv > n_head:
        raise _error(mf, f"{mf.arch}.attention.head_count_kv {n_head_kv} exceeds head_count "
                     f"{n_head}", "")
    for key in ("attention.layer_norm_rms_epsilon", "attention.layer_norm_epsilon"):
        eps = mf.kv.get(f"{mf.arch}.{key}")
        if eps is not None and (isinstance(eps, bool) or not isinstance(eps, (int, float)) or
                                not math.isfinite(eps) or not 0 < eps < 1):
            raise _error(mf, f"{mf.arch}.{key} is {_show(eps)}",
                         "a layer-norm epsilon is a number between 0 and 1")
    base = mf.kv.get(f"{mf.arch}.rope.freq_base")
    if base is not None and (isinstance(base, bool) or not isinstance(base, (int, float)) or
                             not math.isfinite(base) or base <= 0):
        raise _error(mf, f"{mf.arch}.rope.freq_base is {_show(base)}", "")
    layers = {int(t.name.split(".")[1]) for t in mf.tensors
              if t.name.startswith("blk.") and t.name.split(".")[1].isdigit()}
    if layers and max(layers) >= n_layer:
        raise _error(mf, f"{mf.arch}.block_count is {n_layer} but it has tensors of layer "
                     f"{max(layers)}", "")
    for t in mf.tensors:
        if is_expert_tensor(t.name) and (len(t.shape) != 3 or t.shape[2] != n_expert):
            raise _error(mf, f"tensor {t.name} has shape {list(t.shape)} but "
                         f"{mf.arch}.expert_count is {n_expert}", "")
        # every expert projection maps to or from the residual stream (a split model's shard
        # of another model's weights shows here)
        if is_expert_tensor(t.name) and n_embd not in t.shape[:2]:
            raise _error(mf, f"tensor {t.name} has shape {list(t.shape)} but "
                         f"{mf.arch}.embedding_length is {n_embd}", "")
    _check_tokenizer(mf)
    _check_template(mf)


def _check_tokenizer(mf: ModelFile) -> None:
    model = mf.kv.get("tokenizer.ggml.model")
    if not isinstance(model, str) or model not in TOKENIZER_ARRAYS:
        raise _error(mf, f"tokenizer.ggml.model is {_show(model)}",
                     f"llama.cpp knows {', '.join(sorted(TOKENIZER_ARRAYS))}")
    n_vocab = mf.array_lengths.get("tokenizer.ggml.tokens", 0)
    if model not in ("none", "no_vocab"):
        if n_vocab == 0:
            raise _error(mf, "has no tokenizer.ggml.tokens", "")
        for key in TOKENIZER_ARRAYS[model]:
            if key not in mf.array_lengths:
                raise _error(mf, f"tokenizer {model!r} needs {key}, which it lacks", "")
            if key != "tokenizer.ggml.merges" and mf.array_lengths[key] != n_vocab:
                raise _error(mf, f"{key} has {mf.array_lengths[key]} entries for {n_vocab} "
                             "tokens", "")
    if mf.duplicate_token is not None:
        raise _error(mf, f"token {mf.duplicate_token!r} appears twice in tokenizer.ggml.tokens",
                     "")
    for name in SPECIAL_IDS:
        key = f"tokenizer.ggml.{name}_token_id"
        tid = mf.kv.get(key)
        if tid is not None and (isinstance(tid, bool) or not isinstance(tid, int) or
                                not -1 <= tid < max(n_vocab, 1)):
            raise _error(mf, f"{key} is {_show(tid)} for {n_vocab} tokens", "")


def _check_template(mf: ModelFile) -> None:
    template = mf.kv.get("tokenizer.chat_template")
    if template is None:
        return
    if not isinstance(template, str):
        raise _error(mf, f"tokenizer.chat_template is {_show(template)}, not a string", "")
    import jinja2

    try:
        jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError as e:
        raise _error(mf, f"its chat template (tokenizer.chat_template) is not valid Jinja "
                     f"(line {e.lineno}: {e.message})",
                     "llama-cpp-python compiles it on every load") from None

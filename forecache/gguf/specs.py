"""Model shapes from models.yaml, and the GGUF tensor layout and sizes they imply.

A `ModelSpec` holds one model's hyperparameters (a MoE model's, or a dense draft's).
`tensor_plan` lists the tensors llama.cpp expects for it (names, shapes, and ggml types as
``qtypes`` chooses them) and `size_report` sums parameters and bytes per tensor class, which is
what memory budgets need: routed-expert weights can live off the GPU, everything else is needed
for every token.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from gguf import (
    MODEL_ARCH,
    MODEL_ARCH_NAMES,
    MODEL_TENSOR,
    TENSOR_NAMES,
    GGMLQuantizationType,
)

from forecache.gguf.header import expert_proj_bytes, tensor_nbytes
from forecache.gguf.qtypes import parse_qtype, tensor_type

#: models.yaml ships inside the package (forecache/data), so every install has it.
MODELS_YAML = Path(__file__).resolve().parent.parent / "data" / "models.yaml"

#: Tensor classes. "expert" is the routed experts (the part worth caching); the rest is dense.
TENSOR_KINDS = ("embedding", "norm", "attention", "router", "shared_expert", "dense_ffn",
                "expert_bias", "expert")


class UnknownModelError(ValueError):
    """Raised for a model name that models.yaml does not define."""


@dataclass(frozen=True)
class ArchSpec:
    """An architecture forecache can write."""

    name: str
    hf_architecture: str
    description: str = ""


@dataclass(frozen=True)
class ModelSpec:
    """Hyperparameters of one model (one entry of models.yaml `models`): a MoE model, or a
    dense one (``is_dense``: a draft for speculative decoding, its MoE fields 0)."""

    name: str
    arch: str
    hf_repo: str | None
    description: str
    layers: int
    experts: int
    top_k: int
    shared_experts: int
    expert_ff: int
    shared_expert_ff: int
    ff: int
    d_model: int
    heads: int
    kv_heads: int
    vocab: int
    text_tokens: int
    context_length: int
    rope_theta: float
    rms_eps: float
    typical_q4_gb: float | None = None
    key_length: int | None = None  # head_dim where it is not d_model / heads (qwen3moe)
    # granitemoe's multipliers (HF embedding_multiplier, residual_multiplier,
    # attention_multiplier, logits_scaling)
    embedding_scale: float | None = None
    residual_scale: float | None = None
    attention_scale: float | None = None
    logit_scale: float | None = None
    # deepseek2: leading dense layers, multi-head latent attention (q_lora_rank None: q is
    # one matrix; key_length is the per-head q/k width, rope_dim of it rotary; value_length
    # the per-head v width), and its routing (gating softmax or sigmoid, a selection bias,
    # top-k weights renormalized and scaled, experts in groups of which the best are used)
    dense_layers: int = 0
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    rope_dim: int | None = None
    value_length: int | None = None
    gating: str = "softmax"
    expert_probs_bias: bool = False
    expert_weights_norm: bool = False
    expert_weights_scale: float | None = None
    expert_groups: int = 1
    expert_groups_used: int = 1
    # gpt-oss: sliding-window attention on every other layer
    sliding_window: int | None = None
    # lfm2moe: the layers with attention (the others are gated short convolutions, whose state
    # spans conv_cache tokens)
    attention_layers: tuple[int, ...] | None = None
    conv_cache: int | None = None
    # qwen35moe: Gated DeltaNet (linear attention) in the layers outside attention_layers, with
    # linear_k_heads query/key heads and linear_v_heads value heads of linear_head_dim each and
    # a causal convolution conv_cache wide
    linear_k_heads: int | None = None
    linear_v_heads: int | None = None
    linear_head_dim: int | None = None
    # no output.weight: the logits reuse token_embd (Qwen2-0.5B's tie_word_embeddings)
    tied_embeddings: bool = False

    @property
    def is_dense(self) -> bool:
        """A dense model (no routed experts): a draft for speculative decoding, not a MoE
        model for the expert cache or the simulator."""
        return self.arch in DENSE_ARCHES

    @property
    def writable(self) -> bool:
        """make-model writes this model (its architecture is in ``ARCHES``); the others are
        shapes for sizes and the simulator only."""
        return self.arch in ARCHES

    @property
    def moe_layers(self) -> int:
        """Layers with routed experts (all but the leading dense ones; none if dense)."""
        return 0 if self.is_dense else self.layers - self.dense_layers

    @property
    def head_dim(self) -> int:
        """Size of one attention head."""
        return self.key_length or self.d_model // self.heads

    @property
    def q_dim(self) -> int:
        """Width of the Q projection (all heads)."""
        return self.head_dim * self.heads

    @property
    def kv_dim(self) -> int:
        """Width of the K and V projections (GQA)."""
        return self.head_dim * self.kv_heads

    def with_layers(self, layers: int | None) -> ModelSpec:
        """Return a copy with `layers` blocks (None keeps the count)."""
        if layers is None:
            return self
        if layers < 1:
            raise ValueError(f"layer count must be >= 1, got {layers}")
        return dataclasses.replace(self, layers=layers)

    def validate(self) -> None:
        """Raise ValueError if the shape is inconsistent."""
        problems = []
        if self.key_length is None and self.d_model % self.heads:
            problems.append("d_model is not a multiple of heads (give key_length)")
        if self.heads % self.kv_heads:
            problems.append("heads is not a multiple of kv_heads")
        if self.is_dense:
            if any((self.experts, self.top_k, self.shared_experts, self.expert_ff,
                    self.shared_expert_ff, self.dense_layers)):
                problems.append(f"{self.arch} is dense: no experts ({', '.join(MOE_KEYS)} "
                                f"and dense_layers are 0 or left out)")
            if self.key_length is not None:
                problems.append(f"{self.arch}'s heads are d_model / heads wide: no key_length")
        elif not 0 < self.top_k <= self.experts:
            problems.append("top_k must be in 1..experts")
        if self.tied_embeddings and self.arch not in TIED_ARCHES:
            problems.append(f"{self.arch}'s llama.cpp loader needs output.weight: "
                            f"tied_embeddings is for {', '.join(TIED_ARCHES)}")
        if self.arch == "qwen2moe" and self.shared_experts != 1:
            problems.append("qwen2moe has exactly one shared expert")
        if self.arch in NO_SHARED_EXPERT and self.shared_experts:
            problems.append(f"{self.arch} has no shared expert")
        if self.arch == "granitemoe" and self.logit_scale is None:
            problems.append("granitemoe needs logit_scale")
        if self.arch in FF_IS_EXPERT_FF and self.ff != self.expert_ff:
            problems.append(f"{self.arch}'s experts are feed_forward_length wide: "
                            f"ff = expert_ff")
        if self.arch == "olmoe" and (self.kv_heads != self.heads or self.key_length):
            problems.append("olmoe norms q and k over d_model: kv_heads = heads")
        if self.arch == "lfm2moe" and (self.attention_layers is None or not self.conv_cache):
            problems.append("lfm2moe needs attention_layers and conv_cache")
        if self.arch == "qwen35moe" and (self.attention_layers is None or not self.conv_cache or
                                         None in (self.linear_k_heads, self.linear_v_heads,
                                                  self.linear_head_dim)):
            problems.append("qwen35moe needs attention_layers, conv_cache, linear_k_heads, "
                            "linear_v_heads and linear_head_dim")
        if self.attention_layers is not None and not set(self.attention_layers) <= set(
                range(self.layers)):
            problems.append("attention_layers must be layer indices")
        if self.arch == "gpt-oss" and self.sliding_window is None:
            problems.append("gpt-oss needs sliding_window")
        if self.arch == "deepseek2":
            if None in (self.kv_lora_rank, self.rope_dim, self.key_length, self.value_length):
                problems.append("deepseek2 needs kv_lora_rank, rope_dim, key_length and "
                                "value_length")
            elif self.key_length <= self.rope_dim:
                problems.append("key_length must be more than rope_dim")
            if self.kv_heads != 1:
                problems.append("deepseek2 attends as one latent kv head: kv_heads = 1")
            if self.shared_expert_ff != self.expert_ff * self.shared_experts:
                problems.append("deepseek2's shared experts are expert_ff wide each: "
                                "shared_expert_ff = expert_ff * shared_experts")
        if not self.is_dense and not 0 <= self.dense_layers < self.layers:
            problems.append("dense_layers must leave at least one MoE layer")
        if self.gating not in GATING:
            problems.append(f"gating is one of {', '.join(GATING)}")
        if self.experts % self.expert_groups or not (
                0 < self.expert_groups_used <= self.expert_groups):
            problems.append("experts must split into expert_groups, of which "
                            "1..expert_groups are used")
        if self.arch not in LAYOUT_ARCHES:
            problems.append(f"forecache lays out {', '.join(LAYOUT_ARCHES)}, not {self.arch}")
        if not 256 + 1 <= self.text_tokens <= self.vocab - 3:
            problems.append("text_tokens must leave room for 3 special tokens in vocab")
        if problems:
            raise ValueError(f"model {self.name!r} in models.yaml: " + "; ".join(problems))


@dataclass(frozen=True)
class TensorPlan:
    """One tensor of the GGUF: `ne` is in ggml order (ne[0] is the row length)."""

    name: str
    ne: tuple[int, ...]
    ggml_type: GGMLQuantizationType
    kind: str

    @property
    def n_elements(self) -> int:
        """Number of weights."""
        n = 1
        for d in self.ne:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        """Size of the tensor data in the file, without alignment padding."""
        return tensor_nbytes(self.ne, self.ggml_type)


@dataclass(frozen=True)
class SizeReport:
    """Parameters and bytes of a model in one weight type, split by tensor class."""

    qtype: str
    params: dict[str, int]
    bytes: dict[str, int]
    expert_params: int
    total_expert_bytes: int  # every routed expert of every layer
    nonexpert_params: int
    nonexpert_bytes: int
    expert_bytes: int  # one routed expert of one layer (header.expert_proj_bytes, summed)
    active_bytes_per_token: int

    @property
    def total_params(self) -> int:
        """All parameters."""
        return self.expert_params + self.nonexpert_params

    @property
    def total_bytes(self) -> int:
        """All tensor bytes (the GGUF file is this plus header and padding)."""
        return self.total_expert_bytes + self.nonexpert_bytes


#: Architectures without a shared expert, and those whose experts are feed_forward_length
#: wide (no expert_feed_forward_length key), as llama.cpp's converter writes them.
NO_SHARED_EXPERT = ("qwen3moe", "llama", "olmoe", "granitemoe", "gpt-oss", "lfm2moe")
FF_IS_EXPERT_FF = ("llama", "olmoe", "granitemoe", "gpt-oss")

#: Router score functions, as llama.cpp numbers them (LLAMA_EXPERT_GATING_FUNC_TYPE_*).
GATING = {"softmax": 1, "sigmoid": 2}

#: Dense architectures make-model writes: drafts for speculative decoding (qwen2: Qwen2-0.5B
#: drafting for Qwen2-57B-A14B, with its vocabulary).
DENSE_ARCHES = (MODEL_ARCH_NAMES[MODEL_ARCH.QWEN2],)

#: Architectures whose llama.cpp loader takes the output matrix from token_embd when the file
#: has no output.weight (qwen2.cpp: output is TENSOR_NOT_REQUIRED).
TIED_ARCHES = DENSE_ARCHES

#: The MoE fields, which a dense model's entry may leave out (they are 0).
MOE_KEYS = ("experts", "top_k", "shared_experts", "expert_ff", "shared_expert_ff")

#: The architectures make-model writes (general.architecture names).
ARCHES = tuple(MODEL_ARCH_NAMES[a] for a in (MODEL_ARCH.QWEN2MOE, MODEL_ARCH.QWEN3MOE,
                                             MODEL_ARCH.LLAMA, MODEL_ARCH.OLMOE,
                                             MODEL_ARCH.GRANITE_MOE, MODEL_ARCH.DEEPSEEK2,
                                             MODEL_ARCH.GPT_OSS, MODEL_ARCH.LFM2MOE)) + \
    DENSE_ARCHES

#: Architectures whose tensors forecache lays out (sizes, the simulator's shapes) but make-model
#: does not write: qwen35moe's Gated DeltaNet layers need header keys and tensors make-model
#: has no writer for.
SHAPE_ONLY_ARCHES = (MODEL_ARCH_NAMES[MODEL_ARCH.QWEN35MOE],)
LAYOUT_ARCHES = ARCHES + SHAPE_ONLY_ARCHES


#: Architectures whose llama.cpp loader takes gate and up experts fused in one tensor (the
#: converter's --fuse-gate-up-exps).
FUSED_GATE_UP = ("deepseek2",)


def tensor_plan(spec: ModelSpec, qtype: str, fuse_gate_up: bool = False) -> list[TensorPlan]:
    """List the tensors of `spec` in file order, with the shapes llama.cpp's loader expects.

    Expert tensors hold all experts of a layer: gate/up are {d_model, expert_ff, experts} (or
    one gate_up {d_model, 2 expert_ff, experts} with ``fuse_gate_up``) and down is
    {expert_ff, d_model, experts} in ggml order, so one expert is a contiguous slab.
    qwen2moe has q/k/v biases and a sigmoid-gated shared expert; qwen3moe neither, but RMS
    norms of each head's q and k, and heads that need not split d_model; llama (Mixtral) has
    neither biases nor norms nor a shared expert, and granitemoe is laid out as it is (its
    multipliers are header keys); olmoe norms the whole of q and k; deepseek2 has dense leading
    layers, latent attention and shared experts; gpt-oss has biases everywhere, the experts'
    included, attention sinks and a router bias; lfm2moe has short convolutions in the layers
    without attention, dense leading layers and a selection bias, and no output matrix.
    A dense model (qwen2) has one feed-forward per layer, q/k/v biases, and no output matrix
    with ``tied_embeddings``.
    """
    if spec.arch not in LAYOUT_ARCHES:
        raise ValueError(f"cannot lay out architecture {spec.arch!r}; supported: "
                         f"{', '.join(LAYOUT_ARCHES)}")
    if fuse_gate_up and spec.arch not in FUSED_GATE_UP:
        raise ValueError(f"llama.cpp loads fused gate/up experts for {', '.join(FUSED_GATE_UP)}"
                         f", not {spec.arch}")
    parse_qtype(qtype)
    out: list[TensorPlan] = []

    def add(tensor: MODEL_TENSOR, suffix: str, shape: tuple[int, ...], kind: str,
            bid: int | None = None) -> None:
        name = TENSOR_NAMES[tensor].format(bid=bid) + ("." + suffix if suffix else "")
        out.append(TensorPlan(name, shape, tensor_type(name, shape, qtype, spec.layers,
                                                       spec.experts, spec.tied_embeddings),
                              kind))

    T = MODEL_TENSOR
    d = spec.d_model
    add(T.TOKEN_EMBD, "weight", (d, spec.vocab), "embedding")
    for b in range(spec.layers):
        add(T.ATTN_NORM, "weight", (d,), "norm", b)
        _attention(spec, b, add)
        post = spec.arch in ("gpt-oss", "qwen35moe")  # named post_attention_norm
        add(T.ATTN_POST_NORM if post else T.FFN_NORM, "weight", (d,), "norm", b)
        if spec.is_dense or b < spec.dense_layers:
            add(T.FFN_GATE, "weight", (d, spec.ff), "dense_ffn", b)
            add(T.FFN_UP, "weight", (d, spec.ff), "dense_ffn", b)
            add(T.FFN_DOWN, "weight", (spec.ff, d), "dense_ffn", b)
        else:
            _experts(spec, b, add, fuse_gate_up)
    if spec.arch == MODEL_ARCH_NAMES[MODEL_ARCH.LFM2MOE]:
        # its final norm is named token_embd_norm, its output tied to the embeddings
        add(T.TOKEN_EMBD_NORM, "weight", (d,), "norm")
        return out
    add(T.OUTPUT_NORM, "weight", (d,), "norm")
    if not spec.tied_embeddings:
        add(T.OUTPUT, "weight", (d, spec.vocab), "embedding")
    return out


_Add = Callable[[MODEL_TENSOR, str, tuple[int, ...], str, int], None]


def _attention(spec: ModelSpec, b: int, add: _Add) -> None:
    """Block ``b``'s attention (or lfm2moe's short convolution) and its q/k norms."""
    T = MODEL_TENSOR
    d, kv, q = spec.d_model, spec.kv_dim, spec.q_dim
    arch = spec.arch
    if arch == "qwen35moe":
        _qwen35_attention(spec, b, add)
        return
    if spec.attention_layers is not None and b not in spec.attention_layers:
        assert spec.conv_cache is not None
        add(T.SHORTCONV_CONV, "weight", (spec.conv_cache, d), "attention", b)
        add(T.SHORTCONV_INPROJ, "weight", (d, 3 * d), "attention", b)
        add(T.SHORTCONV_OUTPROJ, "weight", (d, d), "attention", b)
        return
    if spec.kv_lora_rank is not None:
        _latent_attention(spec, b, add)
        return
    biases = arch in ("qwen2moe", "qwen2", "gpt-oss")
    for t, width in ((T.ATTN_Q, q), (T.ATTN_K, kv), (T.ATTN_V, kv)):
        add(t, "weight", (d, width), "attention", b)
        if biases:
            add(t, "bias", (width,), "attention", b)
    add(T.ATTN_OUT, "weight", (q, d), "attention", b)
    if arch == "gpt-oss":
        add(T.ATTN_OUT, "bias", (d,), "attention", b)
        add(T.ATTN_SINKS, "weight", (spec.heads,), "attention", b)
    if arch in ("qwen3moe", "lfm2moe"):  # each head's q and k
        add(T.ATTN_K_NORM, "weight", (spec.head_dim,), "norm", b)
        add(T.ATTN_Q_NORM, "weight", (spec.head_dim,), "norm", b)
    elif arch == "olmoe":  # the whole of q and of k
        add(T.ATTN_Q_NORM, "weight", (q,), "norm", b)
        add(T.ATTN_K_NORM, "weight", (kv,), "norm", b)


def _experts(spec: ModelSpec, b: int, add: _Add, fuse_gate_up: bool) -> None:
    """Block ``b``'s router, routed experts (gpt-oss: with biases) and shared experts."""
    T = MODEL_TENSOR
    d, n_exp, fe, fs = spec.d_model, spec.experts, spec.expert_ff, spec.shared_expert_ff
    oss = spec.arch == "gpt-oss"
    add(T.FFN_GATE_INP, "weight", (d, n_exp), "router", b)
    if oss:
        add(T.FFN_GATE_INP, "bias", (n_exp,), "router", b)
    if spec.expert_probs_bias:
        add(T.FFN_EXP_PROBS_B, "bias", (n_exp,), "router", b)
    projs = [(T.FFN_GATE_UP_EXP, (d, 2 * fe, n_exp))] if fuse_gate_up else [
        (T.FFN_GATE_EXP, (d, fe, n_exp)), (T.FFN_UP_EXP, (d, fe, n_exp))]
    for t, shape in projs + [(T.FFN_DOWN_EXP, (fe, d, n_exp))]:
        add(t, "weight", shape, "expert", b)
        if oss:  # beside the weights, read by the same routed ids (ADD_ID)
            add(t, "bias", shape[1:], "expert_bias", b)
    if spec.arch in ("qwen2moe", "qwen35moe"):  # its shared expert's sigmoid gate
        add(T.FFN_GATE_INP_SHEXP, "weight", (d,), "shared_expert", b)
    if spec.shared_experts:
        add(T.FFN_GATE_SHEXP, "weight", (d, fs), "shared_expert", b)
        add(T.FFN_UP_SHEXP, "weight", (d, fs), "shared_expert", b)
        add(T.FFN_DOWN_SHEXP, "weight", (fs, d), "shared_expert", b)


def _qwen35_attention(spec: ModelSpec, b: int, add: _Add) -> None:
    """qwen35moe's block ``b`` as the vendored llama.cpp loads it (models/qwen35moe.cpp): full
    attention in ``attention_layers`` (q carries an output gate as wide as itself; q and k
    normed per head), Gated DeltaNet elsewhere (q, k and v in one matrix, a z gate, a causal
    convolution over them, per-head decay and beta, a normed, gated output)."""
    T = MODEL_TENSOR
    d = spec.d_model
    assert spec.attention_layers is not None and spec.conv_cache is not None
    if b in spec.attention_layers:
        add(T.ATTN_Q, "weight", (d, 2 * spec.q_dim), "attention", b)
        add(T.ATTN_K, "weight", (d, spec.kv_dim), "attention", b)
        add(T.ATTN_V, "weight", (d, spec.kv_dim), "attention", b)
        add(T.ATTN_OUT, "weight", (spec.q_dim, d), "attention", b)
        add(T.ATTN_Q_NORM, "weight", (spec.head_dim,), "norm", b)
        add(T.ATTN_K_NORM, "weight", (spec.head_dim,), "norm", b)
        return
    assert None not in (spec.linear_k_heads, spec.linear_v_heads, spec.linear_head_dim)
    hd, n_v = spec.linear_head_dim, spec.linear_v_heads
    key, value = hd * spec.linear_k_heads, hd * n_v  # type: ignore[operator]
    add(T.ATTN_QKV, "weight", (d, 2 * key + value), "attention", b)
    add(T.ATTN_GATE, "weight", (d, value), "attention", b)
    add(T.SSM_CONV1D, "weight", (spec.conv_cache, 2 * key + value), "attention", b)
    add(T.SSM_DT, "bias", (n_v,), "attention", b)
    add(T.SSM_A, "", (n_v,), "attention", b)
    add(T.SSM_BETA, "weight", (d, n_v), "attention", b)
    add(T.SSM_ALPHA, "weight", (d, n_v), "attention", b)
    add(T.SSM_NORM, "weight", (hd,), "norm", b)
    add(T.SSM_OUT, "weight", (value, d), "attention", b)


def _latent_attention(spec: ModelSpec, b: int, add: _Add) -> None:
    """deepseek2's multi-head latent attention as the converter writes it: q through a rank
    q_lora_rank bottleneck (or one matrix), k and v compressed to kv_lora_rank plus the shared
    rotary part, kv_b split into per-head k_b (transposed) and v_b."""
    T = MODEL_TENSOR
    d, h, kl = spec.d_model, spec.heads, spec.kv_lora_rank
    assert kl is not None and spec.rope_dim is not None and spec.value_length is not None
    nope = spec.head_dim - spec.rope_dim
    if spec.q_lora_rank:
        add(T.ATTN_Q_A, "weight", (d, spec.q_lora_rank), "attention", b)
        add(T.ATTN_Q_A_NORM, "weight", (spec.q_lora_rank,), "norm", b)
        add(T.ATTN_Q_B, "weight", (spec.q_lora_rank, spec.q_dim), "attention", b)
    else:
        add(T.ATTN_Q, "weight", (d, spec.q_dim), "attention", b)
    add(T.ATTN_KV_A_MQA, "weight", (d, kl + spec.rope_dim), "attention", b)
    add(T.ATTN_KV_A_NORM, "weight", (kl,), "norm", b)
    add(T.ATTN_K_B, "weight", (nope, kl, h), "attention", b)
    add(T.ATTN_V_B, "weight", (kl, spec.value_length, h), "attention", b)
    add(T.ATTN_OUT, "weight", (h * spec.value_length, d), "attention", b)


def size_report(spec: ModelSpec, qtype: str) -> SizeReport:
    """Count parameters and bytes per tensor class for `spec` written as `qtype`.

    `expert_bytes` is one expert of one layer (its gate, up and down slabs, averaged over the
    MoE layers as :func:`~forecache.gguf.header.expert_proj_bytes` does for a file);
    `active_bytes_per_token` is the dense part plus top_k experts in every layer (a dense
    model: all of it, and no expert bytes).
    """
    params = dict.fromkeys(TENSOR_KINDS, 0)
    nbytes = dict.fromkeys(TENSOR_KINDS, 0)
    plan = tensor_plan(spec, qtype)
    for t in plan:
        params[t.kind] += t.n_elements
        nbytes[t.kind] += t.nbytes
    dense_params = sum(v for k, v in params.items() if k != "expert")
    dense_bytes = sum(v for k, v in nbytes.items() if k != "expert")
    per_expert = 0 if spec.is_dense else sum(expert_proj_bytes(plan, spec.experts))
    return SizeReport(
        qtype=qtype.lower(),
        params=params,
        bytes=nbytes,
        expert_params=params["expert"],
        total_expert_bytes=nbytes["expert"],
        nonexpert_params=dense_params,
        nonexpert_bytes=dense_bytes,
        expert_bytes=per_expert,
        active_bytes_per_token=dense_bytes + per_expert * spec.top_k * spec.moe_layers,
    )


def models_yaml(path: str | Path | None = None) -> Path:
    """``path``, else the models.yaml that ships with forecache."""
    return Path(path) if path is not None else MODELS_YAML


def _model_from_dict(name: str, raw: Mapping[str, Any]) -> ModelSpec:
    fields = {f.name for f in dataclasses.fields(ModelSpec)} - {"name"}
    unknown = set(raw) - fields
    if raw.get("arch") in DENSE_ARCHES:  # a dense model's MoE fields are 0
        raw = {**dict.fromkeys(MOE_KEYS, 0), **raw}
    missing = {f.name for f in dataclasses.fields(ModelSpec)
               if f.default is dataclasses.MISSING and f.name != "name"} - set(raw)
    if unknown or missing:
        raise ValueError(
            f"model {name!r} in models.yaml: unknown keys {sorted(unknown)}, "
            f"missing keys {sorted(missing)}"
        )
    fixed = {k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()}
    spec = ModelSpec(name=name, **{**fixed, "description": raw.get("description") or ""})
    spec.validate()
    return spec


@functools.lru_cache(maxsize=8)
def _load(path: Path) -> tuple[dict[str, ArchSpec], dict[str, ModelSpec]]:
    data = yaml.safe_load(path.read_text())
    archs = {
        name: ArchSpec(name=name, **(raw or {}))
        for name, raw in (data.get("architectures") or {}).items()
    }
    models = {}
    for name, raw in (data.get("models") or {}).items():
        spec = _model_from_dict(str(name), raw)
        if spec.arch not in archs:
            raise ValueError(f"model {name!r} in {path}: architecture {spec.arch!r} not listed")
        models[spec.name] = spec
    return archs, models


def load_specs(path: str | Path | None = None) -> dict[str, ModelSpec]:
    """All models of models.yaml by name, in file order."""
    return dict(_load(models_yaml(path).resolve())[1])


def model_names(path: str | Path | None = None) -> list[str]:
    """Names of the known models, in file order."""
    return list(load_specs(path))


def get_spec(name: str, path: str | Path | None = None) -> ModelSpec:
    """Look a model up by name (case-insensitive); UnknownModelError lists the known names."""
    specs = load_specs(path)
    spec = specs.get(name) or specs.get(name.lower())
    if spec is None:
        raise UnknownModelError(f"unknown model {name!r}; known models: {', '.join(specs)}")
    return spec

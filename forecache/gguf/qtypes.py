"""The quantizer's rules: which ggml type each tensor of a model gets when it is written as one
of ``make-model --type``'s weight types, as llama.cpp's quantizer (llama-quant.cpp) chooses them.

The one place that decides tensor types: ``specs.tensor_plan`` (and with it make-model and the size
reports) and the timing models' shapes (``roofline.shape``) all ask :func:`tensor_type`.
"""

from __future__ import annotations

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, LlamaFileType

from forecache.gguf.base import EXPERT_TENSOR_SUFFIX

#: The weight types `make-model --type` accepts: ggml type of the matrices and file type label.
QTYPES: dict[str, tuple[GGMLQuantizationType, LlamaFileType]] = {
    "f16": (GGMLQuantizationType.F16, LlamaFileType.MOSTLY_F16),
    "q8_0": (GGMLQuantizationType.Q8_0, LlamaFileType.MOSTLY_Q8_0),
    "q4_0": (GGMLQuantizationType.Q4_0, LlamaFileType.MOSTLY_Q4_0),
    "q4_1": (GGMLQuantizationType.Q4_1, LlamaFileType.MOSTLY_Q4_1),
    # Every matrix is Q4_K (except the Q5_0 fallbacks), which llama.cpp labels Q4_K_S.
    "q4_k": (GGMLQuantizationType.Q4_K, LlamaFileType.MOSTLY_Q4_K_S),
    # llama.cpp's Q4_K_M mix: Q4_K with Q6_K where it spends more bits (q4_k_m_type), so the
    # experts of some layers are larger than others'.
    "q4_k_m": (GGMLQuantizationType.Q4_K, LlamaFileType.MOSTLY_Q4_K_M),
    # Routed experts in MXFP4 (as gpt-oss ships), every other matrix Q8_0.
    "mxfp4": (GGMLQuantizationType.MXFP4, LlamaFileType.MOSTLY_MXFP4_MOE),
}

#: Same fallbacks as llama.cpp's quantizer (tensor_type_fallback in llama-quant.cpp) for a
#: row length that is not a multiple of the type's block size.
_FALLBACK: dict[GGMLQuantizationType, GGMLQuantizationType] = {
    GGMLQuantizationType.Q4_K: GGMLQuantizationType.Q5_0,
    GGMLQuantizationType.Q5_K: GGMLQuantizationType.Q5_1,
    GGMLQuantizationType.Q6_K: GGMLQuantizationType.Q8_0,
    GGMLQuantizationType.Q2_K: GGMLQuantizationType.Q4_0,
    GGMLQuantizationType.Q3_K: GGMLQuantizationType.Q4_0,
}


def parse_qtype(qtype: str) -> GGMLQuantizationType:
    """Map a `--type` name to its ggml type; ValueError naming the valid ones otherwise."""
    try:
        return QTYPES[qtype.lower()][0]
    except KeyError:
        raise ValueError(
            f"unknown weight type {qtype!r}; valid types: {', '.join(QTYPES)}"
        ) from None


def _use_more_bits(i_layer: int, n_layer: int) -> bool:
    """llama-quant.cpp's use_more_bits: the first and last eighth of the layers and every third
    one between."""
    return i_layer < n_layer // 8 or i_layer >= 7 * n_layer // 8 or \
        (i_layer - n_layer // 8) % 3 == 2


def q4_k_m_type(name: str, n_layer: int, n_expert: int,
                tied_embeddings: bool = False) -> GGMLQuantizationType:
    """The type llama.cpp's quantizer gives a matrix in a Q4_K_M file (llama_tensor_get_type):
    the output Q6_K (token_embd, where ``tied_embeddings`` makes it the output too); every
    ffn_down (the routed and shared experts' included) and attn_v Q6_K in the layers
    use_more_bits picks (attn_v Q8_0 with 8 experts); the rest Q4_K."""
    Q = GGMLQuantizationType
    if name == "output.weight" or (tied_embeddings and name == "token_embd.weight"):
        return Q.Q6_K
    il = int(name.split(".")[1]) if name.startswith("blk.") else -1
    if ".ffn_down" in name and _use_more_bits(il, n_layer):
        return Q.Q6_K
    if ".attn_v." in name:
        return Q.Q8_0 if n_expert == 8 else Q.Q6_K if _use_more_bits(il, n_layer) else Q.Q4_K
    return Q.Q4_K


def tensor_type(name: str, ne: tuple[int, ...], qtype: str, n_layer: int = 1,
                n_expert: int = 0, tied_embeddings: bool = False) -> GGMLQuantizationType:
    """Choose the ggml type of one tensor when the model is written as `qtype`.

    1-D tensors (norms, biases), the experts' biases, the routers and the convolutions stay
    F32: llama.cpp's quantizer never quantizes them and routing is sensitive to their precision.
    Matrices get the requested type (mxfp4: the routed experts, the rest q8_0; q4_k_m: by layer,
    as ``q4_k_m_type``), or llama.cpp's fallback when the row length (ne[0]) does not fit its
    block size. ``n_layer`` and ``n_expert`` are the model's, for the by-layer choices;
    ``tied_embeddings``: the model has no output.weight, its token_embd serves as the output.
    """
    if len(ne) == 1 or name.endswith((".bias", "ffn_gate_inp.weight",
                                      "ffn_gate_inp_shexp.weight", "shortconv.conv.weight",
                                      "ssm_conv1d.weight")):
        return GGMLQuantizationType.F32
    want = parse_qtype(qtype)
    if want == GGMLQuantizationType.MXFP4 and not name.endswith(EXPERT_TENSOR_SUFFIX):
        want = GGMLQuantizationType.Q8_0
    if qtype.lower() == "q4_k_m":
        want = q4_k_m_type(name, n_layer, n_expert, tied_embeddings)
    if ne[0] % GGML_QUANT_SIZES[want][0] == 0:
        return want
    fallback = _FALLBACK.get(want, want)
    if ne[0] % GGML_QUANT_SIZES[fallback][0] == 0:
        return fallback
    return GGMLQuantizationType.F16

"""A qwen2moe forward pass in numpy, from the GGUF's tensors, for one token at position 0.

At position 0 a token attends only to itself, so each attention head's output is its KV head's
value vector and RoPE is the identity: the whole model is a few matrix products, which makes it a
reference for what the patch does to the MoE layers (which experts a token is routed to, with which
weights) independent of llama.cpp.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

# (layer, the router's top-k in order, its probabilities over all experts) -> the experts kept
KeepFn = Callable[[int, np.ndarray, np.ndarray], list[int]]


def _rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x) + eps) * w


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


class Qwen2MoeNumpy:
    """The model of a qwen2moe GGUF, dequantized to float64."""

    def __init__(self, path: Path) -> None:
        reader = GGUFReader(path)
        self.w: dict[str, np.ndarray] = {}
        for t in reader.tensors:
            if t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
                a = np.asarray(t.data)
            else:
                a = dequantize(t.data, t.tensor_type)
            self.w[t.name] = a.astype(np.float64)

        def kv(key: str) -> float:
            f = reader.fields[f"qwen2moe.{key}"]
            return float(f.parts[f.data[0]][0])

        self.n_layer = int(kv("block_count"))
        self.n_head = int(kv("attention.head_count"))
        self.n_head_kv = int(kv("attention.head_count_kv"))
        self.k = int(kv("expert_used_count"))
        self.eps = kv("attention.layer_norm_rms_epsilon")

    def logits(self, token: int, keep: KeepFn | None = None) -> np.ndarray:
        """The logits after ``token`` at position 0; ``keep`` chooses each layer's experts from its
        top-k (default: all of it, the exact model). Kept experts are weighted by their router
        probability, unnormalized, as qwen2moe weights its top-k."""
        w, eps = self.w, self.eps
        x = w["token_embd.weight"][token]
        hd = x.shape[0] // self.n_head
        group = self.n_head // self.n_head_kv
        for il in range(self.n_layer):
            b = f"blk.{il}."
            h = _rms_norm(x, w[b + "attn_norm.weight"], eps)
            v = w[b + "attn_v.weight"] @ h + w[b + "attn_v.bias"]
            heads = [v[(i // group) * hd:(i // group + 1) * hd] for i in range(self.n_head)]
            x = x + w[b + "attn_output.weight"] @ np.concatenate(heads)

            h = _rms_norm(x, w[b + "ffn_norm.weight"], eps)
            z = w[b + "ffn_gate_inp.weight"] @ h
            p = np.exp(z - z.max())
            p /= p.sum()
            top = np.argsort(-p, kind="stable")[:self.k]
            kept = list(top) if keep is None else keep(il, top, p)
            moe = np.zeros_like(x)
            for e in kept:
                act = (_silu(w[b + "ffn_gate_exps.weight"][e] @ h) *
                       (w[b + "ffn_up_exps.weight"][e] @ h))
                moe += p[e] * (w[b + "ffn_down_exps.weight"][e] @ act)
            gate = 1.0 / (1.0 + np.exp(-(w[b + "ffn_gate_inp_shexp.weight"] @ h)))
            shared = w[b + "ffn_down_shexp.weight"] @ (
                _silu(w[b + "ffn_gate_shexp.weight"] @ h) * (w[b + "ffn_up_shexp.weight"] @ h))
            x = x + moe + gate * shared
        out = _rms_norm(x, w["output_norm.weight"], eps)
        head = w.get("output.weight", w["token_embd.weight"])
        return head @ out

"""The reference model in PyTorch: Qwen2-MoE exactly as llama.cpp's qwen2moe graph computes it.

RMSNorm, GQA attention with q/k/v biases and NEOX-style RoPE, a softmax top-k router over routed
SwiGLU experts (router weights not renormalised), and one shared SwiGLU expert scaled by a sigmoid
gate. Parameter shapes are the GGUF tensors' numpy shapes, so export is a rename.

With a ``DenseConfig`` the same code is the dense draft model, llama.cpp's ``qwen2``: the
reference's attention, width, depth and vocabulary with one SwiGLU feed-forward per layer and the
output tied to the token embedding.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class Config:
    """Hyperparameters (the models.yaml preset `reference` has the same values)."""

    vocab: int = 6144
    d_model: int = 256
    layers: int = 8
    heads: int = 4
    kv_heads: int = 2
    experts: int = 32
    top_k: int = 4
    expert_ff: int = 96
    shared_expert_ff: int = 384
    rope_theta: float = 1_000_000.0
    rms_eps: float = 1e-6
    context_length: int = 2048

    @property
    def head_dim(self) -> int:
        return self.d_model // self.heads

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class DenseConfig:
    """The dense draft. Width, depth and heads must equal the reference's: its per-layer FFN
    inputs are fed to the reference's routers (forecache.draft_model)."""

    vocab: int
    d_model: int
    layers: int
    heads: int
    kv_heads: int
    rope_theta: float
    rms_eps: float
    context_length: int
    ff: int = 512
    tied: bool = True  # llama.cpp's qwen2 uses token_embd as the output without output.weight

    @classmethod
    def like(cls, ref: Config, ff: int, tied: bool = True) -> DenseConfig:
        """The reference's shape with a dense feed-forward of width ``ff``."""
        return cls(**{k: getattr(ref, k) for k in ("vocab", "d_model", "layers", "heads",
                                                   "kv_heads", "rope_theta", "rms_eps",
                                                   "context_length")}, ff=ff, tied=tied)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.heads

    def to_dict(self) -> dict:
        return asdict(self)


def config_from_dict(d: dict) -> Config | DenseConfig:
    """A checkpoint's configuration: MoE when it names experts, else the dense draft."""
    return Config(**d) if "experts" in d else DenseConfig(**d)


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """NEOX rotation (llama.cpp's rope type for qwen2moe): the two halves of each head pair up.
    x: [B, H, T, D], pos: [T]."""
    d = x.shape[-1]
    inv = theta ** (-torch.arange(0, d // 2, dtype=torch.float32) * 2 / d)
    ang = pos.float()[:, None] * inv[None, :]
    cos, sin = ang.cos(), ang.sin()
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Attention(nn.Module):
    def __init__(self, c: Config | DenseConfig) -> None:
        super().__init__()
        self.c = c
        kv = c.kv_heads * c.head_dim
        self.q = nn.Linear(c.d_model, c.d_model)
        self.k = nn.Linear(c.d_model, kv)
        self.v = nn.Linear(c.d_model, kv)
        self.o = nn.Linear(c.d_model, c.d_model, bias=False)

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        c = self.c
        q = self.q(x).view(B, T, c.heads, c.head_dim).transpose(1, 2)
        k = self.k(x).view(B, T, c.kv_heads, c.head_dim).transpose(1, 2)
        v = self.v(x).view(B, T, c.kv_heads, c.head_dim).transpose(1, 2)
        q, k = rope(q, pos, c.rope_theta), rope(k, pos, c.rope_theta)
        rep = c.heads // c.kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(B, T, c.d_model))


class MoE(nn.Module):
    """Routed experts (stacked: gate/up [E, ff, d], down [E, d, ff]) plus the shared expert."""

    def __init__(self, c: Config) -> None:
        super().__init__()
        self.c = c
        E, d, f, fs = c.experts, c.d_model, c.expert_ff, c.shared_expert_ff
        self.router = nn.Parameter(torch.randn(E, d) * 0.02)
        self.gate = nn.Parameter(torch.randn(E, f, d) / math.sqrt(d))
        self.up = nn.Parameter(torch.randn(E, f, d) / math.sqrt(d))
        self.down = nn.Parameter(torch.randn(E, d, f) / math.sqrt(f) / math.sqrt(2 * c.layers))
        self.sh_gate_inp = nn.Parameter(torch.zeros(d))
        self.sh_gate = nn.Linear(d, fs, bias=False)
        self.sh_up = nn.Linear(d, fs, bias=False)
        self.sh_down = nn.Linear(fs, d, bias=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Output, the routed ids [N, k], and the load-balancing loss (Switch/Qwen form)."""
        shape = x.shape
        h = x.reshape(-1, shape[-1])
        probs = F.softmax(h @ self.router.T, dim=-1)
        w, ids = probs.topk(self.c.top_k, dim=-1)
        out = torch.zeros_like(h)
        for e in range(self.c.experts):
            tok, slot = (ids == e).nonzero(as_tuple=True)
            if tok.numel() == 0:
                continue
            xe = h[tok]
            ye = (F.silu(xe @ self.gate[e].T) * (xe @ self.up[e].T)) @ self.down[e].T
            out.index_add_(0, tok, ye * w[tok, slot, None])
        shared = self.sh_down(F.silu(self.sh_gate(h)) * self.sh_up(h))
        out = out + torch.sigmoid(h @ self.sh_gate_inp)[:, None] * shared
        E = self.c.experts
        frac = torch.zeros(E).index_add_(0, ids.reshape(-1), torch.ones(ids.numel())) / ids.numel()
        aux = E * (frac * probs.mean(0)).sum()
        return out.view(shape), ids, aux


class SwiGLU(nn.Module):
    """The dense draft's feed-forward, called like MoE (no routes, no load-balancing loss)."""

    def __init__(self, c: DenseConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(c.d_model, c.ff, bias=False)
        self.up = nn.Linear(c.d_model, c.ff, bias=False)
        self.down = nn.Linear(c.ff, c.d_model, bias=False)
        nn.init.normal_(self.down.weight, std=1 / math.sqrt(c.ff) / math.sqrt(2 * c.layers))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        y = self.down(F.silu(self.gate(x)) * self.up(x))
        return y, torch.empty(0, dtype=torch.long), torch.zeros(())


class Block(nn.Module):
    def __init__(self, c: Config | DenseConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(c.d_model, c.rms_eps)
        self.attn = Attention(c)
        self.ffn_norm = RMSNorm(c.d_model, c.rms_eps)
        # separate attribute names keep the MoE checkpoints' `moe.` keys
        if isinstance(c, DenseConfig):
            self.ffn = SwiGLU(c)
        else:
            self.moe = MoE(c)

    def forward(self, x: torch.Tensor, pos: torch.Tensor):  # type: ignore[no-untyped-def]
        x = x + self.attn(self.attn_norm(x), pos)
        ff = self.ffn if hasattr(self, "ffn") else self.moe
        y, ids, aux = ff(self.ffn_norm(x))
        return x + y, ids, aux


class Qwen2Moe(nn.Module):
    """The reference model, or with a DenseConfig the dense draft (llama.cpp's qwen2)."""

    def __init__(self, c: Config | DenseConfig) -> None:
        super().__init__()
        self.c = c
        self.embed = nn.Embedding(c.vocab, c.d_model)
        nn.init.normal_(self.embed.weight, std=0.02)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.norm = RMSNorm(c.d_model, c.rms_eps)
        self.lm_head = nn.Linear(c.d_model, c.vocab, bias=False)
        if getattr(c, "tied", False):
            self.lm_head.weight = self.embed.weight
        else:
            nn.init.normal_(self.lm_head.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor],
                                                     torch.Tensor]:
        """Logits [B, T, V], routed ids per layer, mean load-balancing loss."""
        pos = torch.arange(tokens.shape[1])
        x = self.embed(tokens)
        routes, aux = [], torch.zeros(())
        for blk in self.blocks:
            x, ids, a = blk(x, pos)
            routes.append(ids)
            aux = aux + a
        return self.lm_head(self.norm(x)), routes, aux / len(self.blocks)


def gguf_tensors(model: Qwen2Moe) -> dict[str, torch.Tensor]:
    """Parameters under llama.cpp's tensor names, in the GGUF's numpy shapes."""
    out = {"token_embd.weight": model.embed.weight, "output_norm.weight": model.norm.weight}
    if not getattr(model.c, "tied", False):
        out["output.weight"] = model.lm_head.weight
    for i, b in enumerate(model.blocks):
        p = f"blk.{i}."
        a = b.attn
        out |= {
            p + "attn_norm.weight": b.attn_norm.weight,
            p + "attn_q.weight": a.q.weight, p + "attn_q.bias": a.q.bias,
            p + "attn_k.weight": a.k.weight, p + "attn_k.bias": a.k.bias,
            p + "attn_v.weight": a.v.weight, p + "attn_v.bias": a.v.bias,
            p + "attn_output.weight": a.o.weight,
            p + "ffn_norm.weight": b.ffn_norm.weight,
        }
        if hasattr(b, "ffn"):
            out |= {p + "ffn_gate.weight": b.ffn.gate.weight, p + "ffn_up.weight": b.ffn.up.weight,
                    p + "ffn_down.weight": b.ffn.down.weight}
            continue
        m = b.moe
        out |= {
            p + "ffn_gate_inp.weight": m.router,
            p + "ffn_gate_exps.weight": m.gate, p + "ffn_up_exps.weight": m.up,
            p + "ffn_down_exps.weight": m.down,
            p + "ffn_gate_inp_shexp.weight": m.sh_gate_inp,
            p + "ffn_gate_shexp.weight": m.sh_gate.weight,
            p + "ffn_up_shexp.weight": m.sh_up.weight,
            p + "ffn_down_shexp.weight": m.sh_down.weight,
        }
    return out

"""Skip-based prediction (Mixtral-offloading): layer i's own router applied to an earlier layer's
router input.

The trace holds layer l's router input x_l = g_l * h / rms(h) (ffn_norm with weight g_l). Before
applying layer i's router W_i, the norm weight is swapped to g_i, so the prediction is exactly the
routing layer i would do if the residual stream stopped changing after layer l.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from forecache.errors import setting
from forecache.gguf.header import ModelFile
from forecache.predictor.base import Predictor
from forecache.trace.format import Request


def _softmax(x: np.ndarray) -> np.ndarray:
    p = np.exp(x - x.max(axis=-1, keepdims=True))
    return p / p.sum(axis=-1, keepdims=True)


@dataclass(frozen=True)
class RouterForm:
    """How a layer turns router logits into its choice (llama.cpp's build_moe_ffn): softmax or
    sigmoid scores, a per-expert bias on the logits (gpt-oss) or on the scores that only
    selection sees (DeepSeek-V3), and the best ``groups_used`` of ``groups`` expert groups."""

    sigmoid: bool = False
    groups: int = 1
    groups_used: int = 1
    weights_after: bool = False  # gpt-oss: the chosen logits are softmaxed after the choice

    @classmethod
    def of(cls, model: ModelFile) -> RouterForm:
        """The form the model's header gives (expert_gating_func 2 is sigmoid; gpt-oss's is
        fixed in llama.cpp's graph)."""
        return cls(sigmoid=int(model.arch_kv("expert_gating_func", 1) or 1) == 2,
                   groups=int(model.arch_kv("expert_group_count", 1) or 1),
                   groups_used=int(model.arch_kv("expert_group_used_count", 1) or 1),
                   weights_after=model.arch == "gpt-oss")

    def probs(self, logits: np.ndarray) -> np.ndarray:
        """The router's scores, whose chosen entries weigh the experts' outputs (before any
        renormalization)."""
        if self.sigmoid:
            return 1.0 / (1.0 + np.exp(-logits))
        return logits if self.weights_after else _softmax(logits)

    def select(self, logits: np.ndarray, select_bias: np.ndarray | None) -> np.ndarray:
        """Scores [.., E] in the order of the layer's choice: a distribution, zero outside the
        chosen groups."""
        s = self.probs(logits) if self.sigmoid else logits
        if select_bias is not None:
            s = s + select_bias
        p = _softmax(s)
        if self.groups > 1:  # a group's score is the sum of its two best experts'
            g = s.reshape(*s.shape[:-1], self.groups, -1)
            top2 = np.sort(g, axis=-1)[..., -2:].sum(axis=-1)
            keep = np.argsort(-top2, axis=-1, kind="stable")[..., :self.groups_used]
            mask = np.zeros(top2.shape, bool)
            np.put_along_axis(mask, keep, True, axis=-1)
            p = p * np.repeat(mask, g.shape[-1], axis=-1)
            p /= p.sum(axis=-1, keepdims=True)
        return p


@dataclass(frozen=True)
class Router:
    """One MoE layer's router [E, d], its ffn_norm weight [d] and its biases (None if absent)."""

    weight: np.ndarray
    norm: np.ndarray
    bias: np.ndarray | None = None  # added to the logits
    select_bias: np.ndarray | None = None  # added to the scores, for selection only


def routers_of(model: ModelFile, layers: Sequence[int]) -> list[Router]:
    """The routers of the given model blocks, as float32."""
    from forecache.gguf.tensors import tensor_array

    def read(name: str) -> np.ndarray | None:
        return tensor_array(model, name)

    out = []
    for il in layers:
        w = read(f"blk.{il}.ffn_gate_inp.weight")
        g = read(f"blk.{il}.ffn_norm.weight")
        if g is None:  # gpt-oss names the norm before its experts for the attention
            g = read(f"blk.{il}.post_attention_norm.weight")
        if w is None or g is None:
            raise ValueError(f"{model.path.name} has no router or ffn_norm in block {il}; the "
                             "skip predictor needs each MoE layer's router and ffn_norm")
        out.append(Router(w.reshape(model.n_expert, -1), g.reshape(-1),
                          read(f"blk.{il}.ffn_gate_inp.bias"), read(f"blk.{il}.exp_probs_b.bias")))
    return out


class SkipPredictor(Predictor):
    """The target layer's router on an earlier input, x_from * g_to / g_from, scored as the
    target layer selects (``RouterForm``)."""

    name = "skip"
    needs = ("gate_input",)

    def __init__(self, n_layers: int, n_expert: int, top_k: int, *,
                 routers: Sequence[Router], form: RouterForm = RouterForm()) -> None:
        super().__init__(n_layers, n_expert, top_k)
        if len(routers) != n_layers:
            raise ValueError(f"skip predictor: {len(routers)} routers for {n_layers} MoE layers")
        self.routers = list(routers)
        self.form = form

    @classmethod
    def from_model(cls, model: ModelFile, moe_layers: Sequence[int]) -> SkipPredictor:
        """Read the routers of ``moe_layers`` (model block indices) from the GGUF."""
        return cls(len(moe_layers), model.n_expert, model.n_expert_used,
                   routers=routers_of(model, moe_layers), form=RouterForm.of(model))

    def logits(self, layer_from: int, layer_to: int, x: np.ndarray) -> np.ndarray:
        """Layer ``layer_to``'s router logits on layer ``layer_from``'s router input."""
        g_from, to = self.routers[layer_from].norm, self.routers[layer_to]
        ratio = np.where(np.abs(g_from) > 1e-12, to.norm / np.where(
            np.abs(g_from) > 1e-12, g_from, 1.0), 0.0).astype(np.float32)
        logits = (np.asarray(x, np.float32) * ratio) @ to.weight.T
        if to.bias is not None:
            logits += to.bias
        return logits

    def _scores(self, layer_from: int, layer_to: int, x: np.ndarray) -> np.ndarray:
        return self.form.select(self.logits(layer_from, layer_to, x),
                                self.routers[layer_to].select_bias)

    def predict(self, layer_from: int, layer_to: int, *, hidden: np.ndarray | None = None,
                ) -> np.ndarray:
        if hidden is None:
            raise ValueError("the skip predictor needs the gate input of layer_from")
        return self._scores(layer_from, layer_to, hidden)

    def score_request(self, req: Request, pairs: Sequence[tuple[int, int]],
                      ) -> dict[tuple[int, int], np.ndarray]:
        if req.gate_input is None:
            raise ValueError("the skip predictor needs gate inputs (trace with "
                             f"{setting('gate_input', True)})")
        return {(lf, lt): self._scores(lf, lt, np.asarray(req.gate_input[:, lf], np.float32))
                for lf, lt in pairs}

"""Skip-based prediction (Mixtral-offloading): layer i's own router applied to an earlier layer's
router input.

The trace holds layer l's router input x_l = g_l * h / rms(h) (ffn_norm with weight g_l). Before
applying layer i's router W_i, the norm weight is swapped to g_i, so the prediction is exactly the
routing layer i would do if the residual stream stopped changing after layer l.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from forecache.errors import setting
from forecache.gguf.header import ModelFile
from forecache.predictor.base import Predictor
from forecache.trace.format import Request


def router_weights(model: ModelFile, layers: Sequence[int]) -> tuple[list[np.ndarray],
                                                                     list[np.ndarray]]:
    """Router matrices [E, d] and ffn_norm weights [d] of the given model blocks, as float32."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(model.path)
    by_name = {t.name: t for t in reader.tensors}
    routers, norms = [], []
    for il in layers:
        for name in (f"blk.{il}.ffn_gate_inp.weight", f"blk.{il}.ffn_norm.weight"):
            if name not in by_name:
                raise ValueError(f"{model.path.name} has no tensor {name}; the skip predictor "
                                 "needs each MoE layer's router and ffn_norm")
        w = by_name[f"blk.{il}.ffn_gate_inp.weight"]
        g = by_name[f"blk.{il}.ffn_norm.weight"]
        routers.append(np.asarray(dequantize(w.data, w.tensor_type), np.float32)
                       .reshape(model.n_expert, -1))
        norms.append(np.asarray(dequantize(g.data, g.tensor_type), np.float32).reshape(-1))
    return routers, norms


class SkipPredictor(Predictor):
    """softmax(W_to @ (x_from * g_to / g_from)): the target layer's router on an earlier input."""

    name = "skip"
    needs = ("gate_input",)

    def __init__(self, n_layers: int, n_expert: int, top_k: int, *,
                 routers: Sequence[np.ndarray], norms: Sequence[np.ndarray]) -> None:
        super().__init__(n_layers, n_expert, top_k)
        if len(routers) != n_layers or len(norms) != n_layers:
            raise ValueError(f"skip predictor: {len(routers)} routers for {n_layers} MoE layers")
        self.routers = [np.asarray(r, np.float32) for r in routers]
        self.norms = [np.asarray(g, np.float32) for g in norms]

    @classmethod
    def from_model(cls, model: ModelFile, moe_layers: Sequence[int]) -> SkipPredictor:
        """Read the routers of ``moe_layers`` (model block indices) from the GGUF."""
        routers, norms = router_weights(model, moe_layers)
        return cls(len(moe_layers), model.n_expert, model.n_expert_used, routers=routers,
                   norms=norms)

    def _scores(self, layer_from: int, layer_to: int, x: np.ndarray) -> np.ndarray:
        g_from = self.norms[layer_from]
        ratio = np.where(np.abs(g_from) > 1e-12, self.norms[layer_to] / np.where(
            np.abs(g_from) > 1e-12, g_from, 1.0), 0.0).astype(np.float32)
        logits = (np.asarray(x, np.float32) * ratio) @ self.routers[layer_to].T
        logits -= logits.max(axis=-1, keepdims=True)
        p = np.exp(logits)
        return p / p.sum(axis=-1, keepdims=True)

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

"""ProMoE's learned predictor: per (layer_from, layer_to) pair, a two-layer MLP from the gate
input of ``layer_from`` to the experts of ``layer_to``, run through onnxruntime on the CPU."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import ClassVar

import numpy as np

from forecache.paths import write_atomic
from forecache.predictor.base import Predictor
from forecache.predictor.mlp import OnnxMLP, hidden_size, to_onnx, train_mlp
from forecache.trace.format import Request

FORMAT_VERSION = 1
META_FILE = "learned.json"
# Scale of the popularity prior added to the logits: breaks exact ties only.
TIE_BREAK = 1e-4


def onnx_file(layer_from: int, layer_to: int) -> str:
    """File name of one pair's network inside a saved predictor's directory."""
    return f"learned-{layer_from}-{layer_to}.onnx"


def _json_safe(stats: dict) -> dict:
    """Stats with NaN (no validation rows) as null: strict JSON readers reject NaN."""
    return {k: None if isinstance(v, float) and not np.isfinite(v) else v
            for k, v in stats.items()}


class LearnedPredictor(Predictor):
    """Scores ``layer_to``'s experts with an MLP over ``layer_from``'s gate input (ProMoE §4).

    One network per pair in ``pairs``; ``hidden`` defaults to ``hidden_size(d_model, n_expert)``.
    The popularity prior, scaled by ``TIE_BREAK``, is added to the logits to break ties.
    """

    name: ClassVar[str] = "learned"
    needs: ClassVar[tuple[str, ...]] = ("gate_input",)

    def __init__(self, n_layers: int, n_expert: int, top_k: int, *,
                 pairs: Sequence[tuple[int, int]], d_model: int, hidden: int | None = None,
                 epochs: int = 30, seed: int = 0, threads: int = 1) -> None:
        super().__init__(n_layers, n_expert, top_k)
        self.pairs: list[tuple[int, int]] = [(int(a), int(b)) for a, b in pairs]
        if not self.pairs:
            raise ValueError("LearnedPredictor needs at least one (layer_from, layer_to) pair")
        if len(set(self.pairs)) != len(self.pairs):
            raise ValueError(f"duplicate pairs in {self.pairs}")
        for a, b in self.pairs:
            if not 0 <= a <= b < n_layers:
                raise ValueError(f"pair ({a}, {b}): need 0 <= layer_from <= layer_to < "
                                 f"{n_layers}")
        self.d_model = d_model
        self.hidden = hidden if hidden is not None else hidden_size(d_model, n_expert)
        if self.hidden < 1:
            raise ValueError(f"hidden must be positive (got {self.hidden})")
        self.epochs = epochs
        self.seed = seed
        self.threads = threads
        self.train_stats: dict[tuple[int, int], dict] = {}
        self._onnx: dict[tuple[int, int], bytes] = {}
        self._sessions: dict[tuple[int, int], OnnxMLP] = {}

    # -- training -------------------------------------------------------------------------------
    def fit(self, requests: Sequence[Request]) -> None:
        """Learn the prior, then train one MLP per pair on all rows of ``requests``."""
        if not requests:
            raise ValueError("no requests to train the learned predictor on")
        super().fit(requests)
        for i, req in enumerate(requests):
            gi = req.gate_input
            if gi is None:
                raise ValueError(f"request {i} has no gate_input; the learned predictor trains "
                                 "on gate inputs (record the trace with them)")
            if gi.ndim != 3 or gi.shape[0] != req.n_tokens or gi.shape[1] != self.n_layers \
                    or gi.shape[2] != self.d_model:
                raise ValueError(f"request {i}: gate_input shape {list(gi.shape)}, expected "
                                 f"[{req.n_tokens}, {self.n_layers}, {self.d_model}]")
        by_from: dict[int, list[tuple[int, int]]] = {}
        for pair in self.pairs:
            by_from.setdefault(pair[0], []).append(pair)
        for layer_from, pairs in sorted(by_from.items()):
            # One copy of this layer's gate inputs serves every pair that starts there.
            x = np.concatenate([r.gate_input[:, layer_from, :] for r in requests], axis=0)
            for pair in pairs:
                y = np.concatenate([r.experts[:, pair[1], :] for r in requests], axis=0)
                mlp, stats = train_mlp(x, y, self.n_expert, self.hidden, epochs=self.epochs,
                                       seed=self.seed + 1000 * pair[0] + pair[1])
                self.train_stats[pair] = stats
                self._onnx[pair] = to_onnx(mlp).SerializeToString()
                self._sessions[pair] = OnnxMLP(self._onnx[pair], threads=self.threads)
            del x

    # -- online ---------------------------------------------------------------------------------
    def _session(self, layer_from: int, layer_to: int) -> OnnxMLP:
        sess = self._sessions.get((layer_from, layer_to))
        if sess is None:
            state = "has pairs" if self._sessions else "is not trained; its pairs would be"
            raise KeyError(f"learned predictor has no network for pair ({layer_from}, "
                           f"{layer_to}); it {state} {self.pairs}")
        return sess

    def predict(self, layer_from: int, layer_to: int, *, hidden: np.ndarray | None = None,
                ) -> np.ndarray:
        """Scores [E] for ``layer_to`` from ``hidden``, the gate input of ``layer_from`` ([d])."""
        sess = self._session(layer_from, layer_to)
        if hidden is None:
            raise ValueError("the learned predictor needs hidden= (the gate input of "
                             f"layer {layer_from})")
        scores = sess.run(np.asarray(hidden).reshape(1, -1))[0]
        return scores + (TIE_BREAK * self.prior[layer_to]).astype(np.float32)

    def predict_batch(self, layer_from: int, layer_to: int, hidden: np.ndarray) -> np.ndarray:
        """Scores [n, E] for ``layer_to`` from gate inputs [n, d] of ``layer_from`` (one run)."""
        scores = self._session(layer_from, layer_to).run(hidden)
        return scores + (TIE_BREAK * self.prior[layer_to]).astype(np.float32)

    # -- evaluation -----------------------------------------------------------------------------
    def score_request(self, req: Request, pairs: Sequence[tuple[int, int]],
                      ) -> dict[tuple[int, int], np.ndarray]:
        """Scores [T, E] per pair: one onnxruntime run over all T tokens (same as the online
        path, which depends only on each token's own gate input)."""
        if req.gate_input is None:
            raise ValueError("the learned predictor needs the request's gate_input")
        out = {}
        for a, b in pairs:
            sess = self._session(a, b)
            scores = sess.run(req.gate_input[:, a, :])
            out[(a, b)] = scores + (TIE_BREAK * self.prior[b]).astype(np.float32)
        return out

    # -- persistence ----------------------------------------------------------------------------
    def save(self, directory: str | Path) -> None:
        """Write ``learned-{from}-{to}.onnx`` per pair and ``learned.json`` into ``directory``.

        Each file goes through a temp file and a rename; ``learned.json`` goes last and records
        each network's sha256, so an interrupted save is refused by ``load`` (never half-read).
        """
        if not self._onnx:
            raise ValueError("nothing to save: the learned predictor is not trained")
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        files = {}
        for pair in self.pairs:
            name = onnx_file(*pair)
            write_atomic(d / name, self._onnx[pair])
            files[name] = hashlib.sha256(self._onnx[pair]).hexdigest()
        meta = {
            "format": "forecache-learned-predictor", "version": FORMAT_VERSION,
            "n_layers": self.n_layers, "n_expert": self.n_expert, "top_k": self.top_k,
            "d_model": self.d_model, "hidden": self.hidden, "epochs": self.epochs,
            "seed": self.seed, "pairs": [list(p) for p in self.pairs],
            "files": files,
            "stats": [{"pair": list(p), **_json_safe(self.train_stats.get(p, {}))}
                      for p in self.pairs],
            "prior": self.prior.tolist(),
        }
        write_atomic(d / META_FILE, (json.dumps(meta, indent=1) + "\n").encode())

    @classmethod
    def load(cls, directory: str | Path, threads: int = 1) -> LearnedPredictor:
        """Read a predictor written by ``save``; a missing, corrupt or mismatched file gives a
        ValueError naming it."""
        d = Path(directory)
        meta_path = d / META_FILE
        retrain = "retrain the learned predictor"
        try:
            meta = json.loads(meta_path.read_text())
            if meta.get("version") != FORMAT_VERSION:
                raise ValueError(f"format version {meta.get('version')!r}, this build reads "
                                 f"{FORMAT_VERSION}")
            pairs = [(int(a), int(b)) for a, b in meta["pairs"]]
            p = cls(int(meta["n_layers"]), int(meta["n_expert"]), int(meta["top_k"]),
                    pairs=pairs, d_model=int(meta["d_model"]), hidden=int(meta["hidden"]),
                    epochs=int(meta.get("epochs", 30)), seed=int(meta.get("seed", 0)),
                    threads=threads)
            prior = np.asarray(meta["prior"], dtype=np.float64)
            if prior.shape != (p.n_layers, p.n_expert):
                raise ValueError(f"prior shape {list(prior.shape)}")
            p.prior = prior
            files = meta["files"]
            stats = {(int(s["pair"][0]), int(s["pair"][1])): s for s in meta.get("stats", [])}
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{meta_path}: cannot read the learned predictor ({e}); "
                             f"{retrain}") from e
        for pair in pairs:
            path = d / onnx_file(*pair)
            try:
                data = path.read_bytes()
                if hashlib.sha256(data).hexdigest() != files.get(path.name):
                    raise ValueError(f"contents do not match {META_FILE} (interrupted save?)")
                sess = OnnxMLP(data, threads=threads)
                if (sess.d_model, sess.n_expert) != (p.d_model, p.n_expert):
                    raise ValueError(f"network shape [{sess.d_model} -> {sess.n_expert}], "
                                     f"expected [{p.d_model} -> {p.n_expert}]")
            except Exception as e:  # onnxruntime raises its own exception types
                raise ValueError(f"{path}: cannot load the learned predictor's network ({e}); "
                                 f"{retrain}") from e
            p._onnx[pair] = data
            p._sessions[pair] = sess
            s = dict(stats.get(pair, {}))
            s.pop("pair", None)
            p.train_stats[pair] = s
        return p

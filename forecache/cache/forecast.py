"""Sliding-window prediction: gate events in, predicted experts of the layer ``window`` ahead out.

``Forecaster`` is the synchronous core (the simulator calls it at the virtual gate time);
``ForecastWorker`` runs it on its own thread at run time. Its events come from a source: the C
cache's queue of gate events at run time (``cache.runtime.GateEvents``: no Python on the gate's
path), or ``submit`` (onnxruntime releases the GIL while it predicts).
"""

from __future__ import annotations

import os
import queue
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from forecache.predictor.base import Predictor, source_layer, top_experts

# (target layer, experts best first)
Forecast = list[tuple[int, np.ndarray]]


class Forecaster:
    """Drives one predictor over a model's gate events.

    Layers are the model's MoE layers in order (index i of ``moe_layers``); at MoE layer i it
    predicts every layer t whose source is i (t - window, or the first layer when t < window),
    picking ``n_predict`` experts (default: the model's top-k, as ProMoE does) for a decode
    token, or for a prefill ubatch the experts most often in the rows' top-k, up to the slots.
    With ``min_score``, a decode token's picks stop at the first expert scoring no more than it
    (``infinity`` asks for the experts an EAM match activates, none when nothing matched).
    """

    def __init__(self, predictor: Predictor, window: int, moe_layers: Sequence[int],
                 n_slots: Sequence[int], *, n_predict: int | None = None,
                 min_score: float | None = None) -> None:
        if window < 1:
            raise ValueError(f"the prediction window must be >= 1 (got {window})")
        self.predictor = predictor
        self.window = window
        self.moe_layers = list(moe_layers)
        self._index = {layer: i for i, layer in enumerate(self.moe_layers)}
        n = len(self.moe_layers)
        self.targets: list[list[int]] = [[t for t in range(1, n) if source_layer(t, window) == i]
                                         for i in range(n)]
        self.n_slots = [n_slots[layer] for layer in self.moe_layers]
        self.n_predict = n_predict or predictor.top_k
        self.min_score = min_score
        self.needs_hidden = "gate_input" in predictor.needs

    def begin_request(self) -> None:
        self.predictor.begin_request()

    def end_request(self) -> None:
        self.predictor.end_request()

    def on_gate(self, layer: int, ids: np.ndarray, hidden: np.ndarray | None,
                token_ids: np.ndarray | None) -> Forecast:
        """Routed ``ids`` [n, k] of model layer ``layer`` (gate input [n, d] when the predictor
        needs it; token ids [n] when known) -> predictions for the layers ahead."""
        i = self._index.get(layer)
        if i is None:
            return []
        p = self.predictor
        n = ids.shape[0]
        for r in range(n):
            if i == 0:
                p.begin_token(None if token_ids is None else int(token_ids[r]))
            p.observe(i, ids[r])
        out: Forecast = []
        for t in self.targets[i]:
            if n == 1:
                h = None if hidden is None else hidden[0]
                if self.needs_hidden and h is None:
                    continue
                scores = p.predict(i, t, hidden=h)
                top = top_experts(scores, self.n_predict)
                if self.min_score is not None:
                    top = top[scores[top] > self.min_score]
                out.append((self.moe_layers[t], top))
            elif hidden is not None and hasattr(p, "predict_batch"):
                scores = p.predict_batch(i, t, hidden)  # [n, E]
                top = top_experts(scores, p.top_k)
                counts = np.bincount(top.ravel(), minlength=p.n_expert)
                order = np.lexsort((-scores.sum(axis=0), -counts))
                order = order[counts[order] > 0][:self.n_slots[t]]
                out.append((self.moe_layers[t], order))
            # other predictors follow tokens one at a time: no prefill prediction
        return out


class EventSource(Protocol):
    """Where a worker's items come from, in order: gate events and its own control items."""

    def put(self, item: tuple) -> None: ...

    def get(self) -> tuple: ...


class ForecastWorker:
    """A thread that runs a ``Forecaster`` on gate events and hands each forecast to ``apply``
    (target layer, experts, pass id). Events come from ``source`` (default: a queue fed by
    ``submit``, which never waits for a prediction).

    A predictor that raises stops forecasting for the rest of the run, said once through ``say``
    (stderr by default) and kept in ``errors``: the cache then works reactively, and the output,
    which never depends on predictions, stays the same."""

    def __init__(self, forecaster: Forecaster,
                 apply: Callable[[int, np.ndarray, int], object],
                 say: Callable[[str], None] | None = None,
                 source: EventSource | None = None) -> None:
        self.forecaster = forecaster
        self._apply = apply
        self._say = say or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self._q: EventSource = source if source is not None else queue.SimpleQueue()
        self.errors: list[BaseException] = []
        self._thread = threading.Thread(target=self._run, name="forecache-forecast",
                                         daemon=True)
        self._thread.start()

    def submit(self, layer: int, ids: np.ndarray, hidden: np.ndarray | None,
               token_ids: np.ndarray | None, pass_id: int) -> None:
        """Queue a gate event (arrays are copied: the hook's views die with the call)."""
        h = None
        if hidden is not None and self.forecaster.needs_hidden:
            h = np.array(hidden[-1:] if ids.shape[0] == 1 else hidden, dtype=np.float32)
        self._q.put(("gate", layer, ids.copy(), h,
                     None if token_ids is None else np.array(token_ids), pass_id))

    def begin_request(self) -> None:
        self._q.put(("begin",))

    def end_request(self) -> None:
        self._q.put(("end",))

    def drain(self) -> None:
        """Block until every queued event has been handled."""
        done = threading.Event()
        self._q.put(("sync", done))
        done.wait()

    def close(self) -> None:
        self._q.put(("stop",))
        self._thread.join(timeout=5)

    def _run(self) -> None:
        _lower_priority()
        while True:
            item = self._q.get()
            kind = item[0]
            try:
                if kind == "stop":
                    return
                if kind == "sync":
                    item[1].set()
                elif kind == "begin":
                    self.forecaster.begin_request()
                elif kind == "end":
                    self.forecaster.end_request()
                elif not self.errors:
                    _, layer, ids, h, toks, pass_id = item
                    for target, experts in self.forecaster.on_gate(layer, ids, h, toks):
                        self._apply(target, experts, pass_id)
            except Exception as e:  # an exception here must not stop generation
                self.errors.append(e)
                if len(self.errors) == 1:
                    name = self.forecaster.predictor.name
                    self._say(f"forecache: the {name} predictor failed ({type(e).__name__}: {e}); "
                              "prefetching is off for the rest of this run (the output is "
                              "unaffected)")


# niceness of the prediction thread: on a machine whose cores all compute the model (a CPU build),
# a prediction waits for a free core instead of taking one from the model's threads
WORKER_NICENESS = 10


def _lower_priority() -> None:
    """Lower the calling thread's CPU priority (Linux: niceness is per thread)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WORKER_NICENESS)
    except (AttributeError, OSError):
        pass

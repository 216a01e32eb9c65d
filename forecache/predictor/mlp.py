"""The learned predictor's network: a two-layer MLP (ProMoE section 4), its training in numpy,
its export to ONNX and its inference through onnxruntime on the CPU.

The MLP maps a gate input (the hidden state entering a layer's router, [d_model]) to logits over
a later layer's experts ([n_expert]); the top-k logits are the predicted experts.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from forecache.predictor.metrics import topk_accuracy

OPSET = 17
# IR version 8 is the one that goes with opset 17: keeps the files loadable by onnxruntime >= 1.17.
IR_VERSION = 8

# ProMoE: ~2M parameters per predictor at DeepSeek-V2-Lite size (d_model 2048, 64 experts).
PROMOE_PARAMS = 2_000_000
PROMOE_D_MODEL = 2048
HIDDEN_MIN = 64
HIDDEN_MAX = 1024
# First-layer multiply-adds per token (d_model * hidden). Measured on one core of the AMD EPYC
# (Zen 3, AVX2) dev machine with onnxruntime 1.31: 2^20 MACs at d_model 3584 (hidden 288) run in
# ~100 us median, half the 200 us budget; ProMoE's 2M (d 2048, hidden 960) take ~185 us there.
FIRST_LAYER_MACS = 1 << 20
# Above this, training standardises each minibatch instead of a whole float32 copy of x.
PRECOMPUTE_BYTES = 1 << 30
# Minibatch products below this many multiply-adds train on one BLAS thread.
SMALL_GEMM_MACS = 1 << 22


def _round32(v: float) -> int:
    return int(round(v / 32.0)) * 32


def hidden_size(d_model: int, n_expert: int) -> int:
    """The MLP's hidden width for a model shape.

    Rule:

    1. Parameter target ``2M * (d_model / 2048)**2``: ProMoE's ~2M at d_model 2048 / 64 experts,
       scaled with the square of the width so that small models get small, fast-to-train nets
       (a fixed 2M would give the 256-wide ``tiny`` model a 1024-wide hidden layer).
       ``hidden = target / (d_model + n_expert)``, rounded to a multiple of 32.
    2. Clamped to [64, 1024].
    3. Latency cap: ``d_model * hidden <= 2**20`` first-layer multiply-adds, rounded down to a
       multiple of 32 (the floor of 64 wins for d_model > 16384). Single-token CPU latency is
       proportional to the weights streamed; at Qwen2-57B-A14B size (3584, 64) this gives
       hidden 288 and ~100 us on one core, half of ProMoE's ~200 us budget.

    Examples: tiny (256, 16) -> 128; DeepSeek-V2-Lite (2048, 64) and Qwen1.5-MoE (2048, 60)
    -> 512 (uncapped: 960); Qwen2-57B-A14B (3584, 64) -> 288; Mixtral (4096, 8) -> 256.
    """
    if d_model <= 0 or n_expert <= 0:
        raise ValueError(f"d_model and n_expert must be positive (got {d_model}, {n_expert})")
    target = PROMOE_PARAMS * (d_model / PROMOE_D_MODEL) ** 2
    hidden = min(max(_round32(target / (d_model + n_expert)), HIDDEN_MIN), HIDDEN_MAX)
    cap = (FIRST_LAYER_MACS // d_model) // 32 * 32
    return max(min(hidden, cap), HIDDEN_MIN)


@dataclass
class MLP:
    """Two-layer MLP ``relu(((x - mean) * scale) @ w1 + b1) @ w2 + b2``.

    ``w1``/``b1`` act on standardised inputs (what training sees); ``folded`` merges the
    standardisation into them, and both ``forward`` and the ONNX export use the folded weights so
    they compute the same arithmetic.
    """

    w1: np.ndarray  # float32 [d, h]
    b1: np.ndarray  # float32 [h]
    w2: np.ndarray  # float32 [h, E]
    b2: np.ndarray  # float32 [E]
    mean: np.ndarray  # float32 [d]
    scale: np.ndarray  # float32 [d] (1 / std)

    @property
    def d_model(self) -> int:
        return int(self.w1.shape[0])

    @property
    def hidden(self) -> int:
        return int(self.w1.shape[1])

    @property
    def n_expert(self) -> int:
        return int(self.w2.shape[1])

    @property
    def n_params(self) -> int:
        """Parameters of the exported (folded) network."""
        return int(self.w1.size + self.b1.size + self.w2.size + self.b2.size)

    def folded(self) -> tuple[np.ndarray, np.ndarray]:
        """``(w1', b1')`` with the input standardisation folded in: ``x @ w1' + b1'``."""
        s = self.scale.astype(np.float64)
        w1 = self.w1.astype(np.float64)
        w1f = s[:, None] * w1
        b1f = self.b1.astype(np.float64) - (self.mean.astype(np.float64) * s) @ w1
        return w1f.astype(np.float32), b1f.astype(np.float32)

    def forward(self, x: np.ndarray) -> np.ndarray:
        """Logits float32 [n, E] for inputs [n, d] (float16 or float32)."""
        w1f, b1f = self.folded()
        h = np.maximum(np.asarray(x, dtype=np.float32) @ w1f + b1f, 0.0)
        return (h @ self.w2 + self.b2).astype(np.float32, copy=False)


def _openblas() -> tuple[Callable[[], int], Callable[[int], None]] | None:
    """(get, set) for the thread count of the OpenBLAS numpy loaded, or None if not found."""
    try:
        with open("/proc/self/maps") as f:
            paths = {ln.split()[-1] for ln in f if "openblas" in ln.lower() and "/" in ln}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for prefix, suffix in (("scipy_openblas", "64_"), ("openblas", "64_"), ("openblas", "")):
            get = getattr(lib, f"{prefix}_get_num_threads{suffix}", None)
            set_ = getattr(lib, f"{prefix}_set_num_threads{suffix}", None)
            if get is not None and set_ is not None:
                get.restype = ctypes.c_int
                set_.argtypes = [ctypes.c_int]
                return get, set_
    return None


@contextmanager
def blas_threads(n: int | None) -> Iterator[None]:
    """Run the block with numpy's OpenBLAS on ``n`` threads (None, or no OpenBLAS: unchanged)."""
    api = _openblas() if n is not None else None
    if api is None:
        yield
        return
    get, set_ = api
    before = get()
    set_(n)
    try:
        yield
    finally:
        set_(before)


def _log_softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(axis=1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=1, keepdims=True))


def _finite_rows(x: np.ndarray, chunk: int = 8192) -> np.ndarray:
    """Mask of rows without inf/nan (float16 gate inputs can overflow), read in chunks."""
    out = np.empty(x.shape[0], dtype=bool)
    for s in range(0, x.shape[0], chunk):
        out[s:s + chunk] = np.isfinite(x[s:s + chunk]).all(axis=1)
    return out


def _moments(x: np.ndarray, chunk: int = 8192) -> tuple[np.ndarray, np.ndarray]:
    """Per-column mean and std in float64, chunked so a float16 array is never copied whole."""
    total = np.zeros(x.shape[1])
    sq = np.zeros(x.shape[1])
    for s in range(0, x.shape[0], chunk):
        c = x[s:s + chunk].astype(np.float64)
        total += c.sum(axis=0)
        sq += (c * c).sum(axis=0)
    mean = total / x.shape[0]
    var = np.maximum(sq / x.shape[0] - mean * mean, 0.0)
    return mean, np.sqrt(var)


def train_mlp(x: np.ndarray, targets: np.ndarray, n_expert: int, hidden: int, *,
              epochs: int = 30, lr: float = 5e-3, batch: int = 256, seed: int = 0,
              time_limit_s: float | None = None, weight_decay: float = 1e-4,
              patience: int = 4, threads: int | None = None) -> tuple[MLP, dict]:
    """Train an MLP from gate inputs ``x`` [n, d] to expert ids ``targets`` [n, k].

    Loss: softmax cross-entropy against the k-hot target divided by k (ranks the true experts
    above the rest, which is what a top-k prediction needs). Adam with decoupled weight decay on
    the weights, He init, shuffled minibatches, all seeded by ``seed``. Rows with an unknown
    target (any -1) or a non-finite input are dropped. The last 10% of the remaining rows
    validate: training stops after ``patience`` epochs without a better validation loss, or
    when ``time_limit_s`` has passed, and the best weights are kept.

    ``threads``: numpy's BLAS threads while training; None picks 1 when a minibatch product is
    small (below ``SMALL_GEMM_MACS``), where waking a second thread costs more than it saves
    (and on a busy machine can cost milliseconds per product), else leaves the BLAS default.

    Returns the MLP and stats: epochs, best_epoch, train_loss, val_loss, val_accuracy (share of
    the true top-k inside the predicted top-k), n_train, n_val, hidden, params, seconds.
    """
    if threads is None and x.ndim == 2 and batch * x.shape[1] * hidden < SMALL_GEMM_MACS:
        threads = 1
    with blas_threads(threads):
        return _train_mlp(x, targets, n_expert, hidden, epochs=epochs, lr=lr, batch=batch,
                          seed=seed, time_limit_s=time_limit_s, weight_decay=weight_decay,
                          patience=patience)


def _train_mlp(x: np.ndarray, targets: np.ndarray, n_expert: int, hidden: int, *,
               epochs: int, lr: float, batch: int, seed: int, time_limit_s: float | None,
               weight_decay: float, patience: int) -> tuple[MLP, dict]:
    t0 = time.perf_counter()
    targets = np.asarray(targets)
    if x.ndim != 2 or targets.ndim != 2 or x.shape[0] != targets.shape[0]:
        raise ValueError(f"x [n, d] and targets [n, k] must have the same n "
                         f"(got {x.shape} and {targets.shape})")
    k = targets.shape[1]
    if not 0 < k <= n_expert:
        raise ValueError(f"targets have {k} experts per row; need 1..{n_expert}")
    if targets.size and int(targets.max()) >= n_expert:
        raise ValueError(f"target expert id {int(targets.max())} >= n_expert {n_expert}")
    keep = (targets >= 0).all(axis=1) & _finite_rows(x)
    rows = np.flatnonzero(keep)
    if rows.size == 0:
        raise ValueError("no rows with known targets and finite inputs to train on")
    xk = x[rows] if rows.size < x.shape[0] else x
    tk = targets[rows].astype(np.int64)
    n, d = xk.shape
    n_val = n // 10
    n_tr = n - n_val

    mean, std = _moments(xk[:n_tr])
    # Floor the std so (near-)constant dimensions do not blow up the folded weights.
    std = np.maximum(std, max(1e-3 * float(std.mean()), 1e-6))
    mean32 = mean.astype(np.float32)
    scale32 = (1.0 / std).astype(np.float32)

    def standardise(a: np.ndarray) -> np.ndarray:
        return (a.astype(np.float32) - mean32) * scale32

    y = np.zeros((n, n_expert), dtype=np.float32)
    np.put_along_axis(y, tk, 1.0 / k, axis=1)
    rng = np.random.default_rng(seed)
    # Shuffle the training rows once into minibatch blocks; each epoch visits the blocks in a
    # new order. With the standardised copy in block order a minibatch is a view, not a gather.
    order = rng.permutation(n_tr)
    blocks = [order[s:s + batch] for s in range(0, n_tr, batch)]
    xs: np.ndarray | None = None
    if n * d * 4 <= PRECOMPUTE_BYTES:  # else standardise each minibatch as it is used
        xs = np.empty((n, d), dtype=np.float32)
        for s in range(0, n_tr, 8192):
            xs[s:min(s + 8192, n_tr)] = standardise(xk[order[s:s + 8192]])
        for s in range(n_tr, n, 8192):
            xs[s:min(s + 8192, n)] = standardise(xk[s:s + 8192])
        y[:n_tr] = y[order]
        blocks = [slice(s, min(s + batch, n_tr)) for s in range(0, n_tr, batch)]
    else:
        blocks = [np.sort(b) for b in blocks]  # sorted gathers read memory in order

    def inputs(sel: np.ndarray | slice) -> np.ndarray:
        return xs[sel] if xs is not None else standardise(xk[sel])

    # All parameters (and their gradients and Adam moments) live in one flat buffer, so that
    # each Adam pass is one numpy call; weights first, so weight decay applies to a prefix.
    shapes = [(d, hidden), (hidden, n_expert), (hidden,), (n_expert,)]
    sizes = [int(np.prod(sh)) for sh in shapes]
    bounds = np.cumsum([0, *sizes])
    n_weights = int(bounds[2])
    flat = np.zeros(int(bounds[-1]), dtype=np.float32)
    grad = np.empty_like(flat)

    def views(buf: np.ndarray) -> list[np.ndarray]:
        return [buf[bounds[i]:bounds[i + 1]].reshape(sh) for i, sh in enumerate(shapes)]

    w1, w2, b1, b2 = views(flat)
    w1[:] = rng.standard_normal((d, hidden)) * np.sqrt(2.0 / d)  # He (ReLU)
    w2[:] = rng.standard_normal((hidden, n_expert)) * np.sqrt(1.0 / hidden)
    gw1, gw2, gb1, gb2 = views(grad)
    m = np.zeros_like(flat)
    v = np.zeros_like(flat)
    tmp = np.empty_like(flat)
    beta1, beta2, eps = 0.9, 0.999, 1e-8
    step = 0

    def evaluate(lo: int, hi: int) -> tuple[float, np.ndarray]:
        logits = np.empty((hi - lo, n_expert), dtype=np.float32)
        for s in range(lo, hi, 8192):
            e = min(s + 8192, hi)
            logits[s - lo:e - lo] = np.maximum(inputs(slice(s, e)) @ w1 + b1, 0.0) @ w2 + b2
        loss = float(-(y[lo:hi] * _log_softmax(logits)).sum() / max(hi - lo, 1))
        return loss, logits

    best = flat.copy()
    best_loss, best_epoch, train_loss, stale, ran = np.inf, 0, float("nan"), 0, 0
    out_of_time = False
    total_steps = max(epochs * len(blocks), 1)
    for epoch in range(1, epochs + 1):
        total = 0.0
        for bi in rng.permutation(len(blocks)):
            sel = blocks[bi]
            xb, yb = inputs(sel), y[sel]
            h = xb @ w1
            h += b1
            np.maximum(h, 0.0, out=h)
            z = h @ w2
            z += b2
            z -= z.max(axis=1, keepdims=True)
            g = np.exp(z)
            norm = g.sum(axis=1, keepdims=True)
            # Cross-entropy per row: log(sum exp z) - y.z (each row of y sums to 1).
            total += float(np.log(norm).sum() - np.vdot(yb, z))
            g /= norm
            g -= yb
            g *= 1.0 / len(xb)
            gh = g @ w2.T
            gh *= h > 0
            np.matmul(xb.T, gh, out=gw1)
            np.matmul(h.T, g, out=gw2)
            gh.sum(axis=0, out=gb1)
            g.sum(axis=0, out=gb2)
            step += 1
            # Cosine decay to 5% over the planned steps: ends closer to the optimum in the
            # same number of epochs than a constant rate.
            lr_t = lr * (0.05 + 0.475 * (1.0 + np.cos(np.pi * (step - 1) / total_steps)))
            # Adam (decoupled weight decay), bias corrections folded into the step size and eps;
            # in place, because at small sizes the elementwise passes cost as much as the
            # products.
            c2 = np.sqrt(1.0 - beta2 ** step)
            step_size = lr_t * c2 / (1.0 - beta1 ** step)
            m *= beta1
            np.multiply(grad, 1.0 - beta1, out=tmp)
            m += tmp
            v *= beta2
            np.square(grad, out=grad)
            grad *= 1.0 - beta2
            v += grad
            flat[:n_weights] *= 1.0 - lr_t * weight_decay
            np.sqrt(v, out=tmp)
            tmp += eps * c2
            np.divide(m, tmp, out=tmp)
            tmp *= step_size
            flat -= tmp
            if time_limit_s is not None and time.perf_counter() - t0 > time_limit_s:
                out_of_time = True
                break
        ran = epoch
        train_loss = total / n_tr
        # Without a validation slice, select on the training loss.
        val_loss = evaluate(n_tr, n)[0] if n_val else train_loss
        if val_loss < best_loss - 1e-6:
            best_loss, best_epoch, stale = val_loss, epoch, 0
            best[:] = flat
        else:
            stale += 1
        if out_of_time or stale >= patience:
            break

    flat[:] = best
    mlp = MLP(w1=w1.copy(), b1=b1.copy(), w2=w2.copy(), b2=b2.copy(), mean=mean32,
              scale=scale32)
    if n_val:
        val_loss, logits = evaluate(n_tr, n)
        hits, rows = topk_accuracy(logits, tk[n_tr:])
        val_acc = hits / rows if rows else float("nan")
    else:
        val_loss, val_acc = float(best_loss), float("nan")
    stats = {
        "epochs": ran, "best_epoch": best_epoch, "train_loss": float(train_loss),
        "val_loss": float(val_loss), "val_accuracy": val_acc, "n_train": int(n_tr),
        "n_val": int(n_val), "hidden": int(hidden), "params": mlp.n_params,
        "stopped_by_time": out_of_time, "seconds": time.perf_counter() - t0,
    }
    return mlp, stats


def to_onnx(mlp: MLP) -> onnx.ModelProto:
    """The MLP as an opset-17 ONNX model: input "x" float32 [N, d], output "scores" [N, E]."""
    w1f, b1f = mlp.folded()
    inits = [numpy_helper.from_array(w1f, "w1"), numpy_helper.from_array(b1f, "b1"),
             numpy_helper.from_array(np.ascontiguousarray(mlp.w2, dtype=np.float32), "w2"),
             numpy_helper.from_array(np.ascontiguousarray(mlp.b2, dtype=np.float32), "b2")]
    nodes = [helper.make_node("Gemm", ["x", "w1", "b1"], ["pre"]),
             helper.make_node("Relu", ["pre"], ["act"]),
             helper.make_node("Gemm", ["act", "w2", "b2"], ["scores"])]
    graph = helper.make_graph(
        nodes, "forecache_learned_predictor",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", mlp.d_model])],
        [helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["N", mlp.n_expert])],
        inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                              producer_name="forecache")
    model.ir_version = IR_VERSION
    onnx.checker.check_model(model)
    return model


def export_onnx(mlp: MLP, path: str | Path) -> None:
    """Write the MLP to ``path`` as ONNX (see ``to_onnx``)."""
    onnx.save_model(to_onnx(mlp), str(path))


class OnnxMLP:
    """An exported MLP in an onnxruntime CPU session (graph optimisation on).

    ``model`` is a path to an .onnx file or its serialised bytes; ``threads`` is the intra-op
    thread count (1: the predictor runs beside llama.cpp and must not take its cores).
    """

    def __init__(self, model: str | Path | bytes, threads: int = 1,
                 inter_threads: int = 1) -> None:
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = inter_threads
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        # Spinning pool threads would burn the cores llama.cpp computes on between predictions.
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        src = model if isinstance(model, bytes) else str(model)
        self.session = ort.InferenceSession(src, so, providers=["CPUExecutionProvider"])
        shape = self.session.get_inputs()[0].shape
        self.d_model = int(shape[1])
        self.n_expert = int(self.session.get_outputs()[0].shape[1])

    def run(self, x: np.ndarray) -> np.ndarray:
        """Scores float32 [n, E] for inputs [n, d] (any float dtype)."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        if x.ndim != 2 or x.shape[1] != self.d_model:
            raise ValueError(f"expected input [n, {self.d_model}], got {list(x.shape)}")
        return self.session.run(None, {"x": x})[0]

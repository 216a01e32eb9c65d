"""A draft model's own llama.cpp context, and SP-MoE's cross-model expert predictor.

The draft runs in a context of its own, made through llama.cpp's C API so that an eval callback
(``forecache_capture_eval``) copies each layer's FFN input ("ffn_norm") of the last token as it is
computed. Fed through the target's router of the corresponding layer, that state names the experts
the target will route the same token to when it verifies it (SP-MoE's structural correspondence:
a draft of the same width and depth, e.g. Qwen2-7B for Qwen2-57B-A14B).

A draft cut from the target itself (``forecache make-draft``: its first N layers, which its
``forecache.draft.*`` keys declare) computes the target's own states in those layers: there the
correspondence is exact, layer for layer, and the deeper layers read its last layer's state.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from forecache.gguf.header import ModelFile, read_model_file
from forecache.gguf.truncate import SOURCE_FINGERPRINT_KEY, declared_first_layers
from forecache.native import libllama, llama_cpp_module
from forecache.native.log import load_log

CAPTURED = b"ffn_norm"  # llama.cpp's name of a layer's FFN input after its norm


def fill_batch(batch: Any, tokens: Sequence[int], pos: int, every_logit: bool) -> None:
    """A llama_batch of ``tokens`` of sequence 0 from position ``pos``, with logits for every
    token or the last one only."""
    for i, t in enumerate(tokens):
        batch.token[i], batch.pos[i], batch.n_seq_id[i] = t, pos + i, 1
        batch.seq_id[i][0] = 0
        batch.logits[i] = every_logit or i == len(tokens) - 1
    batch.n_tokens = len(tokens)


class DraftContext:
    """A GGUF loaded with llama.cpp's C API, one sequence, its KV cache kept in step with a token
    history; with ``capture``, each layer's last FFN input is captured as it is computed."""

    def __init__(self, path: Path, *, n_ctx: int, n_batch: int, n_threads: int,
                 capture: bool, n_ubatch: int | None = None) -> None:
        low = llama_cpp_module()
        self.low = low
        self.model = None
        self.ctx = None
        self.batch = None
        self.capture = None
        mparams = low.llama_model_default_params()
        mparams.n_gpu_layers = 999  # every layer on the device of a GPU build
        with load_log(True) as log:
            self.model = low.llama_model_load_from_file(str(path).encode(), mparams)
        if not self.model:
            reason = "; ".join(text.strip() for _, text in log[-2:]) or "no reason given"
            raise ValueError(f"llama.cpp cannot load it ({reason})")
        n_layer = int(low.llama_model_n_layer(self.model))
        self.n_embd = int(low.llama_model_n_embd(self.model))
        kv = read_model_file(path).kv
        declared = declared_first_layers(kv)
        # trusted only as stated: the first n_layer layers of a deeper (or as deep) model
        self.source_layers = declared[1] if declared is not None and declared[0] == n_layer \
            else None
        # the model it was cut from (None: not said): ``source_layers`` holds beside it only
        self.source_fingerprint = kv.get(SOURCE_FINGERPRINT_KEY)
        self.n_layer = n_layer
        cparams = low.llama_context_default_params()
        cparams.n_ctx = n_ctx
        cparams.n_batch = n_batch
        # (a smaller ubatch keeps its logits buffer small: it decodes a token at a time)
        cparams.n_ubatch = min(n_ubatch or n_batch, n_batch)
        cparams.n_threads = cparams.n_threads_batch = n_threads
        # as llama-cpp-python makes contexts (the model's own among them)
        cparams.flash_attn_type = low.LLAMA_FLASH_ATTN_TYPE_DISABLED
        lib = libllama()
        if capture:
            self.capture = lib.forecache_capture_init(CAPTURED, n_layer, self.n_embd)
            # the callback is C code in libllama: ctypes only hands its address over
            self._cb = ctypes.cast(ctypes.cast(lib.forecache_capture_eval, ctypes.c_void_p),
                                   low.ggml_backend_sched_eval_callback)
            cparams.cb_eval = self._cb
            cparams.cb_eval_user_data = self.capture
        with load_log(True):
            self.ctx = low.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            self.close()
            raise ValueError("llama.cpp cannot make a context for it")
        self.n_batch = n_batch
        self.batch = low.llama_batch_init(n_batch, 0, 1)
        self.vocab = low.llama_model_get_vocab(self.model)
        self._n_vocab = int(low.llama_vocab_n_tokens(self.vocab))
        self.tokens: list[int] = []  # what the KV cache holds
        self._row = np.zeros(self.n_embd, dtype=np.float32)

    def n_vocab(self) -> int:
        return self._n_vocab

    def sync(self, history: Sequence[int]) -> None:
        """Make the KV cache hold ``history`` (keeping the common prefix, at least its last
        token computed again so that the logits and captures are its)."""
        low = self.low
        common = 0
        for a, b in zip(self.tokens, history, strict=False):
            if a != b:
                break
            common += 1
        common = min(common, len(history) - 1)
        low.llama_memory_seq_rm(low.llama_get_memory(self.ctx), -1, common, -1)
        del self.tokens[common:]
        rest = list(history[common:])
        for i in range(0, len(rest), self.n_batch):
            self._decode(rest[i:i + self.n_batch])

    def step(self, token: int) -> None:
        """Decode one more token."""
        self._decode([token])

    def _decode(self, tokens: list[int]) -> None:
        fill_batch(self.batch, tokens, len(self.tokens), every_logit=False)
        rc = self.low.llama_decode(self.ctx, self.batch)
        if rc != 0:
            raise RuntimeError(f"the draft's llama_decode failed ({rc})")
        self.tokens.extend(tokens)

    def logits(self) -> np.ndarray:
        """The logits after the last token decoded."""
        ptr = self.low.llama_get_logits_ith(self.ctx, -1)
        return np.ctypeslib.as_array(ptr, shape=(self._n_vocab,))

    def state(self, layer: int) -> np.ndarray | None:
        """The last FFN input captured at ``layer`` (None without a capture)."""
        if self.capture is None:
            return None
        out = self._row.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
        n = libllama().forecache_capture_get(self.capture, layer, out)
        return self._row.copy() if n > 0 else None

    def close(self) -> None:
        low = self.low
        if self.batch is not None:
            low.llama_batch_free(self.batch)
            self.batch = None
        if self.ctx:
            low.llama_free(self.ctx)
            self.ctx = None
        if self.model:
            low.llama_model_free(self.model)
            self.model = None
        if self.capture:
            libllama().forecache_capture_free(self.capture)
            self.capture = None


class CrossModelPredictor:
    """The target's routers applied to a draft's per-layer states (SP-MoE): for each routed layer
    of the target a draft layer (``source``), and the target's top-k there.

    A draft trained apart is read at the same relative depth. A draft that is the target's own
    first ``draft_layers`` layers (``source_layers``, the block count it was cut from, equal to
    the target's) is read layer for layer: target layer ``il`` from draft layer ``il`` below
    ``draft_layers`` (the same computation: the router's own input), and from the draft's last
    layer beyond it (a skip prediction: that state through the deeper layer's router).
    ``DraftContext.source_layers`` says which a draft is."""

    def __init__(self, target: ModelFile, moe_layers: Sequence[int], n_layer: int, n_used: int,
                 draft_layers: int, *, source_layers: int | None = None) -> None:
        from forecache.gguf.tensors import tensor_array

        self.gates: dict[int, np.ndarray] = {}
        for il in moe_layers:
            a = tensor_array(target, f"blk.{il}.ffn_gate_inp.weight")
            if a is not None:
                self.gates[il] = a
        self.n_used = n_used
        #: the draft is the target's own first layers (and not some other model's)
        self.own_layers = source_layers == n_layer and 0 < draft_layers <= n_layer
        if self.own_layers:
            # target layer -> the draft's same layer, or its last for the layers it lacks
            self.source = {il: min(il, draft_layers - 1) for il in self.gates}
        else:
            # target layer -> draft layer at the same relative depth
            self.source = {il: min(round(il * draft_layers / n_layer), draft_layers - 1)
                           for il in self.gates}

    @property
    def layers(self) -> list[int]:
        """The target's routed layers, in order."""
        return sorted(self.gates)

    def width(self) -> int:
        g = next(iter(self.gates.values()), None)
        return 0 if g is None else int(g.shape[1])

    def predict(self, layer: int, state: np.ndarray) -> list[int]:
        """The target's top-k experts at ``layer`` for a draft state, best first."""
        scores = self.gates[layer] @ state
        top = np.argpartition(-scores, self.n_used - 1)[:self.n_used]
        return [int(e) for e in top[np.argsort(-scores[top], kind="stable")]]


def vocab_mismatch(target: Any, draft: Any) -> str | None:
    """Why ``draft``'s vocabulary (anything with ``n_vocab()`` and a llama_model ``model``) is
    not ``target``'s, or None when it is the same."""
    low = llama_cpp_module()
    n, m = target.n_vocab(), draft.n_vocab()
    if n != m:
        return f"{m} tokens against {n}"
    va, vb = low.llama_model_get_vocab(target.model), low.llama_model_get_vocab(draft.model)
    for i in range(n):
        a, b = low.llama_vocab_get_text(va, i), low.llama_vocab_get_text(vb, i)
        if a != b:
            return f"token {i} is {b!r}, not {a!r}"
    return None

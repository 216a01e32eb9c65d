"""The shipped reference model: llama.cpp reproduces the training framework's logits and the
recorded validation loss, and it is the default model."""

from __future__ import annotations

import json

import numpy as np
import pytest

from forecache.models.default import REFERENCE_MODEL, ensure_default_model

META = REFERENCE_MODEL.with_name("forecache-ref.json")
VALID = REFERENCE_MODEL.with_name("forecache-ref-valid.txt")


@pytest.fixture(scope="module")
def meta() -> dict:
    return json.loads(META.read_text())


def _logits(ids: list[int]) -> np.ndarray:
    from llama_cpp import Llama

    llm = Llama(model_path=str(REFERENCE_MODEL), n_ctx=max(512, len(ids) + 8), n_batch=512,
                logits_all=True, verbose=False)
    try:
        llm.eval(ids)
        return np.array(llm.scores[:len(ids)], dtype=np.float64)
    finally:
        llm.close()


def test_shipped_and_default() -> None:
    from forecache.gguf.header import require_moe

    assert REFERENCE_MODEL.stat().st_size <= 30 * 2**20
    mf = require_moe(REFERENCE_MODEL)
    assert (mf.arch, mf.n_layer, mf.n_expert, mf.n_expert_used) == ("qwen2moe", 8, 32, 4)
    assert ensure_default_model() == REFERENCE_MODEL


def test_logits_match_the_training_framework(meta: dict) -> None:
    """llama.cpp on the q8_0 file against PyTorch's logits recorded at export (f32 weights)."""
    from llama_cpp import Llama

    llm = Llama(model_path=str(REFERENCE_MODEL), vocab_only=True, verbose=False)
    try:
        ids = llm.tokenize(meta["prompt"].encode(), add_bos=False, special=True)
    finally:
        llm.close()
    assert ids == meta["prompt_ids"]  # llama.cpp tokenizes as training did
    got = _logits(ids)[-1]
    ref = np.array(meta["reference_last_logits"])
    assert meta["max_abs_logit_diff_f16"] < 1e-2  # measured at export on the f16 file
    # the kernels differ by CPU: AMX's int8 tiles came out at 1.55x the export machine's
    assert np.abs(got - ref).max() <= 2.0 * meta["max_abs_logit_diff_q8_0"] + 1e-3
    assert int(got.argmax()) == int(ref.argmax())


def test_validation_loss_is_remeasured(meta: dict) -> None:
    """The recorded validation loss, re-measured by llama.cpp on the shipped held-out slice."""
    from llama_cpp import Llama

    text = VALID.read_text(encoding="utf-8")
    llm = Llama(model_path=str(REFERENCE_MODEL), vocab_only=True, verbose=False)
    try:
        ids = llm.tokenize(text.encode(), add_bos=False, special=True)
    finally:
        llm.close()
    assert len(ids) == meta["valid_tokens"]
    w = meta["valid_window"]
    losses = []
    for i in range(0, len(ids), w):
        win = ids[i:i + w]
        if len(win) < 2:
            continue
        lg = _logits(win)[:-1]
        lse = np.log(np.exp(lg - lg.max(1, keepdims=True)).sum(1)) + lg.max(1)
        losses.append(float(np.mean(lse - lg[np.arange(len(win) - 1), win[1:]])))
    loss = float(np.mean(losses))
    assert abs(loss - meta["valid_loss_llama_q8_0"]) < 2e-3
    assert abs(loss - meta["valid_loss_torch"]) < 0.02  # q8_0 costs almost nothing

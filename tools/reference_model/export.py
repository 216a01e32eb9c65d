"""Export a trained reference model to GGUF and check llama.cpp against PyTorch.

    python tools/reference_model/export.py --run RUN_DIR --out-dir forecache/data/models

Writes forecache-ref-f16.gguf (to RUN_DIR, for the parity check) and forecache-ref-q8_0.gguf
(to --out-dir, the shipped model), plus forecache-ref.json beside it: the configuration, the
fixed prompt with PyTorch's logits for its last token, the validation loss measured by PyTorch
and by llama.cpp on forecache-ref-valid.txt (a slice of the held-out split, shipped so the
figure can be re-measured), and the measured logit differences. Needs torch, tokenizers and
forecache's environment (the patched llama-cpp-python, gguf).

A dense draft's run (train.py --dense) is written as forecache-ref-draft-q8_0.gguf and
forecache-ref-draft.json instead: llama.cpp's qwen2, with every tokenizer key copied from
--reference so that its vocabulary is exactly the reference model's, measured on the shipped
forecache-ref-valid.txt (which the run's corpus must reproduce).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from model import DenseConfig, Qwen2Moe, config_from_dict, gguf_tensors  # noqa: E402
from tokenizer import SPECIAL_TOKENS, vocab_lists  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

if TYPE_CHECKING:
    from gguf import GGUFWriter

PROMPT = "In the beginning God created the heaven and the earth. And the earth was"
VALID_BYTES = 24_000
NAME = "forecache-ref"
DRAFT_NAME = "forecache-ref-draft"
REFERENCE = Path(__file__).resolve().parents[2] / "forecache/data/models/forecache-ref-q8_0.gguf"


def add_dense_hparams(w: GGUFWriter, c: DenseConfig, qtype: str) -> None:
    """The qwen2 hyperparameter keys, as the HF converter writes them for Qwen2."""
    from gguf import GGML_QUANT_VERSION

    from forecache.gguf.qtypes import QTYPES

    w.add_block_count(c.layers)
    w.add_context_length(c.context_length)
    w.add_embedding_length(c.d_model)
    w.add_feed_forward_length(c.ff)
    w.add_head_count(c.heads)
    w.add_head_count_kv(c.kv_heads)
    w.add_rope_freq_base(c.rope_theta)
    w.add_layer_norm_rms_eps(c.rms_eps)
    w.add_file_type(int(QTYPES[qtype][1]))
    w.add_quantization_version(GGML_QUANT_VERSION)


def copy_tokenizer(w: GGUFWriter, reference: Path) -> None:
    """Every `tokenizer.*` key of ``reference`` unchanged (tokens, types, merges, special ids,
    pre-tokenizer, chat template), so llama.cpp tokenizes for the draft as for the model."""
    from gguf import GGUFReader, GGUFValueType

    for name, f in GGUFReader(reference).fields.items():
        if name.startswith("tokenizer."):
            vtype = GGUFValueType(f.types[0])
            sub = GGUFValueType(f.types[-1]) if vtype == GGUFValueType.ARRAY else None
            w.add_key_value(name, f.contents(), vtype, sub_type=sub)


def write_gguf(model: Qwen2Moe, tok: Tokenizer, path: Path, qtype: str, valid_loss: float,
               reference: Path = REFERENCE) -> None:
    """Write the model as llama.cpp's qwen2moe with the trained tokenizer and ChatML, or the
    dense draft as qwen2 with ``reference``'s tokenizer keys."""
    from gguf import GGUFWriter, TokenType

    from forecache.gguf.maker import add_hparams
    from forecache.gguf.specs import get_spec
    from forecache.gguf.vocab import Vocab

    if isinstance(model.c, DenseConfig):
        w = GGUFWriter(str(path) + ".tmp", "qwen2")
        w.add_type("model")
        w.add_name(DRAFT_NAME)
        w.add_description(f"a dense draft model for {NAME} (its width, depth and vocabulary), "
                          "trained on its corpus (tools/reference_model)")
        w.add_float32("forecache.valid_loss", float(valid_loss))
        add_dense_hparams(w, model.c, qtype)
        copy_tokenizer(w, reference)
        write_tensors(w, model, path, qtype)
        return
    spec = get_spec("reference")
    mismatch = {k: (v, getattr(spec, k)) for k, v in model.c.to_dict().items()
                if k != "vocab" and getattr(spec, k) != v}
    if mismatch or spec.vocab != model.c.vocab:
        raise SystemExit(f"the checkpoint's shape differs from models.yaml's reference preset: "
                         f"{mismatch or 'vocab'}")
    tokens, merges = vocab_lists(tok)
    special = {s: tok.token_to_id(s) for s in SPECIAL_TOKENS}
    types = [int(TokenType.CONTROL) if t in special else int(TokenType.NORMAL) for t in tokens]
    vocab = Vocab(tokens=tokens, token_types=types, merges=merges,
                  bos_id=special["<|endoftext|>"], eos_id=special["<|endoftext|>"],
                  eot_id=special["<|im_end|>"], pad_id=special["<|endoftext|>"])
    w = GGUFWriter(str(path) + ".tmp", "qwen2moe")
    w.add_type("model")
    w.add_name(NAME)
    w.add_description("forecache's reference MoE, trained on public-domain and PSF-licensed "
                      "text and code (tools/reference_model)")
    w.add_float32("forecache.valid_loss", float(valid_loss))
    add_hparams(w, spec, qtype)
    vocab.write_to(w)
    write_tensors(w, model, path, qtype)


def write_tensors(w: GGUFWriter, model: Qwen2Moe, path: Path, qtype: str) -> None:
    """Add the weights to ``w`` (holding the metadata), write it and move it to ``path``."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    for name, t in gguf_tensors(model).items():
        a = t.detach().float().numpy()
        small = a.ndim == 1 or name.endswith("ffn_gate_inp.weight")  # norms, biases, routers
        if small:
            w.add_tensor(name, a.astype(np.float32))
        elif qtype == "f16":
            w.add_tensor(name, a.astype(np.float16))
        else:
            q = quantize(a, GGMLQuantizationType.Q8_0)
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(str(path) + ".tmp", path)


@torch.no_grad()
def torch_logits(model: Qwen2Moe, ids: list[int]) -> np.ndarray:
    logits, _, _ = model(torch.tensor([ids]))
    return logits[0].numpy()


def llama_logits(path: Path, ids: list[int]) -> np.ndarray:
    """llama.cpp's logits for every position of ``ids``."""
    from llama_cpp import Llama

    llm = Llama(model_path=str(path), n_ctx=max(512, len(ids) + 8), n_batch=512,
                logits_all=True, verbose=False, n_threads=os.cpu_count() or 1)
    try:
        llm.eval(ids)
        return np.array(llm.scores[:len(ids)], dtype=np.float32)
    finally:
        llm.close()


def nll(logits: np.ndarray, ids: list[int]) -> float:
    """Mean next-token negative log-likelihood of ids[1:]."""
    lg = logits[:-1].astype(np.float64)
    lse = np.log(np.exp(lg - lg.max(1, keepdims=True)).sum(1)) + lg.max(1)
    return float(np.mean(lse - lg[np.arange(len(ids) - 1), ids[1:]]))


def llama_tokenize(path: Path, text: str) -> list[int]:
    from llama_cpp import Llama

    llm = Llama(model_path=str(path), vocab_only=True, verbose=False)
    try:
        return llm.tokenize(text.encode(), add_bos=False, special=True)
    finally:
        llm.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", type=Path, required=True)
    ap.add_argument("--corpus", type=Path, required=True, help="for the validation slice")
    ap.add_argument("--out-dir", type=Path, required=True)
    ap.add_argument("--reference", type=Path, default=REFERENCE,
                    help="a dense draft's tokenizer keys come from this GGUF")
    args = ap.parse_args()
    ck = torch.load(args.run / "checkpoint.pt", weights_only=False)
    cfg = config_from_dict(ck["config"])
    dense = isinstance(cfg, DenseConfig)
    name = DRAFT_NAME if dense else NAME
    model = Qwen2Moe(cfg)
    model.load_state_dict(ck["model"])
    model.eval()
    tok = Tokenizer.from_file(str(args.run / "tokenizer.json"))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    f16 = args.run / f"{name}-f16.gguf"
    q8 = args.out_dir / f"{name}-q8_0.gguf"
    write_gguf(model, tok, f16, "f16", ck.get("valid_loss") or 0.0, args.reference)

    # the same tokens in both frameworks
    valid_text = (args.corpus / "valid.txt").read_text(encoding="utf-8")[:VALID_BYTES]
    valid_text = valid_text[:valid_text.rfind("\n") + 1]
    shipped = args.out_dir / f"{NAME}-valid.txt"
    if dense and shipped.read_text(encoding="utf-8") != valid_text:
        raise SystemExit(f"{args.corpus} is not the reference model's corpus: its validation "
                         f"slice differs from {shipped}")
    for text in (PROMPT, valid_text):
        ours, theirs = tok.encode(text, add_special_tokens=False).ids, llama_tokenize(f16, text)
        if ours != theirs:
            first = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False))
                          if a != b), min(len(ours), len(theirs)))
            raise SystemExit(f"tokenizers disagree on {text[:40]!r}: first difference at "
                             f"token {first}")
    ids = tok.encode(PROMPT, add_special_tokens=False).ids
    ref = torch_logits(model, ids)
    # PyTorch with the f16-rounded weights against llama.cpp's f16 file
    half = Qwen2Moe(cfg)
    half.load_state_dict({k: v.half().float() for k, v in ck["model"].items()})
    half.eval()
    diff_f16 = float(np.abs(torch_logits(half, ids) - llama_logits(f16, ids)).max())
    print(f"[export] f16: max |logit diff| vs PyTorch = {diff_f16:.5f}", file=sys.stderr)

    valid_loss_torch = None
    vids = tok.encode(valid_text, add_special_tokens=False).ids
    with torch.no_grad():
        logits = torch.cat([model(torch.tensor([vids[i:i + 512]]))[0][0]
                            for i in range(0, len(vids), 512)])
    # windows of 512 restart the context, as the llama.cpp measurement below does
    valid_loss_torch = float(np.mean([nll(logits[i:i + 512].numpy(), vids[i:i + 512])
                                      for i in range(0, len(vids), 512)
                                      if len(vids[i:i + 512]) > 1]))
    write_gguf(model, tok, q8, "q8_0", valid_loss_torch, args.reference)
    got = llama_logits(q8, ids)
    diff_q8 = float(np.abs(got[-1] - ref[-1]).max())
    vl_llama = float(np.mean([nll(llama_logits(q8, vids[i:i + 512]), vids[i:i + 512])
                              for i in range(0, len(vids), 512) if len(vids[i:i + 512]) > 1]))
    if not dense:
        shipped.write_text(valid_text, encoding="utf-8")
    meta = {
        "config": cfg.to_dict(), "prompt": PROMPT, "prompt_ids": ids,
        "reference_last_logits": [round(float(v), 5) for v in ref[-1]],
        "max_abs_logit_diff_f16": diff_f16, "max_abs_logit_diff_q8_0": diff_q8,
        "valid_loss_torch": valid_loss_torch, "valid_loss_llama_q8_0": vl_llama,
        "valid_tokens": len(vids), "valid_window": 512,
        "train_steps": ck["state"]["step"], "train_tokens": ck["state"]["tokens"],
        "train_minutes": round(ck["state"]["elapsed_s"] / 60, 1),
        "checkpoint_valid_loss": ck.get("valid_loss"),
        "q8_0_bytes": q8.stat().st_size,
    }
    if dense:
        # the corpus files' hashes show the split is the reference's (README: Measured sizes)
        meta |= {"architecture": "qwen2", "reference": args.reference.name,
                 "corpus_sha256": {f: hashlib.sha256((args.corpus / f).read_bytes()).hexdigest()
                                   for f in ("train.txt", "valid.txt")}}
    (args.out_dir / f"{name}.json").write_text(json.dumps(meta, indent=1))
    print(json.dumps({k: v for k, v in meta.items() if k not in ("reference_last_logits",
                                                                 "prompt_ids")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

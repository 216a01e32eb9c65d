"""Export a trained reference model to GGUF and check llama.cpp against PyTorch.

    python tools/reference_model/export.py --run RUN_DIR --out-dir forecache/data/models

Writes forecache-ref-f16.gguf (to RUN_DIR, for the parity check) and forecache-ref-q8_0.gguf
(to --out-dir, the shipped model), plus forecache-ref.json beside it: the configuration, the
fixed prompt with PyTorch's logits for its last token, the validation loss measured by PyTorch
and by llama.cpp on forecache-ref-valid.txt (a slice of the held-out split, shipped so the
figure can be re-measured), and the measured logit differences. Needs torch, tokenizers and
forecache's environment (the patched llama-cpp-python, gguf).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from model import Config, Qwen2Moe, gguf_tensors  # noqa: E402
from tokenizer import SPECIAL_TOKENS, vocab_lists  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

PROMPT = "In the beginning God created the heaven and the earth. And the earth was"
VALID_BYTES = 24_000
NAME = "forecache-ref"


def write_gguf(model: Qwen2Moe, tok: Tokenizer, path: Path, qtype: str, valid_loss: float
               ) -> None:
    """Write the model as llama.cpp's qwen2moe with the trained tokenizer and ChatML."""
    from gguf import GGMLQuantizationType, GGUFWriter, TokenType
    from gguf.quants import quantize

    from forecache.gguf.maker import add_hparams
    from forecache.gguf.specs import get_spec
    from forecache.gguf.vocab import Vocab

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
    args = ap.parse_args()
    ck = torch.load(args.run / "checkpoint.pt", weights_only=False)
    cfg = Config(**ck["config"])
    model = Qwen2Moe(cfg)
    model.load_state_dict(ck["model"])
    model.eval()
    tok = Tokenizer.from_file(str(args.run / "tokenizer.json"))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    f16 = args.run / f"{NAME}-f16.gguf"
    q8 = args.out_dir / f"{NAME}-q8_0.gguf"
    write_gguf(model, tok, f16, "f16", ck.get("valid_loss") or 0.0)

    # the same tokens in both frameworks
    valid_text = (args.corpus / "valid.txt").read_text(encoding="utf-8")[:VALID_BYTES]
    valid_text = valid_text[:valid_text.rfind("\n") + 1]
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
    write_gguf(model, tok, q8, "q8_0", valid_loss_torch)
    got = llama_logits(q8, ids)
    diff_q8 = float(np.abs(got[-1] - ref[-1]).max())
    vl_llama = float(np.mean([nll(llama_logits(q8, vids[i:i + 512]), vids[i:i + 512])
                              for i in range(0, len(vids), 512) if len(vids[i:i + 512]) > 1]))
    (args.out_dir / f"{NAME}-valid.txt").write_text(valid_text, encoding="utf-8")
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
    (args.out_dir / f"{NAME}.json").write_text(json.dumps(meta, indent=1))
    print(json.dumps({k: v for k, v in meta.items() if k not in ("reference_last_logits",
                                                                 "prompt_ids")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

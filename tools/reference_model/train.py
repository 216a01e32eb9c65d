"""Train the reference model: tokenizer, tokenized corpus, then a time-budgeted training run.

    python tools/reference_model/train.py --corpus CORPUS_DIR --out RUN_DIR [--minutes 75]
    python tools/reference_model/train.py --corpus CORPUS_DIR --out RUN_DIR --minutes 15 \
        --dense 512 --tokenizer-from forecache/data/models/forecache-ref-q8_0.gguf   # the draft

CORPUS_DIR comes from corpus.py (train.txt / valid.txt, documents separated by `<|endoftext|>`
lines). RUN_DIR receives tokenizer.json, train.bin / valid.bin (uint16 token ids), checkpoint.pt
(written atomically every few minutes and at the end; a rerun resumes from it) and log.jsonl.
The learning rate follows warm-up then cosine decay over the time budget, so a run of a given
length is reproducible in shape if not to the step. Needs torch and tokenizers
(`pip install torch tokenizers`, and gguf for --tokenizer-from); nothing else in forecache does.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from model import Config, DenseConfig, Qwen2Moe  # noqa: E402
from tokenizer import SPECIAL_TOKENS, tokenizer_from_gguf, train_tokenizer  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

EOT = "<|endoftext|>"
CHAT_EVERY = 8  # one document in eight becomes a chat exchange
AUX_COEF = 0.01  # load-balancing loss weight (Qwen2-MoE's router_aux_loss_coef is 0.001-0.01)


def log(msg: str) -> None:
    print(f"[train] {msg}", file=sys.stderr, flush=True)


def documents(path: Path) -> list[str]:
    """The corpus file's documents (split at `<|endoftext|>` lines)."""
    text = path.read_text(encoding="utf-8")
    return [d.strip("\n") for d in text.split(f"\n{EOT}\n") if d.strip()]


def chat_example(doc: str) -> str:
    """A document as one ChatML exchange: the user gives its opening and asks for more, the
    assistant continues it and ends its turn. Teaches the format `forecache run` uses."""
    cut = doc.find("\n", 120)
    cut = cut if 0 < cut < 400 else min(len(doc) // 3, 300)
    head, rest = doc[:cut].strip(), doc[cut:cut + 900].strip()
    return (f"<|im_start|>user\nContinue this text:\n{head}<|im_end|>\n"
            f"<|im_start|>assistant\n{rest}<|im_end|>")


def tokenize_corpus(corpus: Path, out: Path, vocab: int, from_gguf: Path | None = None
                    ) -> Tokenizer:
    """Train (or reuse, or take from the GGUF ``from_gguf``) the tokenizer and write
    train.bin / valid.bin."""
    tok_path = out / "tokenizer.json"
    if tok_path.is_file():
        tok = Tokenizer.from_file(str(tok_path))
    elif from_gguf is not None:
        tok = tokenizer_from_gguf(from_gguf)
        tok.save(str(tok_path))
        log(f"tokenizer: {tok.get_vocab_size()} tokens from {from_gguf}")
    else:
        t0 = time.time()
        tok = train_tokenizer(documents(corpus / "train.txt"), vocab)
        tok.save(str(tok_path))
        log(f"tokenizer: {tok.get_vocab_size()} tokens in {time.time() - t0:.0f} s")
    eot = tok.token_to_id(EOT)
    for split in ("train", "valid"):
        dest = out / f"{split}.bin"
        if dest.is_file():
            continue
        docs = documents(corpus / f"{split}.txt")
        docs = [chat_example(d) if i % CHAT_EVERY == 0 else d for i, d in enumerate(docs)]
        ids: list[int] = []
        for enc in tok.encode_batch(docs, add_special_tokens=False):
            ids.extend(enc.ids)
            ids.append(eot)
        arr = np.asarray(ids, dtype=np.uint16)
        tmp = dest.with_suffix(".tmp")
        arr.tofile(tmp)
        os.replace(tmp, dest)
        log(f"{split}: {len(docs)} documents, {len(arr)} tokens")
    return tok


def lr_at(frac: float, peak: float, warm: float = 0.02) -> float:
    if frac < warm:
        return peak * frac / warm
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, (frac - warm) / (1 - warm)))))


@torch.no_grad()
def evaluate(model: Qwen2Moe, data: np.ndarray, seq: int, n: int = 48) -> float:
    """Mean next-token loss over ``n`` fixed windows of ``data`` (the same windows every time)."""
    model.eval()
    starts = np.linspace(0, len(data) - seq - 2, n).astype(np.int64)
    x = torch.from_numpy(np.stack([data[s:s + seq + 1] for s in starts]).astype(np.int64))
    losses = []
    for i in range(0, n, 16):
        logits, _, _ = model(x[i:i + 16, :-1])
        losses.append(F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                      x[i:i + 16, 1:].reshape(-1), reduction="sum").item())
    model.train()
    return sum(losses) / (n * seq)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--minutes", type=float, default=75.0, help="training time budget")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--dense", type=int, default=0, metavar="FF",
                    help="train the dense draft (llama.cpp's qwen2, tied embeddings) with this "
                         "feed-forward width instead of the MoE")
    ap.add_argument("--tokenizer-from", type=Path, default=None, metavar="GGUF",
                    help="use this GGUF's vocabulary instead of training one (the draft must "
                         "have exactly the reference model's)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    cfg = DenseConfig.like(Config(), args.dense) if args.dense else Config()
    tok = tokenize_corpus(args.corpus, args.out, cfg.vocab, args.tokenizer_from)
    assert tok.get_vocab_size() == cfg.vocab, tok.get_vocab_size()
    assert all(tok.token_to_id(s) is not None for s in SPECIAL_TOKENS)
    train = np.fromfile(args.out / "train.bin", dtype=np.uint16)
    valid = np.fromfile(args.out / "valid.bin", dtype=np.uint16)
    model = Qwen2Moe(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    ckpt_path = args.out / "checkpoint.pt"
    state = {"step": 0, "elapsed_s": 0.0, "tokens": 0}
    if ckpt_path.is_file():
        ck = torch.load(ckpt_path, weights_only=False)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        state = ck["state"]
        log(f"resumed at step {state['step']} ({state['elapsed_s'] / 60:.1f} min)")
    budget = args.minutes * 60
    rng = np.random.default_rng(args.seed + state["step"])
    n_params = sum(p.numel() for p in model.parameters())
    log(f"{n_params / 1e6:.1f}M parameters, {len(train)} train tokens, budget {args.minutes} min")

    def save(valid_loss: float | None) -> None:
        tmp = ckpt_path.with_suffix(".tmp")
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "state": state,
                    "config": cfg.to_dict(), "valid_loss": valid_loss}, tmp)
        os.replace(tmp, ckpt_path)

    logf = open(args.out / "log.jsonl", "a")  # noqa: SIM115
    t_last = time.time()
    last_save = time.time()
    while state["elapsed_s"] < budget:
        for g in opt.param_groups:
            g["lr"] = lr_at(state["elapsed_s"] / budget, args.lr)
        starts = rng.integers(0, len(train) - args.seq - 1, args.batch)
        x = torch.from_numpy(np.stack([train[s:s + args.seq + 1] for s in starts]).astype(np.int64))
        logits, _, aux = model(x[:, :-1])
        ce = F.cross_entropy(logits.reshape(-1, cfg.vocab), x[:, 1:].reshape(-1))
        loss = ce + AUX_COEF * aux
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        now = time.time()
        state["elapsed_s"] += now - t_last
        t_last = now
        state["step"] += 1
        state["tokens"] += args.batch * args.seq
        if state["step"] % 25 == 0:
            rec = {"step": state["step"], "min": round(state["elapsed_s"] / 60, 2),
                   "loss": round(ce.item(), 4), "aux": round(aux.item(), 4),
                   "lr": opt.param_groups[0]["lr"], "tokens": state["tokens"]}
            logf.write(json.dumps(rec) + "\n")
            logf.flush()
            log(json.dumps(rec))
        if now - last_save > 300:
            vl = evaluate(model, valid, args.seq)
            log(f"step {state['step']}: valid loss {vl:.4f}")
            logf.write(json.dumps({"step": state["step"], "valid_loss": vl}) + "\n")
            save(vl)
            last_save = time.time()
            t_last = time.time()  # evaluation time is not training time
    vl = evaluate(model, valid, args.seq)
    save(vl)
    logf.write(json.dumps({"step": state["step"], "valid_loss": vl, "final": True}) + "\n")
    logf.close()
    log(f"done: {state['step']} steps, {state['tokens']} tokens, valid loss {vl:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A byte-level BPE vocabulary trained on the corpus, laid out as Qwen2's and split like Qwen2's.

The pre-tokenizer is Qwen2's regex followed by the GPT-2 byte mapping, the split llama.cpp applies
for `tokenizer.ggml.pre = qwen2`, so llama.cpp tokenizes text exactly as training did (checked
by export.py). The special tokens <|endoftext|>, <|im_start|> and <|im_end|> follow the merges.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

# Qwen2's pre-tokenizer pattern (llama.cpp's LLAMA_VOCAB_PRE_TYPE_QWEN2).
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def _pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


def train_tokenizer(docs: Iterable[str], vocab_size: int) -> Tokenizer:
    """Train the BPE on ``docs``; ``vocab_size`` counts the special tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = _pre_tokenizer()
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(SPECIAL_TOKENS), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tok.train_from_iterator(docs, trainer)
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return tok


def vocab_lists(tok: Tokenizer) -> tuple[list[str], list[str]]:
    """Tokens in id order and merges in rank order, for the GGUF tokenizer keys."""
    data = json.loads(tok.to_str())
    vocab: dict[str, int] = data["model"]["vocab"]
    tokens = [""] * (len(vocab) + len(SPECIAL_TOKENS))
    for t, i in vocab.items():
        tokens[i] = t
    for t in data["added_tokens"]:
        tokens[t["id"]] = t["content"]
    if any(not t for t in tokens):
        raise ValueError("token ids are not contiguous")
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    return tokens, merges


def tokenizer_from_gguf(path: Path) -> Tokenizer:
    """The tokenizer stored in a GGUF written by export.py (its tokens and merges), so a model
    trained later (the draft) gets exactly the shipped model's vocabulary and ids even where
    retraining the BPE on a changed corpus or `tokenizers` version would not."""
    from gguf import GGUFReader

    fields = GGUFReader(path).fields
    tokens: list[str] = fields["tokenizer.ggml.tokens"].contents()
    merges = [tuple(m.split(" ")) for m in fields["tokenizer.ggml.merges"].contents()]
    n = len(tokens) - len(SPECIAL_TOKENS)
    if tuple(tokens[n:]) != SPECIAL_TOKENS:
        raise ValueError(f"{path}: the special tokens are not the last {len(SPECIAL_TOKENS)}")
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens[:n])}, merges=merges))
    tok.pre_tokenizer = _pre_tokenizer()
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    if vocab_lists(tok) != (tokens, [" ".join(m) for m in merges]):
        raise ValueError(f"{path}: the rebuilt tokenizer's vocabulary differs from the file's")
    return tok

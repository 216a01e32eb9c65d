"""A deterministic byte-level BPE tokenizer and ChatML template for generated GGUF models.

The vocabulary has the layout of Qwen2's: 256 byte tokens (GPT-2 byte-to-unicode mapping),
merged tokens in merge-rank order, the special tokens <|endoftext|>, <|im_start|> and
<|im_end|>, then unused padding up to the embedding size. Merged tokens are built from
English words, suffixes and syllable-based pseudo-words, each merge joining two existing
tokens, so every token decodes to plain ASCII text and any text round-trips through the
byte tokens.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass

from gguf import GGUFWriter, TokenType

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

#: Qwen2-Instruct's ChatML template, with its default system prompt.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Common English words, most frequent first; they and their space-prefixed and capitalized
# forms become whole-word tokens early in the merge order.
_WORDS = """
the of and to in is that for it as was with be by on not he this are or his from at which
but have an they you were her she there one all we their has been would if will more when
who can what so no said about up out some time them into than its only other new then do
also any these two may first could like my over world people such most hello after our
years way many where work very make just know well good back much year before through
because should even state those each used use part made between day how great system own
last long under while little being both found still same see life never here another
might take three right against now high school number old again place small few around
during name without however down think house give every next order point line come public
set less end group often help program world water often important home form children
family report service per until power different general every case small large week
question night though company government thing city world local change within come course
head book hand country problem power real whole person point second money market look
information today example open policy system water story party health lead history word
fact area process level member business real side best need free early kind social turn
show start model data value text token expert cache memory layer table result test file
""".split()
_WORDS = list(dict.fromkeys(_WORDS))

_SUFFIXES = ("s", "ed", "ing", "er", "ly", "es", "tion", "ment", "ness", "able", "al", "est")

_PUNCT = (
    "ĠĠ", "ĊĊ", "ĠĠĠ", "ĠĠĠĠ", ".Ċ", ",Ċ", ".ĊĊ", "Ġ(", ").", "),", "Ġ\"", "\".", "\",",
    "...", "Ġ-", "--", "Ġ=", "Ġ{", "();", "Ġ[", "ĉĉ", "ĠĠĠĠĠĠĠĠ", "'s", "'t", "'re", "'ll",
    "Ġ*", "Ġ/", "://", "Ġ#", ":Ċ", "Ġ+", "Ġ<", "Ġ>", "Ġ&", "Ġ|", "Ġ:", "Ġ'", "Ġ$",
)

_ONSETS = (
    "", "b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w",
    "z", "br", "ch", "cl", "cr", "dr", "fl", "fr", "gr", "pl", "pr", "sh", "sl", "sp", "st",
    "str", "th", "tr",
)
_NUCLEI = ("a", "e", "i", "o", "u", "ai", "ea", "ee", "oo", "ou")
_CODAS = ("", "n", "r", "s", "t", "l", "m", "nd", "st", "ng", "ck")


@functools.cache
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode character mapping."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    # GPT-2 lists the printable bytes first; keep that order for the byte-token ids.
    return {b: mapping[b] for b in printable + [b for b in range(256) if b not in printable]}


@functools.cache
def _unicode_to_bytes() -> dict[str, int]:
    return {c: b for b, c in bytes_to_unicode().items()}


def decode_token(token: str) -> bytes:
    """Bytes a token stands for."""
    inverse = _unicode_to_bytes()
    return bytes(inverse[c] for c in token)


@dataclass(frozen=True)
class Vocab:
    """Token list, merges and special ids for the GGUF tokenizer.ggml.* keys."""

    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    bos_id: int
    eos_id: int
    eot_id: int
    pad_id: int
    chat_template: str = CHATML_TEMPLATE

    def write_to(self, writer: GGUFWriter) -> None:
        """Add the tokenizer keys to a GGUF writer, as Qwen2 chat GGUFs carry them."""
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("qwen2")
        writer.add_token_list(self.tokens)
        writer.add_token_types(self.token_types)
        writer.add_token_merges(self.merges)
        writer.add_bos_token_id(self.bos_id)
        writer.add_eos_token_id(self.eos_id)
        writer.add_eot_token_id(self.eot_id)
        writer.add_pad_token_id(self.pad_id)
        writer.add_add_bos_token(False)
        writer.add_chat_template(self.chat_template)


class _MergeBuilder:
    """Grows the vocabulary one merge at a time, up to `limit` tokens.

    A string becomes a token by running BPE on it with the merges so far and merging the
    pieces it stops at, left to right. Each new merge has the highest rank, so it only fires
    once BPE is otherwise stuck: every earlier token still encodes to itself, and so does the
    new one. Text made of whole tokens therefore tokenizes to them in llama.cpp.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.tokens = list(bytes_to_unicode().values())
        self.ids = {t: i for i, t in enumerate(self.tokens)}
        self.ranks: dict[tuple[str, str], int] = {}

    @property
    def full(self) -> bool:
        return len(self.tokens) >= self.limit

    @property
    def merges(self) -> list[str]:
        return [f"{a} {b}" for a, b in self.ranks]

    def encode(self, s: str) -> list[str]:
        """BPE as llama.cpp applies it: lowest-rank adjacent pair first, leftmost on ties."""
        parts = list(s)
        ranks = self.ranks
        while len(parts) > 1:
            best, best_rank = -1, len(ranks)
            for i in range(len(parts) - 1):
                rank = ranks.get((parts[i], parts[i + 1]), best_rank)
                if rank < best_rank:
                    best, best_rank = i, rank
            if best < 0:
                break
            parts[best : best + 2] = [parts[best] + parts[best + 1]]
        return parts

    def add(self, s: str) -> None:
        """Make `s` a token (and the prefixes needed to reach it), if there is room."""
        if s in self.ids:
            return
        parts = self.encode(s)
        left = parts[0]
        for right in parts[1:]:
            merged = left + right
            if merged not in self.ids:
                if self.full:
                    return
                self.ids[merged] = len(self.tokens)
                self.tokens.append(merged)
            self.ranks[(left, right)] = len(self.ranks)
            left = merged


def _syllables() -> list[str]:
    # Simple syllables first, so the small vocabularies get the most reusable pieces.
    sylls = [o + n + c for c in _CODAS for o in _ONSETS for n in _NUCLEI]
    return [s for s in sylls if len(s) >= 2]


def _candidates() -> Iterator[str]:
    """Token strings in merge-rank order (endless enough for any vocabulary size)."""
    for i, word in enumerate(_WORDS):
        yield "Ġ" + word
        yield word
        if i < len(_PUNCT):
            yield _PUNCT[i]
        if i < len(_SUFFIXES):
            yield _SUFFIXES[i]
    for word in _WORDS:
        yield "Ġ" + word.capitalize()
        yield word.capitalize()
    for suffix in _SUFFIXES:
        for word in _WORDS:
            stem = word[:-1] if word.endswith("e") and suffix[0] in "aeiou" else word
            yield "Ġ" + stem + suffix
    sylls = _syllables()
    for syl in sylls:
        yield "Ġ" + syl
        yield syl
    for syl in sylls:
        yield "Ġ" + syl.capitalize()
    # Two-syllable pseudo-words, visited in a fixed scrambled order (a stride coprime to n).
    n = len(sylls) ** 2
    stride = 1_000_003
    assert math.gcd(stride, n) == 1
    for k in range(n):
        j = (k * stride) % n
        word = sylls[j // len(sylls)] + sylls[j % len(sylls)]
        yield "Ġ" + word
        yield word
        if k % 4 == 0:
            yield "Ġ" + word.capitalize()


@functools.lru_cache(maxsize=4)
def make_vocab(vocab_size: int, text_tokens: int | None = None) -> Vocab:
    """Build the tokenizer for an embedding table of `vocab_size` rows (cached: read-only).

    `text_tokens` ordinary tokens (default: all but the special tokens) get ids
    0..text_tokens-1, the special tokens follow, and any ids left are UNUSED padding
    named "[PAD<id>]" as in converted Qwen GGUFs.
    """
    if text_tokens is None:
        text_tokens = vocab_size - len(SPECIAL_TOKENS)
    if not 256 < text_tokens <= vocab_size - len(SPECIAL_TOKENS):
        raise ValueError(
            f"text_tokens must be in 257..{vocab_size - len(SPECIAL_TOKENS)}, got {text_tokens}"
        )
    builder = _MergeBuilder(text_tokens)
    for candidate in _candidates():
        if builder.full:
            break
        builder.add(candidate)
    if not builder.full:
        raise ValueError(f"cannot generate {text_tokens} tokens")
    tokens = builder.tokens + list(SPECIAL_TOKENS)
    types = [TokenType.NORMAL] * text_tokens + [TokenType.CONTROL] * len(SPECIAL_TOKENS)
    tokens += [f"[PAD{i}]" for i in range(len(tokens), vocab_size)]
    types += [TokenType.UNUSED] * (vocab_size - len(types))
    endoftext, _, im_end = (text_tokens + i for i in range(len(SPECIAL_TOKENS)))
    return Vocab(
        tokens=tokens,
        token_types=[int(t) for t in types],
        merges=builder.merges,
        bos_id=endoftext,
        eos_id=im_end,
        eot_id=im_end,
        pad_id=endoftext,
    )

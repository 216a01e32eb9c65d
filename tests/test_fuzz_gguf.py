"""Damaged GGUFs end in success or one clear line, never a signal, a traceback or a hang: the
cases a fuzzing run found, then a fixed number of seeded mutations of the reference and tiny
models, through `forecache generate` and through forecache.Llama (benchmarks/fuzz_gguf.py runs
the long version)."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import fuzz_gguf as fz  # noqa: E402

KNOWN = [  # (key, GGUF type, value, words of the error)
    ("qwen2moe.block_count", fz.U32, 0, "block_count is 0"),
    ("qwen2moe.block_count", fz.U32, 1000, "outside 1..512"),
    ("qwen2moe.block_count", fz.U32, 2**32 - 1, "outside 1..512"),
    ("qwen2moe.expert_used_count", fz.U32, 0, "expert_used_count is 0"),
    ("qwen2moe.expert_used_count", fz.U32, 99, "expert_used_count is 99"),
    ("qwen2moe.expert_count", fz.STRING, "many", "not an integer"),
    ("qwen2moe.expert_count", fz.ARRAY, (fz.U32, [16, 16]), "not an integer"),
    ("qwen2moe.context_length", fz.U32, 2**31, "context_length is 2147483648"),
    ("qwen2moe.attention.layer_norm_rms_epsilon", fz.F32, float("nan"), "epsilon"),
    ("general.alignment", fz.U32, 1, "general.alignment is 1"),
    ("general.alignment", fz.F32, 0.5, "general.alignment is 0.5"),
    ("tokenizer.ggml.model", fz.STRING, "llama", "needs tokenizer.ggml.scores"),
    ("qwen2moe.rope.freq_base", fz.ARRAY, ("deep", 3000), "nests arrays"),
    ("tokenizer.chat_template", fz.STRING, "{% if %}", "not valid Jinja"),
]


# Cases through `forecache generate`, after the API's 160: a fixed count (not as many as fit in a
# time) so every machine runs the same cases of the seed; 50 took 35-38 s on the 2-core CI-class
# machine under load (a damaged file is refused in about 0.4 s, a loadable one generates in 2 s).
CLI_CASES = 50


def _with(base: bytes, key: str, vtype: int, value: object) -> bytes:
    g = fz.split(base)
    new = (key, vtype, fz.encode(vtype, value))
    g.kvs = [kv for kv in g.kvs if kv[0] != key] + [new]
    return fz.join(g)


@pytest.fixture(scope="module")
def bases() -> list[bytes]:
    return fz.sources()


def test_known_damage_is_one_line(bases: list[bytes], tmp_path: Path) -> None:
    paths = []
    for i, (key, vtype, value, _) in enumerate(KNOWN):
        path = tmp_path / f"known{i}.gguf"
        path.write_bytes(_with(bases[0], key, vtype, value))
        paths.append(path)
    g = fz.split(bases[0])  # a duplicated vocabulary token
    k = next(i for i, kv in enumerate(g.kvs) if kv[0] == "tokenizer.ggml.tokens")
    toks = fz._strings(g.kvs[k][2])
    toks[10] = toks[11]
    g.kvs[k] = (g.kvs[k][0], fz.ARRAY, fz.encode(fz.ARRAY, (fz.STRING, toks)))
    dup = tmp_path / "dup.gguf"
    dup.write_bytes(fz.join(g))
    results = fz.run_api(paths + [dup])
    for (key, _, value, words), r in zip(KNOWN + [("tokens", 0, "dup", "appears twice")],
                                         results, strict=True):
        assert fz.api_outcome(r) == "error" and words in r["message"], (key, value, r)
    for path in (paths[2], paths[9], paths[13]):  # through the command line too
        outcome, err = fz.run_cli(path)
        assert outcome == "error", err


def test_seeded_fuzz_ends_in_success_or_one_line(bases: list[bytes], tmp_path: Path) -> None:
    rng = random.Random(20261123)
    bad: list[tuple[str, str]] = []

    def cases(n: int) -> list[tuple[str, Path]]:
        made = []
        for i in range(n):
            name, data = fz.mutate(rng.choice(bases), rng)
            path = tmp_path / f"case{i}.gguf"
            path.write_bytes(data)
            made.append((name, path))
        return made

    for _ in range(4):  # through forecache.Llama, 160 cases in chunks (the files are large)
        made = cases(40)
        results = fz.run_api([p for _, p in made])
        bad += [(name, o) for (name, _), o in zip(made, map(fz.api_outcome, results), strict=True)
                if o not in ("ok", "error")]
    for _ in range(CLI_CASES):  # the command line, one case at a time
        [(name, path)] = cases(1)
        outcome, err = fz.run_cli(path)
        if outcome not in ("ok", "error"):
            bad.append((name, f"{outcome}: {err[-300:]}"))
    assert not bad, bad

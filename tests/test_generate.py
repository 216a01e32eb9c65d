"""Generation on the stock path: the tiny preset in every type, deterministic with --greedy."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from cli_helpers import run_cli, run_cli_json

from forecache.generate import SamplingParams, generate
from forecache.gguf import qtypes
from forecache.llama import Llama

QTYPES = list(qtypes.QTYPES)


@pytest.mark.parametrize("qtype", QTYPES)
def test_tiny_generates_deterministically(tiny_model: Callable[[str], Path], qtype: str) -> None:
    path = tiny_model(qtype)
    with Llama.open(path, cache=None, n_ctx=512) as llm:
        a = generate(llm, "Hello, world", 24, SamplingParams(greedy=True), ignore_eos=True)
        b = generate(llm, "Hello, world", 24, SamplingParams(greedy=True), ignore_eos=True)
    assert len(a.tokens) == 24
    assert a.tokens == b.tokens
    assert a.text == b.text
    assert len(set(a.tokens)) > 1, "greedy output stuck on one token: weights are degenerate"
    assert a.prompt_tokens > 1 and a.ttft_s > 0 and a.tpot_s > 0


def test_cli_generate_json_is_reproducible(tiny_model: Callable[[str], Path]) -> None:
    path = str(tiny_model("q8_0"))
    args = ("generate", "-m", path, "-p", "The quick brown fox", "-n", "16", "--greedy",
            "--ignore-eos")
    first = run_cli_json(*args)
    second = run_cli_json(*args)
    assert first["tokens"] == second["tokens"] and len(first["tokens"]) == 16
    assert first["text"] == second["text"]
    stats = first["stats"]
    assert stats["gen_tokens"] == 16 and stats["prompt_tokens"] > 0
    assert stats["ttft_s"] > 0 and stats["tpot_s"] > 0


def test_sampling_depends_on_seed(tiny_model: Callable[[str], Path]) -> None:
    path = str(tiny_model("q8_0"))
    base = ("generate", "-m", path, "-p", "Once upon a time", "-n", "24", "--temp", "1.5",
            "--ignore-eos")
    a = run_cli_json(*base, "--seed", "1")["tokens"]
    assert a == run_cli_json(*base, "--seed", "1")["tokens"]
    assert a != run_cli_json(*base, "--seed", "2")["tokens"]


def test_cli_generate_streams_text(tiny_model: Callable[[str], Path]) -> None:
    res = run_cli("generate", "-m", str(tiny_model("q8_0")), "-p", "Hi", "-n", "8", "--greedy",
                  "--ignore-eos", check=True)
    text = run_cli_json("generate", "-m", str(tiny_model("q8_0")), "-p", "Hi", "-n", "8",
                        "--greedy", "--ignore-eos")["text"]
    assert res.stdout == text
    assert "TTFT" in res.stderr and "tokens/s" in res.stderr


def test_context_overflow_is_a_clear_error(tiny_model: Callable[[str], Path]) -> None:
    res = run_cli("generate", "-m", str(tiny_model("q8_0")), "-p", "Hi", "-n", "600",
                  "--ctx", "256")
    assert res.returncode == 1
    assert res.stderr.strip().splitlines()[-1].startswith("forecache: error: prompt (")

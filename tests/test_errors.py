"""Messages name a setting the way the reader gives it: a keyword argument in Python, a flag on
the command line."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from forecache.cache.budget import BudgetError
from forecache.errors import flag_names, setting, use_flag_names
from forecache.placement.options import CacheConfig
from tests.cli_helpers import run_cli


@pytest.fixture
def cli_names() -> Iterator[None]:
    """Flag names for one test, then the Python spelling again."""
    before = flag_names()
    use_flag_names()
    try:
        yield
    finally:
        use_flag_names(before)


def test_python_spelling() -> None:
    assert not flag_names()
    assert setting("gpu_budget") == "gpu_budget="
    assert setting("n_ctx") == "n_ctx="
    assert setting("window", 2) == "window=2"
    assert setting("predictor", "history") == "predictor='history'"
    assert setting("verbose", True) == "verbose=True"


def test_flag_spelling(cli_names: None) -> None:
    assert setting("gpu_budget") == "--gpu-budget"
    assert setting("n_ctx") == "--ctx"  # the flag differs from the keyword
    assert setting("n_parallel", 3) == "--parallel 3"
    assert setting("predictor", "history") == "--predictor history"
    assert setting("verbose", True) == "--verbose"


def test_budget_error_names_the_keyword_in_python_and_the_flag_on_the_cli(
        tiny_model: Callable[[str], Path]) -> None:
    from forecache.llama import Llama

    model = tiny_model("q8_0")
    with pytest.raises(BudgetError, match=r"raise gpu_budget= or lower n_ctx=$"):
        Llama(str(model), policy="lru", gpu_budget="1MiB", verbose=False)
    with pytest.raises(ValueError, match="needs gpu_budget= or cache_fraction=$"):
        CacheConfig("lru")
    res = run_cli("generate", "-m", str(model), "-p", "x", "--policy", "lru",
                  "--gpu-budget", "1MiB")
    assert res.returncode == 1
    assert res.stderr.strip().endswith("raise --gpu-budget or lower --ctx"), res.stderr


def test_context_hint_names_the_keywords_in_python(tiny_model: Callable[[str], Path]) -> None:
    """A prompt and max_tokens past the context: the model's own limit where the context is the
    model's (no n_ctx= then: nothing larger loads), else the n_ctx= that fits."""
    from forecache.generate import SamplingParams, generate
    from forecache.llama import Llama

    model = tiny_model("q8_0")
    greedy = SamplingParams(greedy=True)
    with Llama.open(model, cache=None, n_ctx=1 << 20) as llm:  # capped at the model's
        with pytest.raises(ValueError, match=r"that is the model's own context .*: at most \d+ "
                                             r"new tokens after this prompt; lower max_tokens= "
                                             r"or shorten the prompt$") as err:
            generate(llm, "hi", llm.n_ctx() + 1, greedy)
        assert "n_ctx" not in str(err.value)
    with Llama(str(model), n_ctx=256, cache=None, verbose=False) as llm:
        with pytest.raises(ValueError, match=r"raise n_ctx= to \d+ or more \(the model takes up "
                                             r"to \d+\), or lower max_tokens= to \d+$"):
            generate(llm, "hi", 300, greedy)

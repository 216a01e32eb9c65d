"""Speculative decoding: greedy output is the model's (against stock llama.cpp), sampled output is
distributed as the model's sampler, and bad drafts are refused with one line."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

from forecache.generate import SamplingParams, generate, last_logits
from forecache.llama import Llama
from forecache.models.default import REFERENCE_DRAFT, REFERENCE_MODEL
from forecache.placement.options import CacheConfig
from forecache.speculative import speculator
from forecache.speculative.speculator import (
    BACKOFF,
    MIN_SPEC_STEPS,
    PLAIN_PROBE,
    REPROBE,
    DraftLength,
    Sampler,
    sampler_for,
    verify,
)
from tests.conftest import ROUNDING, assert_same_tokens

if TYPE_CHECKING:
    from conftest import StockReference

PROMPTS = [[7, 99, 23, 5], [301, 4, 1000]]
N_GEN = 24
REF_PROMPT = "In the beginning God created the heaven and the earth. And the earth was"


@pytest.fixture(scope="module")
def other_tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny preset with other weights: a draft with the same vocabulary."""
    from forecache.gguf.maker import make_model

    path = tmp_path_factory.mktemp("draft") / "tiny-seed1.gguf"
    make_model(path, "tiny", "q8_0", seed=1, workers=1)
    return path


def _greedy(model: Path, draft: str, draft_k: int | None,
            rejections: list[tuple[np.ndarray, int, int]]
            ) -> tuple[list[list[int]], dict]:
    """Greedy runs with ``draft``; each turned-down draft goes to ``rejections`` as (the model's
    logits at its position in the verification, the drafted token, the model's token)."""
    real_verify = speculator.verify

    def recording_verify(rows: np.ndarray, drafts: Sequence[int], *args: Any, **kw: Any
                         ) -> tuple[list[int], int]:
        accepted, new = real_verify(rows, drafts, *args, **kw)
        if len(accepted) < len(drafts):
            rejections.append((np.array(rows[len(accepted)]), drafts[len(accepted)], new))
        return accepted, new

    out = []
    speculator.verify = recording_verify
    try:
        with Llama.open(model, cache=CacheConfig("promoe", cache_fraction=0.5,
                                                 predictor="history"),
                        n_ctx=256, n_threads=2, draft=draft, draft_k=draft_k) as llm:
            for prompt in PROMPTS:
                res = generate(llm, prompt, N_GEN, SamplingParams(greedy=True),
                               ignore_eos=True)
                out.append(res.tokens)
            stats = llm.expert_stats()
    finally:
        speculator.verify = real_verify
    return out, stats


@pytest.mark.parametrize("draft_k", [3, None], ids=["k3", "adaptive"])
@pytest.mark.parametrize("draft", ["self-little", "self-cached", "same-model", "other-model"])
def test_greedy_speculation_is_the_model(tiny_model: Callable[[str], Path], other_tiny: Path,
                                         stock: StockReference, draft: str,
                                         draft_k: int | None) -> None:
    model = tiny_model("q8_0")
    ref = stock.run(model, PROMPTS, N_GEN, n_ctx=256, n_threads=2)
    path = {"same-model": str(model), "other-model": str(other_tiny)}.get(draft, draft)
    rejections: list[tuple[np.ndarray, int, int]] = []
    got, stats = _greedy(model, path, draft_k, rejections)
    for tokens, (ref_tokens, ref_logits) in zip(got, ref, strict=True):
        # The verification computes its k+1 rows in one pass and stock decodes one row at a
        # time: the same tokens wherever the CPU's kernels round both alike (AVX2 and AVX-512
        # here), and otherwise (AMX's tiles, a GPU) up to a near tie of the model's logits
        assert_same_tokens(tokens, ref_tokens, ref_logits, f"draft {draft}")
    assert stats["verify_passes"] > 0 and stats["drafted"] > 0
    assert stats["draft"] == (Path(path).name if draft.endswith("model") else draft)
    if draft == "same-model":
        # The model drafting for itself computes what the verification computes, but its own
        # context catches up on accepted tokens several rows at once while it drafts one row at
        # a time; where a CPU's kernels round a several-row pass otherwise than a one-row one
        # (AMX's tiles), a near tie can go the other way. So a draft is turned down only at a
        # near tie of the model's own logits: how many there are depends on the CPU, that each
        # is a near tie does not.
        for row, drafted, chosen in rejections:
            assert row[chosen] - row[drafted] <= ROUNDING * float(np.ptp(row)), \
                f"a draft of the model itself turned down by {row[chosen] - row[drafted]:.3g}"
        # (each turned-down draft was seen: a pass that turns one down loses it and the rest)
        assert stats["drafted"] - stats["accepted"] >= len(rejections)
        assert rejections or stats["accepted"] == stats["drafted"]
        assert stats["accepted"] > 0
        # and its states through the model's routers name the experts the verification routes
        # for the rows it drafted (the same tokens through the same weights: a rounding flip of
        # a router's near tie at most); the verification routes the last draft's row too, at
        # most top-k experts more than the draft's own rows' (at least as many): half or more
        assert stats["prefetch_precision"] > 0.95
        assert stats["prefetch_recall"] >= 0.5 * stats["prefetch_precision"]
        assert stats["spec_cutoff"] > 0
    elif draft == "other-model":  # other random weights: drafts are turned down
        assert stats["accepted"] < stats["drafted"]
        assert stats["prefetch_precision"] < 0.9
    else:  # the little pass: drafts both taken and turned down on the way
        assert stats["drafted"] > stats["accepted"] > 0
    if draft_k is not None:
        assert stats["draft_k"] == draft_k
        assert stats["drafted"] <= stats["verify_passes"] * draft_k


def _chi2_sf(x: float, dof: int) -> float:
    """P(chi-square with ``dof`` degrees > x), Wilson-Hilferty's normal approximation."""
    z = ((x / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


def _fit(counts: Counter, p: np.ndarray, n: int) -> float:
    """The p-value of ``counts`` (n draws) against distribution ``p``: tokens expected 5 times or
    more are bins of their own, the rest one bin."""
    big = [t for t in np.flatnonzero(p * n >= 5)]
    obs = [counts.get(int(t), 0) for t in big]
    exp = [p[t] * n for t in big]
    obs.append(n - sum(obs))
    exp.append(n - sum(exp))
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp, strict=True) if e > 0)
    return _chi2_sf(stat, len(obs) - 1)


@pytest.mark.skipif(not REFERENCE_MODEL.is_file(), reason="reference model not in this checkout")
def test_rejection_rule_samples_the_model() -> None:
    """With the reference model's distribution after a prompt (p) and its little pass's (q),
    the token the rule emits for a draft drawn from q is distributed as p, though q is not p."""
    cfg = CacheConfig("lru", cache_fraction=0.5)
    with Llama.open(REFERENCE_MODEL, cache=cfg, n_ctx=128, n_threads=2) as llm:
        cache = llm.expert_cache
        assert cache is not None
        tokens = llm.tokenize(REF_PROMPT.encode(), add_bos=True)
        llm.eval(tokens)
        big = last_logits(llm)
        llm.n_tokens -= 1
        cache.set_little(1)
        try:
            llm.eval(tokens[-1:])
        finally:
            cache.set_little(0)
        little = last_logits(llm)
    sampler = Sampler(temp=1.0, top_k=0, top_p=1.0, min_p=0.0)
    p, q = sampler.probs(big), sampler.probs(little)
    rng = np.random.default_rng(0)
    n = 20000
    emitted: Counter = Counter()
    rows = np.stack([big, big])
    for _ in range(n):
        d = int(rng.choice(len(q), p=q))
        accepted, extra = verify(rows, [d], [q], sampler, rng)
        emitted[accepted[0] if accepted else extra] += 1
    drafts = Counter(int(t) for t in rng.choice(len(q), size=n, p=q))
    assert _fit(emitted, p, n) > 1e-3
    assert _fit(drafts, p, n) < 1e-6  # the drafts alone are told apart from p


@pytest.mark.skipif(not REFERENCE_MODEL.is_file(), reason="reference model not in this checkout")
def test_sampled_speculation_draws_as_the_model_does() -> None:
    """Over many seeds the first three generated tokens (the first drawn from the prompt's
    logits by the numpy chain, the others drafted and verified) are distributed as llama.cpp's
    own sampler draws them without speculation (same temperature, top-k, top-p, min-p and
    repeat penalty, the server's default)."""
    sp = SamplingParams(temperature=1.0, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.1)
    seeds = range(300)
    runs: dict[str, list[list[int]]] = {}
    for name, draft in (("plain", None), ("speculative", "self-little")):
        cfg = CacheConfig("promoe", cache_fraction=0.5, predictor="history")
        with Llama.open(REFERENCE_MODEL, cache=cfg, n_ctx=128, n_threads=2, draft=draft,
                        draft_k=2 if draft else None) as llm:
            runs[name] = []
            for s in seeds:
                llm.set_seed(s)
                runs[name].append(generate(llm, REF_PROMPT, 3, sp, ignore_eos=True).tokens)
            if draft:
                assert llm.expert_stats()["verify_passes"] >= len(seeds)
    for i in (0, 1, 2):
        a = Counter(r[i] for r in runs["plain"])
        b = Counter(r[i] for r in runs["speculative"])
        # two-sample chi-square over tokens seen 10 times or more in both together
        keys = [t for t in a | b if a[t] + b[t] >= 10]
        obs = [(a[t], b[t]) for t in keys]
        obs.append((len(seeds) - sum(x for x, _ in obs), len(seeds) - sum(y for _, y in obs)))
        stat = sum((x - y) ** 2 / (x + y) for x, y in obs if x + y > 0)
        assert _chi2_sf(stat, len(obs) - 1) > 1e-3, (i, obs)


def test_sampler_settings_speculation_reproduces() -> None:
    assert sampler_for({"temp": 0.0, "repeat_penalty": 1.0}) == Sampler(temp=0.0)
    assert sampler_for({"temp": 0.7, "top_k": 10}).top_k == 10
    for other in ({"typical_p": 0.9}, {"mirostat_mode": 2}, {"grammar": object()}):
        assert sampler_for({"temp": 0.8, **other}) is None
    assert sampler_for({"repeat_penalty": 1.1}, 32) == Sampler(repeat_penalty=1.1,
                                                               penalty_last_n=32)
    # llama.cpp's penalties: a repeated token's logit divided (positive) or multiplied
    # (negative) by the repeat penalty, less its count times the frequency penalty and the
    # presence penalty
    pen = Sampler(temp=0.0, repeat_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25,
                  penalty_last_n=3)
    z = np.array([4.0, -2.0, 1.0, 3.0])
    assert np.allclose(pen.penalized(z, [3, 0, 1, 1]), [2.0 - 0.75, -4.0 - 1.25, 1.0, 3.0])
    assert pen.pick(z, np.random.default_rng(0), [3, 0, 1, 1])[0] == 3
    # llama.cpp's chain: top-k, top-p and min-p at temperature 1, then the temperature
    z = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    p = Sampler(temp=2.0, top_k=3, top_p=0.75, min_p=0.0).probs(z)
    kept = np.exp(z[:2] / 2.0)
    assert np.allclose(p, np.r_[kept / kept.sum(), 0, 0])
    assert np.allclose(Sampler(temp=1.0, top_k=0, top_p=1.0, min_p=0.5).probs(z),
                       np.r_[0.5, 0.3, 0, 0] / 0.8)


@pytest.mark.skipif(not REFERENCE_MODEL.is_file(), reason="reference model not in this checkout")
def test_greedy_speculation_keeps_llama_cpp_penalties() -> None:
    """Greedy with a repeat penalty: the speculative run's tokens are llama.cpp's own sampler
    chain's (the penalties computed in numpy over the tokens generated so far)."""
    out = {}
    for draft in (None, "self-little"):
        cfg = CacheConfig("promoe", cache_fraction=0.5, predictor="history")
        with Llama.open(REFERENCE_MODEL, cache=cfg, n_ctx=256, n_threads=2, draft=draft) as llm:
            tokens = llm.tokenize(REF_PROMPT.encode(), add_bos=True)
            for penalty in (1.0, 1.5):
                done = llm.complete(tokens, 48, temp=0.0, repeat_penalty=penalty)
                out[draft, penalty] = done.tokens
            if draft:
                assert llm.expert_stats()["verify_passes"] > 0
    assert out[None, 1.5] != out[None, 1.0]  # the penalty changes this text
    assert out["self-little", 1.5] == out[None, 1.5]
    assert out["self-little", 1.0] == out[None, 1.0]


@pytest.mark.skipif(not REFERENCE_DRAFT.is_file(), reason="reference draft not in this checkout")
def test_the_shipped_draft_speculates_for_the_reference_model() -> None:
    """The trained dense draft has the reference model's vocabulary and width: greedy output
    is the model's, and its states through the model's routers name experts the verifications
    route."""
    out = {}
    for draft in (None, str(REFERENCE_DRAFT)):
        cfg = CacheConfig("promoe", cache_fraction=0.5, predictor="history")
        with Llama.open(REFERENCE_MODEL, cache=cfg, n_ctx=256, n_threads=2, draft=draft,
                        draft_k=3) as llm:
            out[draft] = generate(llm, REF_PROMPT, 32, SamplingParams(greedy=True)).tokens
            stats = llm.expert_stats()
    assert out[str(REFERENCE_DRAFT)] == out[None]
    assert stats["draft"] == REFERENCE_DRAFT.name and stats["verify_passes"] > 0
    assert 0 < stats["accepted"] < stats["drafted"]
    assert stats["spec_cutoff"] > 0 and stats["spec_prefetched"] >= 0
    assert 0 < stats["prefetch_precision_chance"] < 1
    assert stats["prefetch_precision"] > 0


def test_bad_drafts_are_refused(tiny_model: Callable[[str], Path]) -> None:
    from tests.cli_helpers import run_cli

    model = str(tiny_model("q8_0"))
    cases = [
        (["--draft", "missing.gguf"], "no such file"),
        (["--draft", "self-little"], "--policy promoe"),
        (["--draft", "self-little", "--policy", "promoe", "--cache-fraction", "0.5", "--mode",
          "mobile"], "choose one"),
    ]
    if REFERENCE_MODEL.is_file():  # another vocabulary
        cases.append((["--draft", str(REFERENCE_MODEL)], "vocabulary differs"))
    for args, want in cases:
        res = run_cli("generate", "-m", model, "-p", "Hello", "-n", "4", *args)
        assert res.returncode != 0 and want in res.stderr, (args, res.stderr)
        assert len(res.stderr.strip().splitlines()) == 1, res.stderr


def test_cli_reports_speculation(tiny_model: Callable[[str], Path]) -> None:
    from forecache.chat import spec_summary
    from tests.cli_helpers import run_cli_json

    model = str(tiny_model("q8_0"))
    opts = ["-m", model, "-p", "Hello there", "-n", "16", "--greedy", "--policy", "promoe",
            "--cache-fraction", "0.5"]
    plain = run_cli_json("generate", *opts)
    spec = run_cli_json("generate", *opts, "--draft", "self-cached", "--draft-k", "2")
    assert spec["tokens"] == plain["tokens"]
    s = spec["stats"]
    assert s["draft"] == "self-cached" and s["draft_k"] == 2 and s["verify_passes"] > 0
    assert 0.0 <= s["acceptance"] <= 1.0 and "draft" not in plain["stats"]
    line = spec_summary(s)
    assert line.startswith("speculative (self-cached drafts): ") and "accepted" in line


def _drive(length: DraftLength, spec_s: float, plain_s: float, tokens: int) -> list[int]:
    """Feed ``length`` steps that each accept half their drafts: a drafted step costs
    ``spec_s`` a token it yields, a plain token ``plain_s``; the draft lengths it asked for."""
    asked, done = [], 0
    while done < tokens:
        k = length.next_k()
        asked.append(k)
        if k == 0:
            length.plain(plain_s)
            done += 1
        else:
            acc = k // 2
            length.update(acc, k, spec_s * (acc + 1))
            done += acc + 1
    return asked


def test_drafting_stops_while_it_does_not_pay() -> None:
    """Adaptive drafting measures plain decoding after its first steps and decodes plain for a
    while when a drafted token costs more; it tries drafting again afterwards."""
    slow = DraftLength(None)
    asked = _drive(slow, spec_s=0.020, plain_s=0.010, tokens=200)
    first = asked.index(0)
    assert first == MIN_SPEC_STEPS  # measured, then the plain probe
    run = asked[first:first + PLAIN_PROBE + BACKOFF]
    assert run == [0] * (PLAIN_PROBE + BACKOFF)  # probe, then the back-off
    assert asked[first + PLAIN_PROBE + BACKOFF] > 0  # drafting is tried again
    assert slow.backoffs >= 2 and asked.count(0) > len(asked) // 2
    fast = DraftLength(None)
    asked = _drive(fast, spec_s=0.005, plain_s=0.010, tokens=200)
    # kept drafting, probing the plain rate once and every REPROBE steps after
    steps = sum(k > 0 for k in asked)
    assert fast.backoffs == 0 and asked.count(0) == PLAIN_PROBE * (1 + steps // REPROBE)
    fixed = DraftLength(3)
    assert set(_drive(fixed, spec_s=0.020, plain_s=0.010, tokens=100)) == {3}


def test_acceptance_replay_reads_and_draws() -> None:
    """An acceptance replay (benchmarks only) takes a rate a token or accepted counts in turn;
    a rate accepts each draft with that probability up to the first rejection, counts are
    taken in turn and never exceed the step's drafts; bad ones are refused in one line."""
    from forecache.speculative.acceptance import AcceptanceReplay

    counts = AcceptanceReplay.parse("3,0,5").player()
    assert [counts.accepted([1, 2, 3, 4]) for _ in range(4)] == [3, 0, 4, 3]
    for rate in (0.0, 0.5, 0.7, 1.0):
        play = AcceptanceReplay.parse(str(float(rate)), seed=3).player()
        got = [play.accepted([0] * 4) for _ in range(4000)]
        # the mean of a geometric run cut at 4: sum of rate^i, i = 1..4
        assert np.mean(got) == pytest.approx(sum(rate ** i for i in range(1, 5)), abs=0.06)
    assert "acceptance replayed (0.70 a token)" in AcceptanceReplay.parse("0.7").label()
    for bad in ("1.5", "x", "2,-1", ""):
        with pytest.raises(ValueError, match="acceptance|accepted|rate"):
            AcceptanceReplay.parse(bad)


def test_acceptance_replay_sets_how_many_drafts_stand(tiny_model: Callable[[str], Path]) -> None:
    """Under an acceptance replay the verification pass still runs (its routers, its sampler),
    and each step keeps exactly the replayed number of drafts, then the model's token: the
    counters follow the replay; without a draft, or in a batch job, it is refused."""
    from forecache.batch import decode_many
    from forecache.jobs.requests import Request

    model = tiny_model("q8_0")
    cfg = CacheConfig("promoe", cache_fraction=0.5, predictor="history")
    with Llama.open(model, cache=cfg, n_ctx=256, n_threads=2, draft="self-little", draft_k=4,
                    acceptance_replay="3,0,4,1") as llm:
        res = generate(llm, PROMPTS[0], 40, SamplingParams(greedy=True), ignore_eos=True)
        spec = llm.speculator
        assert spec is not None and len(res.tokens) == 40
        s = spec.stats_json()
        assert "acceptance replayed" in s["acceptance_replay"]
        n = s["verify_passes"]
        assert n > 4 and s["drafted"] == 4 * n
        # the replayed counts in turn (the last step may be cut short by the token limit)
        want = sum([3, 0, 4, 1][i % 4] for i in range(n))
        assert want - 4 <= s["accepted"] <= want
        with pytest.raises(ValueError, match="single-request benchmarks"):
            decode_many(llm, [Request(id="a", line=1, prompt="hi", max_tokens=4,
                                      sampling=SamplingParams(greedy=True))], 1,
                        lambda r: None)
    with pytest.raises(ValueError, match="give draft="):
        Llama.open(model, cache=cfg, n_ctx=256, n_threads=2, acceptance_replay="0.7")


def test_policy_bench_replays_acceptance(tiny_model: Callable[[str], Path],
                                        tmp_path: Path) -> None:
    """benchmarks/policy_bench.py --acceptance: the runs with a draft accept as the replay says,
    and the report says so (its drafted tokens left out of the comparison); without a run with
    a draft, or with a bad rate, it is refused in one line."""
    import json
    import subprocess
    import sys

    model = str(tiny_model("q8_0"))
    out = tmp_path / "rep.json"

    def bench(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "benchmarks/policy_bench.py", "-m", model,
                               "--cache-fraction", "0.5", "--prompt-len", "8", "--gen", "12",
                               "--prompts", "1", "--threads", "2", *args],
                              capture_output=True, text=True, timeout=300,
                              cwd=Path(__file__).resolve().parents[1])

    res = bench("--acceptance", "0.8", "--policies", "promoe,promoe+spec", "--json", str(out))
    assert res.returncode == 0, res.stderr
    rep = json.loads(out.read_text())
    assert "acceptance replayed (0.80 a token)" in rep["acceptance_replay"]
    assert "acceptance replayed" in res.stdout and rep["same_tokens"] is True
    spec = next(r for r in rep["results"] if r["policy"] == "promoe+spec")
    assert spec["tokens_per_s"] > 0
    res = bench("--acceptance", "0.8", "--policies", "promoe")
    assert res.returncode != 0 and "add a run with a draft" in res.stderr
    res = bench("--acceptance", "1.7", "--policies", "promoe+spec")
    assert res.returncode != 0 and "from 0 to 1" in res.stderr


def test_a_model_draft_that_does_not_pay_stops_drafting(tiny_model: Callable[[str], Path],
                                                         other_tiny: Path) -> None:
    """Adaptive drafting holds for a model draft: a draft whose tokens are never accepted
    (replayed: every verification keeps none) costs a draft pass and a verification of two rows
    a token against a plain pass, on any machine, so the loop backs off to plain decoding."""
    model = tiny_model("q8_0")
    cfg = CacheConfig("promoe", cache_fraction=0.5, predictor="history")
    with Llama.open(model, cache=cfg, n_ctx=256, n_threads=2, draft=str(other_tiny),
                    acceptance_replay="0") as llm:
        res = generate(llm, PROMPTS[0], 60, SamplingParams(greedy=True), ignore_eos=True)
        spec = llm.speculator
        assert spec is not None and len(res.tokens) == 60
        s = spec.stats_json()
        assert s["accepted"] == 0 and s["verify_passes"] >= MIN_SPEC_STEPS
        assert spec.length.backoffs >= 1 and s["undrafted"] > PLAIN_PROBE


def test_a_draft_is_named_as_a_model_is(tiny_model: Callable[[str], Path], tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """``draft=`` takes what ``-m`` takes: a catalog name finds its file in the model directory
    (here make-model's tiny-draft, the tiny model's vocabulary, under the name of the catalog's
    Qwen2-0.5B-Instruct file); a name that is nothing is refused in one line naming draft=."""
    from forecache.gguf.maker import make_model
    from forecache.models.names import ModelNotFoundError, catalog

    entry = catalog()["qwen2-0.5b-instruct"]
    make_model(tmp_path / entry.file, "tiny-draft", "q8_0", workers=1)
    monkeypatch.setenv("FORECACHE_MODEL_DIR", str(tmp_path))
    model = tiny_model("q8_0")
    with Llama.open(model, cache=None, n_ctx=128, n_threads=2, draft="qwen2-0.5b-instruct",
                    draft_k=2) as llm:
        res = generate(llm, PROMPTS[0], 8, SamplingParams(greedy=True), ignore_eos=True)
        assert llm.speculator is not None and llm.speculator.draft.kind == entry.file
        assert len(res.tokens) == 8
    with pytest.raises(ModelNotFoundError, match="draft=.*no model file or name"):
        Llama.open(model, cache=None, n_ctx=128, n_threads=2, draft="no-such-draft")

"""trace -> train -> eval-predictor through the command line on the trained reference model (real,
learned routing), as a user runs them; predictors of another model are refused."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from cli_helpers import run_cli

from forecache.gguf.header import read_model_file
from forecache.models.default import REFERENCE_MODEL


@pytest.fixture(scope="module")
def ref_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("trace") / "ref.npz"
    run_cli("trace", "-m", str(REFERENCE_MODEL), "--builtin", "default", "--limit", "24",
            "-n", "24", "--gate-input", "--out", str(out), check=True)
    return out


def test_trace_command_writes_builtin_trace(ref_trace: Path) -> None:
    from forecache.trace.format import TraceFile

    with TraceFile(ref_trace) as tr:
        info = tr.info()
        assert info.n_requests == 24 and info.has_gate_input
        assert tr.meta["source"] == "builtin:default"
        assert (np.asarray(tr.array("phase")) == 1).sum() > 0


def test_trace_refuses_malformed_prompts_and_existing_output(tiny_model, tmp_path: Path) -> None:
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"prompt": "fine"}\n{"prompt": \n')
    res = run_cli("trace", "-m", str(tiny_model("q8_0")), "--prompts", str(bad),
                  "--out", str(tmp_path / "t.npz"))
    assert res.returncode == 1 and f"{bad}:2" in res.stderr and "not JSON" in res.stderr
    assert not (tmp_path / "t.npz").exists()
    bad.write_text('{"text": "no prompt key"}\n')
    res = run_cli("trace", "-m", str(tiny_model("q8_0")), "--prompts", str(bad),
                  "--out", str(tmp_path / "t.npz"))
    assert res.returncode == 1 and f"{bad}:1: unknown field(s) text" in res.stderr
    existing = tmp_path / "exists.npz"
    existing.write_bytes(b"user data")
    res = run_cli("trace", "-m", str(tiny_model("q8_0")), "--builtin", "default",
                  "--out", str(existing))
    assert res.returncode == 1 and "--force" in res.stderr
    assert existing.read_bytes() == b"user data"


def test_eval_predictor_json_and_plot(ref_trace: Path, tmp_path: Path) -> None:
    png = tmp_path / "fig8.png"
    res = run_cli("eval-predictor", "--trace", str(ref_trace), "-m", str(REFERENCE_MODEL),
                  "--predictors", "all", "--window", "1,2", "--epochs", "8", "--plot", str(png),
                  "--json", check=True)
    out = json.loads(res.stdout)
    assert out["windows"] == [1, 2] and out["skipped"] == {}
    preds = out["predictors"]
    assert set(preds) == {"learned", "skip", "token", "eam", "history"}
    for p in preds.values():
        acc = p["accuracy"]
        assert len(acc) == 2 and len(acc[0]) == 8 and acc[0][0] is None  # layer 0 not scored
        assert all(0.0 <= v <= 1.0 for row in acc for v in row if v is not None)
    # learned routing is predictable: well above a random guess (top-4 of 32: 0.125)
    for name in ("learned", "skip", "token", "eam", "history"):
        assert preds[name]["mean"][0] > 2 * 4 / 32, name
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"


def test_train_stores_predictors_and_refuses_other_models(ref_trace: Path, tmp_path: Path,
                                                          monkeypatch) -> None:
    from forecache.gguf.identity import ModelMismatchError
    from forecache.gguf.maker import make_model
    from forecache.predictor.store import learned_dir, load_learned

    monkeypatch.setenv("FORECACHE_CACHE_DIR", str(tmp_path / "cache"))
    model = REFERENCE_MODEL
    run_cli("train", "-m", str(model), "--trace", str(ref_trace), "--window", "2",
            "--epochs", "8", check=True)
    mf = read_model_file(model)
    p = load_learned(mf, 2)
    assert sorted(p.pairs) == [(0, 1), (0, 2)] + [(i - 2, i) for i in range(3, 8)]
    assert learned_dir(mf, 2).is_relative_to(tmp_path / "cache")

    other = tmp_path / "other.gguf"  # same shape, other weights
    make_model(other, "reference", "q8_0", seed=7, workers=1)
    with pytest.raises(ModelMismatchError, match="same shape but other weights"):
        load_learned(read_model_file(other), directory=learned_dir(mf, 2))
    res = run_cli("train", "-m", str(other), "--trace", str(ref_trace), "--window", "2")
    assert res.returncode == 1 and "was made for" in res.stderr and "forecache trace" in res.stderr

    # at run time, promoe picks the trained predictors up and prefetches with them, losslessly
    from forecache.generate import SamplingParams, generate
    from forecache.llama import Llama
    from forecache.placement.options import CacheConfig

    def run(cfg: CacheConfig | None) -> tuple[list[int], dict]:
        with Llama.open(model, n_ctx=256, cache=cfg) as llm:
            res = generate(llm, "Once upon a time, in a small town by the sea,", 24,
                           SamplingParams(greedy=True), ignore_eos=True)
            seen = {}
            if llm.expert_cache is not None:
                worker = llm.expert_cache.worker
                assert worker is not None and not worker.errors
                worker.drain()
                pol = llm.expert_cache.policy
                # forecasts reached the policy (whether in time to copy depends on the cores free)
                seen = {"predictor": worker.forecaster.predictor.name,
                        "window": worker.forecaster.window,
                        "forecasts": pol.prefetch_loads + pol.prefetch_refreshed
                        + pol.stale_predictions}
            return res.tokens, seen

    stock, _ = run(None)
    tokens, seen = run(CacheConfig("promoe", cache_fraction=0.4))
    assert tokens == stock
    assert seen["predictor"] == "learned" and seen["window"] == 2 and seen["forecasts"] > 0

"""forecache batch through the real command line: results, errors, kill and resume."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from forecache.default_model import REFERENCE_MODEL
from tests.cli_helpers import run_cli

GREEDY = [("a", "And it came to pass"), ("b", "The LORD said"), ("c", "def main():"),
          ("d", "In the beginning"), ("e", "import os")]


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.skipif(not REFERENCE_MODEL.is_file(), reason="reference model not in this checkout")
def test_batch_results_equal_single_sequence_greedy_and_errors_do_not_stop_it(
        tmp_path: Path) -> None:
    from forecache.generate import SamplingParams, generate
    from forecache.llama import Llama

    lines = [json.dumps({"id": i, "prompt": p, "max_tokens": 16, "temperature": 0})
             for i, p in GREEDY]
    lines.insert(2, '{"id": "broken", "prompt": ')  # malformed: the job goes on
    lines.append(json.dumps({"id": "chat", "messages": [{"role": "user", "content": "Who?"}],
                             "max_tokens": 12, "temperature": 0}))
    lines.append(json.dumps({"id": "stop", "prompt": "And it came to pass", "max_tokens": 40,
                             "temperature": 0, "stop": "LORD"}))
    lines.append(json.dumps({"id": "sampled", "prompt": "And", "max_tokens": 8, "seed": 7}))
    src = _write(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    res = run_cli("batch", "-m", str(REFERENCE_MODEL), "--input", str(src), "--output", str(out),
                  "--parallel", "3", "--policy", "promoe", "--cache-fraction", "0.5",
                  "--progress")
    assert res.returncode == 1, res.stderr
    assert "8/8" in res.stderr and "tokens/s" in res.stderr  # the progress bar
    assert "experts: promoe, hit rate" in res.stderr  # the summary
    assert res.stderr.strip().splitlines()[-1] == \
        f"forecache: error: 1 of 9 requests failed (see {out})"
    recs = {r["id"]: r for r in _records(out)}
    assert len(recs) == 9
    assert "not JSON" in recs["line-3"]["error"] and recs["line-3"]["line"] == 3
    with Llama.open(REFERENCE_MODEL, cache=None, n_ctx=2048) as llm:
        for rid, prompt in GREEDY:
            want = generate(llm, prompt, 16, SamplingParams(greedy=True))
            assert recs[rid]["text"] == want.text, rid
            assert recs[rid]["tokens"] == len(want.tokens)
            assert recs[rid]["finish_reason"] == want.finish_reason
        chat = generate(llm, llm.format_chat([{"role": "user", "content": "Who?"}]), 12,
                        SamplingParams(greedy=True))
        assert recs["chat"]["text"] == chat.text
        full = generate(llm, "And it came to pass", 40, SamplingParams(greedy=True)).text
    assert recs["stop"]["finish_reason"] == "stop"
    assert recs["stop"]["text"] == full[:full.index("LORD")]
    assert recs["sampled"]["tokens"] == 8 and recs["sampled"]["prompt_tokens"] > 0
    assert set(recs["a"]["timings"]) == {"ttft_s", "total_s", "tokens_per_s"}


@pytest.mark.skipif(not REFERENCE_MODEL.is_file(), reason="reference model not in this checkout")
def test_mobile_batch_equals_mobile_generation(tmp_path: Path) -> None:
    """--mode mobile with several sequences: their next tokens share little passes and the
    unsure ones a full pass (with the prompts), yet each request's text is what one-sequence
    MoBiLE decoding gives it."""
    from forecache.generate import SamplingParams, generate
    from forecache.llama import Llama

    src = _write(tmp_path / "in.jsonl",
                 [json.dumps({"id": i, "prompt": p, "max_tokens": 16, "temperature": 0})
                  for i, p in GREEDY])
    out = tmp_path / "out.jsonl"
    opts = ["--policy", "promoe", "--cache-fraction", "0.5", "--mode", "mobile", "--gamma", "0.7"]
    res = run_cli("batch", "-m", str(REFERENCE_MODEL), "--input", str(src), "--output", str(out),
                  "--parallel", "3", *opts)
    assert res.returncode == 0, res.stderr
    summary = res.stderr.strip().splitlines()[-1]
    assert "mode mobile (lossy)" in summary, summary
    share = int(summary.split("full model for ")[1].split("%")[0])
    assert 0 < share < 100, summary  # both kinds of step happened
    recs = {r["id"]: r for r in _records(out)}
    llm = Llama(str(REFERENCE_MODEL), policy="promoe", cache_fraction=0.5, mode="mobile",
                gamma=0.7, n_ctx=512, verbose=False)
    try:
        for rid, prompt in GREEDY:
            want = generate(llm, prompt, 16, SamplingParams(greedy=True))
            assert recs[rid]["text"] == want.text, rid
    finally:
        llm.close()


@pytest.mark.skipif(not REFERENCE_MODEL.is_file(), reason="reference model not in this checkout")
@pytest.mark.parametrize("draft", ["self-little", "self-cached"])
def test_speculative_batch_is_exact(tmp_path: Path, draft: str) -> None:
    """--draft with several sequences: their drafts' little passes go together and one batch
    verifies them with the prompts; each greedy text is the model's, stops and lengths too."""
    from forecache.generate import SamplingParams, generate
    from forecache.llama import Llama

    lines = [json.dumps({"id": i, "prompt": p, "max_tokens": 24, "temperature": 0})
             for i, p in GREEDY]
    lines.append(json.dumps({"id": "stop", "prompt": "And it came to pass", "max_tokens": 40,
                             "temperature": 0, "stop": "LORD"}))
    lines.append(json.dumps({"id": "sampled", "prompt": "And", "max_tokens": 8, "seed": 7}))
    src = _write(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    res = run_cli("batch", "-m", str(REFERENCE_MODEL), "--input", str(src), "--output", str(out),
                  "--parallel", "3", "--policy", "promoe", "--cache-fraction", "0.5",
                  "--draft", draft)
    assert res.returncode == 0, res.stderr
    assert f"speculative ({draft} drafts)" in res.stderr.strip().splitlines()[-1], res.stderr
    recs = {r["id"]: r for r in _records(out)}
    with Llama.open(REFERENCE_MODEL, cache=None, n_ctx=2048) as llm:
        for rid, prompt in GREEDY:
            want = generate(llm, prompt, 24, SamplingParams(greedy=True))
            assert recs[rid]["text"] == want.text, rid
            assert recs[rid]["tokens"] == len(want.tokens)
        full = generate(llm, "And it came to pass", 40, SamplingParams(greedy=True)).text
    assert recs["stop"]["text"] == full[:full.index("LORD")]
    assert recs["sampled"]["tokens"] == 8
    res = run_cli("batch", "-m", str(REFERENCE_MODEL), "--input", str(src), "--output",
                  str(tmp_path / "other.jsonl"), "--draft", str(REFERENCE_MODEL))
    assert res.returncode == 2 and "little pass only" in res.stderr


def _job(tmp_path: Path, model: Path, n: int) -> Path:
    return _write(tmp_path / "in.jsonl",
                  [json.dumps({"id": f"r{i}", "prompt": f"request {i} says", "max_tokens": 120,
                               "temperature": 0}) for i in range(n)])


def test_a_killed_job_resumes_and_loses_nothing(tmp_path: Path, tiny_model) -> None:
    # --parallel 1 in every run: a sequence decoded beside others goes through other llama.cpp
    # kernels (several token rows instead of one), which round differently, and this
    # random-weight model's near-flat logits turn that into other tokens; decoded alone, a greedy
    # answer is the same whenever it is computed.
    model = tiny_model("q8_0")
    src = _job(tmp_path, model, 24)
    ref = tmp_path / "ref.jsonl"
    run_cli("batch", "-m", str(model), "--input", str(src), "--output", str(ref),
            "--parallel", "1", check=True)
    want = {r["id"]: r["text"] for r in _records(ref)}
    assert len(want) == 24

    out = tmp_path / "out.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "forecache", "batch", "-m", str(model),
                             "--input", str(src), "--output", str(out), "--parallel", "1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not (out.exists() and out.read_bytes().count(b"\n") >= 2):
        assert proc.poll() is None, "the job finished before it could be killed"
        assert time.monotonic() < deadline
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    first = _records(out)
    assert 2 <= len(first) < 24
    with open(out, "ab") as f:  # a crash in the middle of writing a record
        f.write(b'{"id": "r23", "text": "half')
    res = run_cli("batch", "-m", str(model), "--input", str(src), "--output", str(out),
                  "--parallel", "1")
    assert res.returncode == 0, res.stderr
    assert "half-written" in res.stderr and f"{len(first)} of 24" in res.stderr
    got = _records(out)
    assert sorted(r["id"] for r in got) == sorted(want)  # each id exactly once
    assert got[:len(first)] == first  # what was written stays as it was
    assert {r["id"]: r["text"] for r in got} == want


def test_sigterm_keeps_finished_records(tmp_path: Path, tiny_model) -> None:
    model = tiny_model("q8_0")
    src = _job(tmp_path, model, 24)
    out = tmp_path / "out.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "forecache", "batch", "-m", str(model),
                             "--input", str(src), "--output", str(out), "--parallel", "2"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (out.exists() and out.read_bytes().count(b"\n") >= 1):
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "rerun the same command to resume" in err
    recs = _records(out)
    assert 1 <= len(recs) < 24 and all("text" in r for r in recs)


def test_unreadable_input_and_corrupt_output_are_refused_untouched(tmp_path: Path,
                                                                   tiny_model) -> None:
    model = str(tiny_model("q8_0"))
    out = tmp_path / "out.jsonl"
    res = run_cli("batch", "-m", model, "--input", str(tmp_path / "none.jsonl"),
                  "--output", str(out))
    assert res.returncode == 1 and not out.exists()
    assert res.stderr.strip().splitlines() == [
        f"forecache: error: input file not found: {tmp_path / 'none.jsonl'}"]

    binary = tmp_path / "bin.jsonl"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    res = run_cli("batch", "-m", model, "--input", str(binary), "--output", str(out))
    assert res.returncode == 1 and not out.exists() and "not UTF-8" in res.stderr

    src = _write(tmp_path / "in.jsonl", ['{"id": "x", "prompt": "hi", "max_tokens": 2}'])
    corrupt = b'{"id": "y", "text": "ok"}\nthis is not a record\n'
    out.write_bytes(corrupt)
    res = run_cli("batch", "-m", model, "--input", str(src), "--output", str(out))
    assert res.returncode == 1
    assert f"{out} line 2 is not a forecache batch record" in res.stderr
    assert out.read_bytes() == corrupt

    half = _write(tmp_path / "half.jsonl", ['{"id": "x", "prompt": "hi", "max_tokens": 2}'])
    with open(half, "a") as f:
        f.write('{"id": "z", "prom')
    out2 = tmp_path / "out2.jsonl"
    res = run_cli("batch", "-m", model, "--input", str(half), "--output", str(out2))
    assert res.returncode == 1
    recs = {r["id"]: r for r in _records(out2)}
    assert "text" in recs["x"] and "still being written" in recs["line-2"]["error"]


def test_duplicate_ids_and_surrogates_never_hide_a_request(tmp_path: Path, tiny_model) -> None:
    """Error records are keyed by their line: a duplicate id, or a malformed line naming a valid
    line's id, never makes a rerun skip the valid request; a lone surrogate fails one request, not
    the job; a resumed job still reports the failures it wrote before."""
    model = str(tiny_model("q8_0"))
    inp = _write(tmp_path / "in.jsonl", [
        '{"id": "a", "prompt": "first", "max_tokens": 2}',
        '{"id": "a", "prompt": "again", "max_tokens": 2}',   # duplicate of line 1
        '{"id": "c", "prompt": 5}',                           # malformed, names line 4's id
        '{"id": "c", "prompt": "valid c", "max_tokens": 2}',
        '{"id": "d", "prompt": "x\\ud800y", "max_tokens": 2}',  # valid JSON, not Unicode text
        '{"id": "e\\ud800", "prompt": "hi", "max_tokens": 2}',
    ])
    out = tmp_path / "out.jsonl"
    args = ("batch", "-m", model, "--input", str(inp), "--output", str(out), "--parallel", "1")
    res = run_cli(*args)
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
    assert res.stderr.strip().endswith(f"4 of 6 requests failed (see {out})")
    recs = {r["id"]: r for r in _records(out)}
    assert set(recs) == {"a", "c", "line-2", "line-3", "line-5", "line-6"}
    assert "text" in recs["a"] and "text" in recs["c"]
    assert "duplicate id 'a'" in recs["line-2"]["error"] and recs["line-2"]["request_id"] == "a"
    assert recs["line-3"]["request_id"] == "c" and '"prompt"' in recs["line-3"]["error"]
    assert "lone surrogate U+D800" in recs["line-5"]["error"]
    assert "lone surrogate" in recs["line-6"]["error"] and "request_id" not in recs["line-6"]
    before = out.read_bytes()
    again = run_cli(*args)  # resumed: nothing left to run, the failures still count
    assert again.returncode == 1 and "4 of 6 requests failed" in again.stderr, again.stderr
    assert out.read_bytes() == before

    # killed after the error records but before "c" ran: the rerun still runs "c"
    out2 = tmp_path / "out2.jsonl"
    out2.write_text("".join(json.dumps(recs[k]) + "\n"
                            for k in ("line-2", "line-3", "line-5", "line-6", "a")))
    res = run_cli("batch", "-m", model, "--input", str(inp), "--output", str(out2),
                  "--parallel", "1")
    assert res.returncode == 1, res.stderr
    assert {r["id"] for r in _records(out2)} == set(recs)

"""forecache batch through the real command line: results, errors, kill and resume, the
output's input order; and decode_many's packing (admission order, prompt chunks)."""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from forecache.models.default import REFERENCE_MODEL
from tests.cli_helpers import lowest_priority, run_cli

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
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            preexec_fn=lowest_priority)
    deadline = time.monotonic() + 120
    while not (out.exists() and out.read_bytes().count(b"\n") >= 2):
        assert proc.poll() is None, "the job finished before it could be killed"
        assert time.monotonic() < deadline
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    first = _records(out)
    assert 2 <= len(first) < 24
    # the longest prompts ("request 10 says" and on) ran first: not the input's order
    assert [r["id"] for r in first] != [f"r{i}" for i in range(len(first))]
    with open(out, "ab") as f:  # a crash in the middle of writing a record
        f.write(b'{"id": "r23", "text": "half')
    res = run_cli("batch", "-m", str(model), "--input", str(src), "--output", str(out),
                  "--parallel", "1")
    assert res.returncode == 0, res.stderr
    assert "half-written" in res.stderr and f"{len(first)} of 24" in res.stderr
    got = _records(out)
    assert [r["id"] for r in got] == [f"r{i}" for i in range(24)]  # input order, each id once
    assert [r["id"] for r in _records(ref)] == [f"r{i}" for i in range(24)]
    assert all(r in got for r in first)  # what was written before the kill stays as it was
    assert {r["id"]: r["text"] for r in got} == want


def test_sigterm_keeps_finished_records(tmp_path: Path, tiny_model) -> None:
    model = tiny_model("q8_0")
    src = _job(tmp_path, model, 24)
    out = tmp_path / "out.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "forecache", "batch", "-m", str(model),
                             "--input", str(src), "--output", str(out), "--parallel", "2"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lowest_priority)
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


def _kill_after(model: Path, src: Path, out: Path, parallel: int, records: int) -> int:
    """Run a batch job and SIGKILL it once ``records`` records are in ``out``; the records it
    wrote."""
    proc = subprocess.Popen([sys.executable, "-m", "forecache", "batch", "-m", str(model),
                             "--input", str(src), "--output", str(out), "--parallel",
                             str(parallel)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            preexec_fn=lowest_priority)
    deadline = time.monotonic() + 120
    while not (out.exists() and out.read_bytes().count(b"\n") >= records):
        assert proc.poll() is None, "the job finished before it could be killed"
        assert time.monotonic() < deadline
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    return len(_records(out))


@pytest.mark.skipif(not REFERENCE_MODEL.is_file(), reason="reference model not in this checkout")
def test_seeded_requests_across_a_kill(tmp_path: Path) -> None:
    """A request's text depends on its own seed and logits only: decoded alone (--parallel 1),
    killed and resumed, every text is the uninterrupted job's, sampled ones included. Beside
    other requests llama.cpp's kernels for several rows round a sequence's logits by which
    requests share its passes, so such records say "batched": true (README); their greedy texts
    (this trained model has no near ties in them) are still the ones decoded alone."""
    prompts = [p for _, p in GREEDY] + ["Once upon a time", "The king of", "for i in range("]
    lines = []
    for i, p in enumerate(prompts * 2):
        sampled = i >= len(prompts)
        lines.append(json.dumps({"id": f"{'s' if sampled else 'g'}{i % len(prompts)}",
                                 "prompt": p, "max_tokens": 32,
                                 **({"seed": 1000 + i} if sampled else {"temperature": 0})}))
    src = _write(tmp_path / "in.jsonl", lines)
    alone = tmp_path / "alone.jsonl"
    run_cli("batch", "-m", str(REFERENCE_MODEL), "--input", str(src), "--output", str(alone),
            "--parallel", "1", check=True)
    want = {r["id"]: r for r in _records(alone)}
    assert len(want) == 16 and not any(r["batched"] for r in want.values())
    for parallel in (1, 4):
        out = tmp_path / f"out{parallel}.jsonl"
        first = _kill_after(REFERENCE_MODEL, src, out, parallel, 3)
        assert 3 <= first < 16
        res = run_cli("batch", "-m", str(REFERENCE_MODEL), "--input", str(src), "--output",
                      str(out), "--parallel", str(parallel))
        assert res.returncode == 0 and f"{first} of 16" in res.stderr, res.stderr
        got = {r["id"]: r for r in _records(out)}
        assert got.keys() == want.keys()
        for rid, r in got.items():
            if parallel == 1 or not r["batched"] or rid.startswith("g"):
                assert r["text"] == want[rid]["text"], (parallel, rid, r, want[rid])
        batched = [rid for rid, r in got.items() if r["batched"]]
        assert (len(batched) >= 12) if parallel == 4 else not batched, batched


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


def test_a_finished_job_writes_its_output_in_input_order(tmp_path: Path, tiny_model) -> None:
    """Requests finish out of order (the longest, last in the input, starts first; error records
    are written before any request runs), yet the finished output is in the input's order, an
    error record at its line's place and a record of another input after them; the file keeps
    its permissions."""
    model = str(tiny_model("q8_0"))
    lines = [json.dumps({"id": f"r{i}", "prompt": f"request {i} says", "max_tokens": n,
                         "temperature": 0}) for i, n in enumerate([2, 4, 8, 16, 24, 32])]
    lines.insert(2, '{"id": "r9", "prompt": ')  # malformed: error record line-3
    src = _write(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    out.write_text(json.dumps({"id": "other", "text": "from another input"}) + "\n")
    out.chmod(0o640)
    res = run_cli("batch", "-m", model, "--input", str(src), "--output", str(out),
                  "--parallel", "3")
    assert res.returncode == 1, res.stderr
    assert res.stderr.strip().splitlines()[-1] == \
        f"forecache: error: 1 of 7 requests failed (see {out})"
    recs = _records(out)
    assert [r["id"] for r in recs] == ["r0", "r1", "line-3", "r2", "r3", "r4", "r5", "other"]
    assert "not JSON" in recs[2]["error"]
    assert [r["tokens"] for r in recs[:2] + recs[3:7]] == [2, 4, 8, 16, 24, 32]
    assert stat.S_IMODE(out.stat().st_mode) == 0o640
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp file


def test_a_job_runs_from_python_resumes_and_ends_in_input_order(tmp_path: Path,
                                                                tiny_model) -> None:
    """run_job, the library's whole job without the command line: a record already in the
    output is skipped and kept as it was, the others are reported as they are written (longest
    first), and the finished output is in the input's order; run again, nothing is left."""
    from forecache.jobs.run import JobProgress, run_job
    from forecache.roofline.batch import BatchPlan

    class Seen(JobProgress):
        def __init__(self) -> None:
            self.notes: list[str] = []
            self.records: list[str] = []

        def note(self, text: str) -> None:
            self.notes.append(text)

        def record(self, record: dict) -> None:
            self.records.append(record["id"])

    src = _write(tmp_path / "in.jsonl", [_line(f"r{i}", i, max_tokens=n)
                                         for i, n in enumerate([2, 6, 4, 8])])
    out = tmp_path / "out.jsonl"
    before = b'{"id": "r2", "text": "from an earlier run"}\n'
    out.write_bytes(before)
    seen = Seen()
    res = run_job(tiny_model("q8_0"), src, out, cache=None, plan=BatchPlan(1, 64), ctx_per_seq=128,
                  progress=seen)
    assert (res.done, res.skipped, res.failed, res.total, res.interrupted) == (3, 1, 0, 4, None)
    assert seen.records == ["r3", "r1", "r0"]  # one sequence: the longest first, r2 skipped
    assert f"1 of 4 requests are already in {out}; skipping them" in seen.notes
    assert res.summary().startswith("3 done, 1 skipped, 0 failed of 4; ")
    from forecache.native.ggml_devices import cache_device

    plan = BatchPlan(1, 64).label(cpu_only=cache_device().type == "cpu")
    assert f"; plan {plan}; experts: none" in res.summary()
    assert [r["id"] for r in _records(out)] == ["r0", "r1", "r2", "r3"]
    assert before in out.read_bytes().splitlines(keepends=True)
    again = run_job(tiny_model("q8_0"), src, out, cache=None, plan=BatchPlan(1, 64))
    assert again.summary() == "nothing to do (4 requests, 4 done, 0 failed)"


def test_rewrite_in_input_order_only_rewrites_a_complete_output(tmp_path: Path) -> None:
    from forecache.batch import rewrite_in_input_order

    b = b'{"id": "b", "text": "\xc3\xa9t\xc3\xa9",  "tokens": 2}\n'  # bytes kept as they are
    a = b'{"id": "a", "text": "x"}\n'
    c = b'{"id": "c", "line": 3, "error": "not JSON"}\n'
    x = b'{"id": "x", "text": "another input"}\n'
    y = b'{"id": "y", "text": "another input"}\n'
    out = tmp_path / "out.jsonl"

    out.write_bytes(y + b + x + a)  # "c" missing: a rerun still has work
    assert not rewrite_in_input_order(out, ["a", "b", "c"])
    assert out.read_bytes() == y + b + x + a
    out.write_bytes(y + b + x + a + c + b'{"id": "d", "te')  # a record cut short
    assert not rewrite_in_input_order(out, ["a", "b", "c"])
    assert out.read_bytes().startswith(y + b)

    out.write_bytes(y + b + x + a + c)
    out.chmod(0o604)
    link = tmp_path / "link.jsonl"
    link.symlink_to(out.name)
    assert rewrite_in_input_order(link, ["a", "b", "c"])
    assert out.read_bytes() == a + b + c + y + x and link.is_symlink()
    assert stat.S_IMODE(out.stat().st_mode) == 0o604
    inode = out.stat().st_ino
    assert not rewrite_in_input_order(out, ["a", "b", "c"])  # already in order: not touched
    assert out.stat().st_ino == inode
    assert sorted(os.listdir(tmp_path)) == ["link.jsonl", "out.jsonl"]


def _line(rid: str | None, i: int, max_tokens: int = 4) -> str:
    return json.dumps({**({"id": rid} if rid is not None else {}),
                       "prompt": f"request {i} says", "max_tokens": max_tokens,
                       "temperature": 0})


def test_a_fixed_line_supersedes_its_error_record(tmp_path: Path, tiny_model) -> None:
    """Two malformed lines, one naming an id and one without any, are fixed and the job run
    again into the same output: each fixed line's request runs and its record takes the place
    of the line's error record, one record a line, exit 0 (README: exit 1 only while a line of
    the input has an error record). A rerun killed after the fixed results were appended, before
    the output was rewritten, is finished by the next one; a fixed line whose request fails
    still ends the job with exit 1."""
    model = str(tiny_model("q8_0"))
    good = [_line(f"r{i}", i) for i in range(6)]
    broken = good[:2] + ['{"id": "r9", "prompt": '] + good[2:4] + ['{"prompt": 5}'] + good[4:]
    fixed = good[:2] + [_line("r9", 9)] + good[2:4] + [_line(None, 6)] + good[4:]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    args = ("batch", "-m", model, "--input", str(src), "--output", str(out), "--parallel", "2")
    _write(src, broken)
    res = run_cli(*args)
    assert res.returncode == 1 and "2 of 8 requests failed" in res.stderr, res.stderr
    first = out.read_bytes()
    assert [r["id"] for r in _records(out)] == ["r0", "r1", "line-3", "r2", "r3", "line-6", "r4",
                                                "r5"]

    _write(src, fixed)
    res = run_cli(*args)
    assert res.returncode == 0, res.stderr
    assert "6 of 8 requests are already in" in res.stderr
    assert "2 done, 6 skipped, 0 failed of 8" in res.stderr
    recs = _records(out)
    assert [r["id"] for r in recs] == ["r0", "r1", "r9", "r2", "r3", "line-6", "r4", "r5"]
    assert not [r for r in recs if "error" in r]
    done = out.read_bytes()
    lines = done.splitlines(keepends=True)
    assert all(x in lines for x in first.splitlines(keepends=True) if b'"error"' not in x)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp file

    # killed after appending the fixed lines' results, before the rewrite: both records there
    late = [x for x in lines if json.loads(x)["id"] in ("r9", "line-6")]
    out.write_bytes(first + b"".join(late))
    res = run_cli(*args)
    assert res.returncode == 0 and "nothing to do" in res.stderr, res.stderr
    assert out.read_bytes() == done

    # a fixed line whose request cannot run: its own error record, and the job fails
    out.write_bytes(first)
    _write(src, good[:2] + [_line("r9", 9, max_tokens=5000)] + good[2:4] + [_line(None, 6)]
           + good[4:])
    res = run_cli(*args)
    assert res.returncode == 1 and "1 of 8 requests failed" in res.stderr, res.stderr
    recs = _records(out)
    assert [r["id"] for r in recs] == ["r0", "r1", "r9", "r2", "r3", "line-6", "r4", "r5"]
    assert "exceed the context" in recs[2]["error"] and "text" in recs[5]


def test_plan_auto_names_the_cpu_on_a_machine_without_a_gpu(tmp_path: Path, tiny_model,
                                                            monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    """On a CPU-only machine the plan's line speaks of the CPU and host memory, not of a GPU or
    device memory that does not exist, and the plan it prints is one --plan runs."""
    from forecache.native.ggml_devices import cache_device

    if cache_device().type != "cpu":
        pytest.skip("this machine has a GPU")
    monkeypatch.setenv("FORECACHE_CACHE_DIR", str(tmp_path / "cache"))
    model = str(tiny_model("q8_0"))
    src = _write(tmp_path / "in.jsonl", [_line(f"r{i}", i) for i in range(3)])
    res = run_cli("batch", "-m", model, "--input", str(src), "--output",
                  str(tmp_path / "auto.jsonl"))
    assert res.returncode == 0, res.stderr
    plan = [x for x in res.stderr.splitlines() if x.startswith("forecache: plan seq=")]
    assert len(plan) == 1, res.stderr
    line = plan[0]
    assert "GPU" not in line and "device" not in line and "PCIe" not in line, line
    assert "in host memory" in line, line
    bounds = re.findall(r"bound by ([^;]+)", line)
    assert len(bounds) == 2 and set(bounds) <= {"CPU compute", "memory bandwidth",
                                                "expert copies"}, line
    label = line.split()[2]
    res = run_cli("batch", "-m", model, "--input", str(src), "--output",
                  str(tmp_path / "given.jsonl"), "--plan", label)
    assert res.returncode == 0, res.stderr
    assert len(_records(tmp_path / "given.jsonl")) == 3


def test_progress_follows_each_record_and_the_summary_names_its_speeds(tmp_path: Path,
                                                                       tiny_model) -> None:
    """Six requests of one length decode together and finish in the same steps: the progress
    bar is drawn at every record written (1/6, 2/6 ... in turn, none skipped), and the summary
    names the job's tokens/s apart from the records' own decode rates, whose range it gives."""
    model = str(tiny_model("q8_0"))
    src = _write(tmp_path / "in.jsonl", [_line(f"r{i}", i, max_tokens=6) for i in range(6)])
    out = tmp_path / "out.jsonl"
    res = run_cli("batch", "-m", model, "--input", str(src), "--output", str(out),
                  "--parallel", "6", "--progress")
    assert res.returncode == 0, res.stderr
    shown = [int(n) for n in re.findall(r"\b(\d+)/6 \[", res.stderr)]
    assert sorted(shown) == shown and set(shown) == set(range(7)), shown
    summary = [x for x in res.stderr.splitlines() if x.startswith("forecache: 6 done")]
    assert len(summary) == 1, res.stderr
    rates = [r["timings"]["tokens_per_s"] for r in _records(out)]
    lo, hi = min(rates), max(rates)
    span = f"{lo:.1f}" if lo == hi else f"{lo:.1f}-{hi:.1f}"
    assert "tokens/s over the job's wall time (prefill included)" in summary[0], summary
    assert f"each request decoded {span} tokens/s after its first token" in summary[0], summary


def _greedy(rid: str, prompt: str, max_tokens: int) -> object:
    from forecache.generate import SamplingParams
    from forecache.jobs.requests import Request

    return Request(id=rid, line=0, prompt=prompt, max_tokens=max_tokens,
                   sampling=SamplingParams(greedy=True))


def _decode(llm: object, reqs: list, packing: str, n_parallel: int = 1) -> list[dict]:
    from forecache.batch import decode_many

    done: list[dict] = []
    decode_many(llm, reqs, n_parallel, done.append, packing=packing)  # type: ignore[arg-type]
    return done


def test_longest_requests_are_admitted_first(tiny_model) -> None:
    """With one sequence a request finishes before the next starts, so the records come in
    admission order: the most tokens (prompt + max_tokens) first, ties in input order, and an
    over-context request's error record at its turn; packing="input" keeps the input's order."""
    from forecache.llama import Llama

    reqs = [_greedy(f"r{i}", "request 1 says", n) for i, n in enumerate([3, 9, 5, 9, 1])]
    reqs.insert(2, _greedy("long", "word " * 20, 2))  # a prompt of 21 tokens: longest to run
    reqs.append(_greedy("too-long", "hi", 1000))  # more than the sequence's context
    with Llama.open(tiny_model("q8_0"), cache=None, n_ctx=64) as llm:
        longest = _decode(llm, reqs, "longest")
        given = _decode(llm, reqs, "input")
        with pytest.raises(ValueError, match="packing='shortest'"):
            _decode(llm, reqs, "shortest")
    assert [r["id"] for r in longest] == ["too-long", "long", "r1", "r3", "r2", "r0", "r4"]
    assert [r["id"] for r in given] == [r.id for r in reqs]
    assert "exceed the context of" in longest[0]["error"]
    assert longest[1]["prompt_tokens"] > 9 + 1


def test_greedy_outputs_do_not_depend_on_packing(tiny_model) -> None:
    from forecache.llama import Llama

    reqs = [_greedy(f"r{i}", f"request {i} says" * (i % 3 + 1), 4 + 3 * (i % 4))
            for i in range(8)]
    with Llama.open(tiny_model("q8_0"), cache=None, n_ctx=128) as llm:
        runs = [{r["id"]: (r["text"], r["tokens"], r["finish_reason"]) for r in
                 _decode(llm, reqs, packing)} for packing in ("longest", "input")]
    assert len(runs[0]) == 8 and runs[0] == runs[1]


def test_prompt_chunks_fill_whole_ubatches(tiny_model) -> None:
    """A batch of n_batch tokens runs as ubatches of n_ubatch: where n_batch is not a multiple
    of it, prompt chunks stop at whole ubatches, so a prompt takes as many passes (each one
    routing, and copying, its experts) as with n_batch = n_ubatch."""
    from forecache.llama import Llama

    reqs = [_greedy("p", "word " * 40, 1)]  # 41 prompt tokens
    calls = {}
    for n_batch in (8, 12, 16):
        llm = Llama(str(tiny_model("q8_0")), policy="lru", cache_fraction=0.5, n_ctx=256,
                    n_batch=n_batch, n_ubatch=8, verbose=False)
        try:
            llm.reset_stats()
            text = _decode(llm, reqs, "longest")[0]["text"]
            calls[n_batch] = (llm.expert_stats()["hook_calls"], text)
        finally:
            llm.close()
    # routed layers x ubatches: 12 tokens a batch would add a 4-token ubatch to each step
    assert calls[12] == calls[8] == calls[16], calls


@pytest.mark.skipif(not REFERENCE_MODEL.is_file(), reason="reference model not in this checkout")
def test_the_plan_is_chosen_once_measured_and_runs(tmp_path: Path) -> None:
    env = dict(os.environ, FORECACHE_CACHE_DIR=str(tmp_path / "cache"))
    lines = [json.dumps({"id": i, "prompt": p, "max_tokens": 12, "temperature": 0})
             for i, p in GREEDY]
    src = _write(tmp_path / "in.jsonl", lines)

    def run(out: str, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "forecache", "batch", "-m",
                               str(REFERENCE_MODEL), "--input", str(src), "--output",
                               str(tmp_path / out), *args], capture_output=True, text=True,
                              env=env, timeout=300)

    first = run("auto.jsonl")  # --plan auto is the default
    assert first.returncode == 0, first.stderr
    assert "measuring this machine for the batch plan" in first.stderr
    plan_lines = [x for x in first.stderr.splitlines() if x.startswith("forecache: plan seq=")]
    assert len(plan_lines) == 1 and "tokens/s predicted" in plan_lines[0]
    assert "llama.cpp's own placement" in plan_lines[0]  # a CPU build given no size
    assert list((tmp_path / "cache" / "measured").glob("plan-*.json"))
    again = run("auto2.jsonl", "--plan", "auto")
    assert again.returncode == 0 and "measuring" not in again.stderr  # kept from the first
    assert [x for x in again.stderr.splitlines() if x.startswith("forecache: plan seq=")] == \
        plan_lines
    # a plan of one sequence gives --parallel 1's greedy text, whatever its ubatch
    by_plan = run("one.jsonl", "--plan", "seq=1,ubatch=16")
    by_parallel = run("par.jsonl", "--parallel", "1")
    assert by_plan.returncode == 0 and by_parallel.returncode == 0, by_plan.stderr
    # a plan given is not chosen: no plan line, and the summary names it
    assert not [x for x in by_plan.stderr.splitlines() if x.startswith("forecache: plan seq=")]
    assert "; plan seq=1,ubatch=16; " in by_plan.stderr
    texts = [r["text"] for r in _records(tmp_path / "par.jsonl")]
    assert [r["text"] for r in _records(tmp_path / "one.jsonl")] == texts
    assert [r["id"] for r in _records(tmp_path / "auto.jsonl")] == [i for i, _ in GREEDY]
    # a cache plan under --policy ncmoe, a plan that cannot be read, --plan with --parallel
    bad = run("bad.jsonl", "--plan", "seq=2,ubatch=64", "--policy", "ncmoe", "--gpu-budget",
              "1GiB")
    assert bad.returncode == 2 and "experts=ncmoe" in bad.stderr
    bad = run("bad.jsonl", "--plan", "seq=2")
    assert bad.returncode == 2 and "needs seq=N and ubatch=U" in bad.stderr
    bad = run("bad.jsonl", "--plan", "auto", "--parallel", "2")
    assert bad.returncode == 2 and "--plan or --parallel" in bad.stderr
    assert not (tmp_path / "bad.jsonl").exists()  # refused before the output is touched


@pytest.mark.skipif(not REFERENCE_MODEL.is_file(), reason="reference model not in this checkout")
def test_more_sequences_than_stock_llama_cpp_decode_together() -> None:
    """Patch 0004 raises llama.cpp's 256 sequences a context to MAX_SEQUENCES."""
    from forecache.batch import decode_many
    from forecache.generate import SamplingParams
    from forecache.jobs.requests import Request
    from forecache.llama import Llama
    from forecache.native.libs import MAX_SEQUENCES

    assert MAX_SEQUENCES > 256
    greedy = SamplingParams(greedy=True, temperature=0.0)
    reqs = [Request(id=str(i), line=i + 1, prompt=GREEDY[i % len(GREEDY)][1], max_tokens=4,
                    sampling=greedy) for i in range(300)]
    done: list[dict] = []
    with Llama.open(REFERENCE_MODEL, cache=None, n_ctx=32, n_seq_max=300, n_batch=512,
                    n_ubatch=512) as llm:
        decode_many(llm, reqs, 300, done.append)
    assert len(done) == 300 and not [r for r in done if "error" in r]
    alone: list[dict] = []
    with Llama.open(REFERENCE_MODEL, cache=None, n_ctx=32) as llm:
        decode_many(llm, reqs[:len(GREEDY)], 1, alone.append)
    texts = {r["id"]: r["text"] for r in done}
    assert all(texts[r["id"]] == r["text"] for r in alone)


def test_decoding_sequences_share_one_ubatch(tiny_model) -> None:
    """With a KV stream per sequence llama.cpp puts into one ubatch only sequences whose ids
    follow each other in the batch. As finished sequences hand their ids to new requests, and
    once none waits to the sequences left (their KV streams copied down), a step of every
    sequence's next token still runs as one ubatch (one routing of each layer)."""
    from forecache.batch import decode_many
    from forecache.llama import Llama
    from forecache.placement.options import CacheConfig

    def job(llm: Llama, reqs: list, compact: bool) -> tuple[dict, list[int], int]:
        """Texts, the hook calls of each step after one in which nothing finished (no prompt,
        only decoding sequences), and the fewest of any step (one ubatch)."""
        steps: list[tuple[int, int]] = []  # each step's records finished before it, hooks
        done: list[dict] = []
        llm.reset_stats()

        def on_token(_: int) -> None:
            steps.append((len(done), llm.expert_stats()["hook_calls"]))

        decode_many(llm, reqs, 4, done.append, on_token=on_token, compact=compact)
        assert [r.get("finish_reason") for r in done] == ["length"] * len(reqs), done
        calls = [b[1] - a[1] for a, b in zip([(0, 0), *steps[:-1]], steps, strict=True)]
        quiet = [calls[i] for i in range(1, len(steps)) if steps[i][0] == steps[i - 1][0]]
        return {r["id"]: r["text"] for r in done}, quiet, min(calls)

    admitted = [_greedy(f"r{i}", f"request {i} says", n)
                for i, n in enumerate([30, 24, 18, 12, 20, 16, 22, 14, 26, 10])]
    # longest first: "b" (a long prompt, two tokens) takes id 1 and finishes first, leaving
    # ids 0, 2 and 3 decoding
    draining = [_greedy("a", "request a says", 40), _greedy("b", "word " * 40, 2),
                _greedy("c", "request c says", 30), _greedy("d", "request d says", 25)]
    with Llama.open(tiny_model("q8_0"), cache=CacheConfig("lru", cache_fraction=0.5),
                    n_ctx=128, n_seq_max=4, n_batch=64, n_ubatch=64) as llm:
        _, quiet, one = job(llm, admitted, True)
        assert len(quiet) > 20 and all(c == one for c in quiet), [c // one for c in quiet]
        texts, quiet, one = job(llm, draining, True)
        assert len(quiet) > 20 and all(c == one for c in quiet), [c // one for c in quiet]
        kept, apart, one = job(llm, draining, False)
    # without moving "d" down to id 1, ids 0 and 2-3 take a ubatch each
    assert sum(c == 2 * one for c in apart) > 10, [c // one for c in apart]
    # a sequence moved to another id decodes on from its copied KV: the text is unchanged
    assert texts == kept

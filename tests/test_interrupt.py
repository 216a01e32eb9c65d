"""An interrupted make-model leaves neither a half-written model nor its temporary file; a
signal while llama.cpp may call back into Python reaches its handler once the call is done."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_helpers import lowest_priority


def test_signals_held_reach_their_handler_after_the_block() -> None:
    """A log callback that llama.cpp calls cannot pass an exception on, so a load holds the
    signals from their Python handlers (which raise) and hands them over when it returns."""
    from forecache.interrupt import signals_held

    reached = []
    with pytest.raises(KeyboardInterrupt):
        with signals_held():
            os.kill(os.getpid(), signal.SIGINT)
            reached.append("after the signal")
    assert reached == ["after the signal"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_sigterm_during_make_model_leaves_nothing(tmp_path: Path) -> None:
    out = tmp_path / "m.gguf"
    # About 1 GB: long enough to be caught while the tensor data is being written.
    proc = subprocess.Popen([sys.executable, "-m", "forecache", "make-model", str(out),
                             "--preset", "qwen1.5-moe-a2.7b", "--type", "q4_k", "--layers", "2"],
                            stderr=subprocess.PIPE, text=True, preexec_fn=lowest_priority)
    deadline = time.time() + 60
    while not list(tmp_path.glob("*.partial")) and time.time() < deadline:
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        time.sleep(0.02)
    assert list(tmp_path.glob("*.partial")), "make-model never started writing"
    proc.send_signal(signal.SIGTERM)
    rc = proc.wait(60)
    err = proc.stderr.read() if proc.stderr else ""
    assert rc == 128 + signal.SIGTERM, err
    assert "Traceback" not in err and err.strip().endswith("forecache: terminated")
    assert list(tmp_path.iterdir()) == []


def test_sigint_during_trace_keeps_finished_requests(tiny_model, tmp_path: Path) -> None:
    """Ctrl-C in the middle of a trace keeps every finished request as a valid trace."""
    from forecache.trace.format import TraceFile

    out = tmp_path / "t.npz"
    proc = subprocess.Popen([sys.executable, "-m", "forecache", "trace", "-m",
                             str(tiny_model("q8_0")), "--builtin", "default", "--out", str(out),
                             "-n", "16"], stderr=subprocess.PIPE, text=True,
                            preexec_fn=lowest_priority)
    assert proc.stderr is not None
    line = ""
    deadline = time.time() + 120
    while "[trace] " not in line and time.time() < deadline:  # the first progress line
        line = proc.stderr.readline()
        assert line or proc.poll() is None, "trace ended early"
    proc.send_signal(signal.SIGINT)
    rc = proc.wait(120)
    err = proc.stderr.read()
    assert rc == 130, err
    assert "Traceback" not in err and "interrupted: kept the" in err
    with TraceFile(out) as tr:
        n = tr.info().n_requests
        assert 32 <= n < 320  # at least the 10% reported, not all of them
        assert tr.meta["n_requests"] == n
    assert [p.name for p in tmp_path.iterdir()] == ["t.npz"]

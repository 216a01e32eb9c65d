"""Ctrl-C and SIGTERM to real processes, from start-up on and under a cache policy: every one is
taken (never lost to the gate hook's C frame or to an import), ends the command cleanly with 130
or 143, and prints no traceback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pexpect
import pytest

from forecache.interrupt import signal_line
from forecache.models.default import REFERENCE_MODEL

needs_reference = pytest.mark.skipif(not REFERENCE_MODEL.is_file(),
                                     reason="reference model not in this checkout")
CONSOLE_SCRIPT = Path(sys.executable).with_name("forecache")


def _handles(pid: int, sig: int) -> bool:
    """Whether process ``pid`` has a handler of its own for ``sig`` (its SigCgt mask in /proc)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = next(int(line.split()[1], 16) for line in status.splitlines()
                if line.startswith("SigCgt:"))
    return bool(mask >> (sig - 1) & 1)


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="needs Linux's /proc")
@pytest.mark.parametrize("entry", ["python -m forecache", "forecache"])
def test_a_signal_while_starting_up_is_one_line(entry: str, tiny_model) -> None:
    """While the command line's modules are imported (most of a second) and as the command
    starts and loads its model: the one line and 130 or 143, never a traceback, a lost signal
    or a bare death by the signal.
    Moments are timed from when the process took SIGINT (Python's start-up, ~35 ms before
    forecache's first module runs) or SIGTERM (forecache took it: Python never does)."""
    if entry == "forecache" and not CONSOLE_SCRIPT.is_file():
        pytest.skip("no forecache console script beside this Python")
    cmd = [str(CONSOLE_SCRIPT)] if entry == "forecache" else [sys.executable, "-m", "forecache"]
    moments = [(signal.SIGTERM, 0.0), (signal.SIGINT, 0.12), (signal.SIGINT, 0.3)]
    if entry != "forecache":
        moments += [(signal.SIGTERM, 0.03), (signal.SIGINT, 0.2), (signal.SIGINT, 0.5),
                    (signal.SIGINT, 0.75)]  # the last about when the model loads
    for sig in (signal.SIGINT, signal.SIGTERM):
        for started, delay in moments:
            proc = subprocess.Popen([*cmd, "generate", "-m", str(tiny_model("q8_0")), "-p", "hi",
                                     "-n", "2000", "--ignore-eos", "--threads", "1"],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            try:
                deadline = time.monotonic() + 30
                while not _handles(proc.pid, started):
                    assert proc.poll() is None and time.monotonic() < deadline, "never started"
                    time.sleep(0.001)
                time.sleep(delay)
                proc.send_signal(sig)
                _, err = proc.communicate(timeout=60)
            finally:
                proc.kill()
            where = (entry, signal.Signals(sig).name, "after", signal.Signals(started).name,
                     "taken", delay)
            assert proc.returncode == 128 + sig, (where, proc.returncode, err[-2000:])
            assert "Traceback" not in err and "Exception ignored" not in err, (where, err[-2000:])
            assert err.strip().endswith(signal_line(sig)), (where, err[-500:])


def _generate_then_signal(sig: int, delay: float) -> tuple[int, str]:
    proc = subprocess.Popen([sys.executable, "-m", "forecache", "generate", "-m",
                             str(REFERENCE_MODEL), "-p", "In the beginning", "-n", "2000",
                             "--ignore-eos", "--policy", "lru", "--cache-fraction", "0.5",
                             "--threads", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    proc.stdout.read(1)  # generation has started
    time.sleep(delay)
    proc.send_signal(sig)
    try:
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    return proc.returncode, err


@needs_reference
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_generate_stops_on_every_signal(sig: int) -> None:
    for delay in (0.0, 0.05, 0.13, 0.3, 0.5):  # at different points of the token loop
        rc, err = _generate_then_signal(sig, delay)
        assert rc == 128 + sig, (delay, rc, err[-2000:])
        assert "Traceback" not in err and "Exception ignored" not in err, err[-2000:]
        word = "terminated" if sig == signal.SIGTERM else "interrupted"
        assert err.strip().endswith(f"forecache: {word}"), err[-500:]


@needs_reference
def test_chat_quits_on_sigterm_at_the_prompt(tmp_path: Path) -> None:
    env = dict(os.environ, FORECACHE_CHAT_HISTORY=str(tmp_path / "history"), TERM="xterm")
    child = pexpect.spawn(sys.executable, ["-m", "forecache", "chat", "--policy", "lru",
                                           "--cache-fraction", "0.5"],
                          env=env, encoding="utf-8", timeout=120, dimensions=(40, 200))
    child.expect("/help lists commands")
    child.expect("> ")
    child.kill(signal.SIGTERM)
    child.expect(pexpect.EOF, timeout=60)
    child.close()
    assert child.exitstatus == 128 + signal.SIGTERM, child.before
    assert "Traceback" not in (child.before or "")

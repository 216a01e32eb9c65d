"""Ctrl-C and SIGTERM under a cache policy, to real processes: every one is taken (never lost to
the gate hook's C frame), ends the command cleanly with 130 or 143, and prints no traceback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pexpect
import pytest

from forecache.models.default import REFERENCE_MODEL

pytestmark = pytest.mark.skipif(not REFERENCE_MODEL.is_file(),
                                reason="reference model not in this checkout")


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


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_generate_stops_on_every_signal(sig: int) -> None:
    for delay in (0.0, 0.05, 0.13, 0.3, 0.5):  # at different points of the token loop
        rc, err = _generate_then_signal(sig, delay)
        assert rc == 128 + sig, (delay, rc, err[-2000:])
        assert "Traceback" not in err and "Exception ignored" not in err, err[-2000:]
        word = "terminated" if sig == signal.SIGTERM else "interrupted"
        assert err.strip().endswith(f"forecache: {word}"), err[-500:]


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

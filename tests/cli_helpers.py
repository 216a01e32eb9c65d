"""Running the forecache command line from tests, as a user would."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def run_cli(*args: str, check: bool = False, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``python -m forecache ARGS`` as a user would, capturing its output."""
    res = subprocess.run([sys.executable, "-m", "forecache", *args], capture_output=True,
                         text=True, timeout=timeout)
    if check and res.returncode != 0:
        raise AssertionError(f"forecache {' '.join(args)} exited {res.returncode}:\n{res.stderr}")
    return res


def run_cli_json(*args: str) -> dict:
    """Run a command with --json and parse its single JSON object."""
    res = run_cli(*args, "--json", check=True)
    return json.loads(res.stdout)


def lowest_priority() -> None:
    """``preexec_fn`` of a command a test interrupts part way (a signal once its first records
    are out): it runs at the lowest priority, so however busy the machine is, the test's polling
    sees its progress before it has finished."""
    os.nice(19)

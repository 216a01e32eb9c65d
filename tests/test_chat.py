"""forecache chat, driven through a real pseudo-terminal as a person would."""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

import pexpect
import pytest

from forecache.models.default import REFERENCE_MODEL

PROMPT = "\r\n> "
STATUS = re.compile(r"\[(stopped \| )?[\d.]+ tokens/s \| TTFT \d+ ms \| (\d+) tokens \| "
                    r"prompt (\d+) new \+ (\d+) cached \| experts: ([^\]]*)\]")


def _spawn(tmp_path: Path, *args: str) -> pexpect.spawn:
    env = dict(os.environ, FORECACHE_CHAT_HISTORY=str(tmp_path / "history"), TERM="xterm")
    child = pexpect.spawn(sys.executable, ["-m", "forecache", "chat", *args], env=env,
                          encoding="utf-8", timeout=120, dimensions=(40, 200))
    child.expect("/help lists commands")
    child.expect("> ")
    return child


def _finish(child: pexpect.spawn) -> int:
    child.expect(pexpect.EOF, timeout=60)
    child.close()
    return child.exitstatus


@pytest.mark.skipif(not REFERENCE_MODEL.is_file(), reason="reference model not in this checkout")
def test_multi_turn_chat_reuses_the_kv_cache_and_commands_work(tmp_path: Path) -> None:
    from forecache.generate import SamplingParams, generate
    from forecache.llama import Llama

    child = _spawn(tmp_path, "--temp", "0", "--max-tokens", "20", "--system", "Be brief.")
    child.sendline("And it came to pass")
    child.expect(STATUS)
    first = child.match
    assert int(first.group(2)) > 0
    assert int(first.group(4)) == 0  # nothing cached before the first turn
    child.expect("> ")
    child.sendline("Tell me more")
    child.expect(STATUS)
    second = child.match
    new, cached = int(second.group(3)), int(second.group(4))
    # the first turn's tokens stay in the KV cache: only the new message is prefilled
    assert cached >= int(first.group(3)), (new, cached)
    assert new < cached
    child.expect("> ")

    child.sendline("/stats")
    child.expect(r"turns: 2, generated tokens: (\d+)")
    assert int(child.match.group(1)) == int(first.group(2)) + int(second.group(2))
    child.expect("> ")
    saved = tmp_path / "conv.json"
    child.sendline(f"/save {saved}")
    child.expect(r"saved 5 messages")
    child.expect("> ")
    child.sendline("/system")
    child.expect("system: Be brief.")
    child.expect("> ")
    child.sendline("/nonsense")
    child.expect("unknown command /nonsense")
    child.expect("> ")
    child.sendline("/reset")
    child.expect("conversation cleared")
    child.expect("> ")
    child.sendline("/stats")
    child.expect("turns: 0")
    child.expect("> ")
    child.sendeof()
    assert _finish(child) == 0

    doc = json.loads(saved.read_text())
    msgs = doc["messages"]
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant"]
    # lossless: the first answer is what the model gives greedily for the same rendered chat
    with Llama.open(REFERENCE_MODEL, cache=None, n_ctx=2048) as llm:
        res = generate(llm, llm.format_chat(msgs[:2]), 20, SamplingParams(greedy=True))
    assert msgs[2]["content"] == res.text
    assert (tmp_path / "history").read_text().count("Tell me more") == 1  # readline history


def test_ctrl_c_stops_the_answer_not_the_program(tmp_path: Path, tiny_model) -> None:
    # greedy: the answer is the same whichever experts the cache holds (a sampled one can differ
    # in the last bits of its logits and, rarely, end at once); this one streams past Ctrl-C
    child = _spawn(tmp_path, "-m", str(tiny_model("q8_0")), "--max-tokens", "3000",
                   "--policy", "promoe", "--cache-fraction", "0.5", "--temp", "0")
    child.sendline("hello")
    child.expect(r"\S{20}")  # the answer is streaming
    time.sleep(0.2)
    child.sendintr()
    child.expect(STATUS)
    status = child.match
    assert status.group(1) == "stopped | "
    assert 0 < int(status.group(2)) < 3000
    assert "promoe hit" in status.group(5) and "slots" in status.group(5)
    child.expect("> ")
    child.sendintr()  # at the prompt: a hint, not an exit
    child.expect(r"Ctrl-D or /exit quits")
    child.expect("> ")
    child.sendline("/stats")
    child.expect(r"expert cache \(promoe\): hits (\d+), misses (\d+)")
    assert int(child.match.group(1)) + int(child.match.group(2)) > 0
    child.expect("> ")
    child.sendline("/exit")
    assert _finish(child) == 0


def test_chat_refuses_a_missing_model(tmp_path: Path) -> None:
    child = pexpect.spawn(sys.executable, ["-m", "forecache", "chat", "-m",
                                           str(tmp_path / "none.gguf")], encoding="utf-8",
                          timeout=60)
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 1
    lines = [ln for ln in child.before.splitlines() if ln.strip()]
    assert len(lines) == 1 and "none.gguf" in lines[0], lines

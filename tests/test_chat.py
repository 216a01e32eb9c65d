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


def test_a_message_past_the_models_context_gets_its_limit_not_ctx(tmp_path: Path,
                                                                  tiny_model) -> None:
    # --ctx is capped at the model's own context: the hint is the answer's length, not --ctx
    child = _spawn(tmp_path, "-m", str(tiny_model("q8_0")), "--max-tokens", "5000", "--ctx",
                   "8192")
    child.sendline("hello")
    child.expect(r"forecache: the message \(\d+ tokens\) and an answer of 5000 tokens exceed the "
                 r"context of (\d+); that is the model's own context \(the length it was trained "
                 r"for\): at most \d+ new tokens after this prompt; lower --max-tokens or shorten "
                 r"the prompt\r\n")
    assert "--ctx" not in child.match.group(0)
    child.expect("> ")
    child.sendline("/exit")
    assert _finish(child) == 0


def _cpu_ticks(pid: int) -> int:
    """Clock ticks of CPU time (user + system, every thread) process ``pid`` has used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


@pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="needs Linux's /proc")
def test_ctrl_c_before_the_first_token_keeps_no_empty_answer(tmp_path: Path, tiny_model) -> None:
    """Ctrl-C during a long prefill: no TTFT (there is no token), no empty answer, and the
    message left out of the conversation (said so), which goes on consistently."""
    system = "word " * 3000  # a prefill of some 3000 tokens, seconds of CPU
    child = _spawn(tmp_path, "-m", str(tiny_model("q8_0")), "--max-tokens", "4", "--temp", "0",
                   "--system", system)
    start = _cpu_ticks(child.pid)
    child.sendline("hello")
    # Ctrl-C once the chat is working on the message (rendering or prefilling it): it waits for
    # a line using no CPU; a time limit only guards against a hang
    deadline = time.monotonic() + 120
    while _cpu_ticks(child.pid) < start + 3:
        assert time.monotonic() < deadline, "the chat never started on the message"
        time.sleep(0.002)
    child.sendintr()
    got = child.expect([r"\[interrupted before the first token: no answer \| experts: [^\]]*\]",
                        STATUS])
    assert got == 0, child.match.group(0)
    assert "TTFT" not in child.before + child.match.group(0)
    child.expect(r"\(your message is left out of the conversation; the up arrow brings it back\)")
    child.expect("> ")
    saved = tmp_path / "conv.json"
    child.sendline(f"/save {saved}")
    child.expect(r"saved 1 messages")
    assert [m["role"] for m in json.loads(saved.read_text())["messages"]] == ["system"]
    child.expect("> ")
    child.sendline("/stats")
    child.expect(r"turns: 0, generated tokens: 0")
    child.expect("> ")
    # the next message is answered after the system message alone
    child.sendline("tell me")
    child.expect(STATUS)
    assert child.match.group(1) is None  # not stopped
    child.expect("> ")
    child.sendline(f"/save {saved}")
    child.expect(r"saved 3 messages")
    child.expect("> ")
    child.sendline("/exit")
    assert _finish(child) == 0
    msgs = json.loads(saved.read_text())["messages"]
    assert [(m["role"], m["content"]) for m in msgs[:2]] == [("system", system),
                                                             ("user", "tell me")]
    assert msgs[2]["role"] == "assistant"
    assert "hello" in (tmp_path / "history").read_text()  # the up arrow brings it back

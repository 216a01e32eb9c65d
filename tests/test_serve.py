"""forecache serve through real HTTP clients on loopback."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

PROMPT = "And it came to pass"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _serving(model: Path, *args: str) -> Iterator[str]:
    """`forecache serve` on ``model`` with ``args``: its base URL while it runs; a clean stop."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "forecache", "serve", "-m", str(model),
                             "--port", str(port), "--ctx", "1024", "--threads", "2", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            try:
                if httpx.get(base + "/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server did not start within 60 s"
            time.sleep(0.2)
        yield base
    finally:
        proc.terminate()
        rc = proc.wait(timeout=30)
        err = proc.stderr.read() if proc.stderr else ""
        # SIGTERM: a clean stop, exit 143
        assert rc == 128 + signal.SIGTERM and "Traceback" not in err, (rc, err[-2000:])
        if proc.stdout:
            proc.stdout.close()
        if proc.stderr:
            proc.stderr.close()


@pytest.fixture(scope="module")
def server(tiny_model) -> Iterator[tuple[str, Path]]:
    model = tiny_model("q8_0")
    with _serving(model, "--policy", "lru", "--cache-fraction", "0.5") as base:
        yield base, model


def test_openai_client_models_completion_and_streaming_chat(server, stock) -> None:
    base, model = server
    client = openai.OpenAI(base_url=base + "/v1", api_key="x", timeout=60, max_retries=0)
    assert [m.id for m in client.models.list().data] == [model.stem]

    # (the server's default repeat_penalty is 1.1, create_completion's 1.0)
    done = client.completions.create(model=model.stem, prompt=PROMPT, max_tokens=12,
                                     temperature=0, extra_body={"repeat_penalty": 1.0})
    assert done.choices[0].finish_reason in ("length", "stop")
    assert done.usage.completion_tokens == 12 or done.choices[0].finish_reason == "stop"
    # lossless through the server: the text the unpatched llama.cpp computes for the prompt
    from forecache.llama import Llama

    with Llama(str(model), cache=None, n_ctx=1024, verbose=False) as llm:
        prompt = llm.tokenize(PROMPT.encode(), special=True)
        [(tokens, _)] = stock.run(model, [prompt], 12, n_ctx=1024, n_threads=2)
        want = llm.detokenize(tokens, prev_tokens=prompt).decode(errors="ignore")
    assert done.choices[0].text == want

    stream = client.chat.completions.create(
        model=model.stem, messages=[{"role": "user", "content": "hello"}], max_tokens=16,
        temperature=0, stream=True)
    deltas, finish = [], None
    for chunk in stream:
        if chunk.choices:
            deltas.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    assert "".join(deltas)
    assert finish in ("length", "stop")


def test_speculative_server_answers_as_the_plain_one(server) -> None:
    """--draft: the server's default sampling (repeat penalty 1.1) speculates, and a greedy
    completion is the plain server's."""
    base, model = server
    body = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0}
    want = httpx.post(base + "/v1/completions", json=body, timeout=60).json()
    with _serving(model, "--policy", "lru", "--cache-fraction", "0.5", "--draft",
                  "self-little") as spec:
        got = httpx.post(spec + "/v1/completions", json=body, timeout=60).json()
        stats = httpx.get(spec + "/v1/forecache/stats", timeout=30).json()
    assert got["choices"][0]["text"] == want["choices"][0]["text"]
    assert stats["draft"] == "self-little" and stats["verify_passes"] > 0


def test_stats_endpoint_and_reset(server) -> None:
    base, model = server
    httpx.post(base + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 4},
               timeout=60).raise_for_status()
    stats = httpx.get(base + "/v1/forecache/stats", timeout=30).json()
    assert stats["model"] == model.stem and stats["policy"] == "lru"
    assert stats["hits"] + stats["misses"] > 0 and stats["cache_slots"] > 0
    reset = httpx.post(base + "/v1/forecache/stats/reset", timeout=30).json()
    assert reset["hits"] == reset["misses"] == 0


def test_a_port_in_use_is_one_clear_error(server) -> None:
    base, model = server
    port = base.rsplit(":", 1)[1]
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "-m", "forecache", "serve", "-m", str(model),
                          "--port", port], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ))
    assert res.returncode == 1
    assert res.stderr.strip() == (f"forecache: error: port {port} on 127.0.0.1 is in use: "
                                  "pick another with --port")
    assert time.monotonic() - t0 < 30


def test_concurrent_streams_are_queued_not_emptied(server) -> None:
    """32 streaming chats at once: every answer is complete and equals its answer alone."""
    base, model = server
    client = openai.OpenAI(base_url=base + "/v1", api_key="x", timeout=300, max_retries=0)

    def ask(i: int) -> tuple[str, str | None]:
        stream = client.chat.completions.create(
            model=model.stem, messages=[{"role": "user", "content": f"question {i}"}],
            max_tokens=8, temperature=0, stream=True, extra_body={"repeat_penalty": 1.0})
        text, finish = "", None
        for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
        return text, finish

    alone = [ask(i) for i in range(32)]
    with ThreadPoolExecutor(32) as pool:
        together = list(pool.map(ask, range(32)))
    assert all(finish in ("length", "stop") for _, finish in together), together
    assert together == alone


@pytest.mark.parametrize(("body", "status", "words"), [
    (b"not json", 400, "not JSON"),
    (b"[1, 2]", 400, "JSON object"),
    (b'{"messages": "hi"}', 400, "messages: Input should be a valid list"),
    (b'{"messages": [{"role": "wizard", "content": "hi"}], "max_tokens": 2}', 400, "messages.0"),
    (b'{"messages": [{"role": "user", "content": "x\\ud800y"}], "max_tokens": 2}', 400,
     "lone surrogate"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "logprobs": true}',
     400, "logprobs are not available"),
    (b'{"model": "nope", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}', 404,
     "model 'nope' is not served here"),
    (b'{"prompt": "hi", "max_tokens": -1}', 400, "max_tokens: Input should be greater"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}', 400,
     "max_tokens is -1"),
], ids=["not-json", "array", "wrong-type", "bad-role", "surrogate", "logprobs", "unknown-model",
        "negative-max-tokens", "chat-negative-max-tokens"])
def test_client_errors_are_4xx_with_one_short_line(server, body: bytes, status: int,
                                                   words: str) -> None:
    base, _ = server
    path = "/v1/completions" if b'"prompt"' in body else "/v1/chat/completions"
    r = httpx.post(base + path, content=body, headers={"content-type": "application/json"},
                   timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert words in err["message"] and err["type"] == "invalid_request_error", err
    assert "\n" not in err["message"] and "File " not in err["message"] and len(
        err["message"]) < 300, err["message"]

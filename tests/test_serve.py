"""forecache serve through real HTTP clients on loopback."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial
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
def _serving(model: Path, *args: str, env: dict[str, str] | None = None, key: str | None = None,
             log: list[str] | None = None) -> Iterator[str]:
    """`forecache serve` on ``model`` with ``args`` (and ``env`` added to the environment;
    ``key``: the API key to wait with): its base URL while it runs; a clean stop, after which
    ``log`` gets its stderr."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "forecache", "serve", "-m", str(model),
                             "--port", str(port), "--ctx", "1024", "--threads", "2", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**{k: v for k, v in os.environ.items()
                                    if k != "FORECACHE_API_KEY"}, **(env or {})})
    base = f"http://127.0.0.1:{port}"
    headers = {"authorization": f"Bearer {key}"} if key else {}
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            try:
                if httpx.get(base + "/v1/models", headers=headers,
                             timeout=2).status_code == 200:
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
        if log is not None:
            log.append(err)
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
    (b'{"prompt": "hi", "max_tokens": -1}', 400, "max_tokens is -1; it must be at least 1"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}', 400,
     "max_tokens is -1"),
    (b'{"prompt": "hi", "max_tokens": 0}', 400, "max_tokens is 0; it must be at least 1"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}', 400,
     "max_tokens is 0; it must be at least 1"),
    (b'{"prompt": "hi", "max_completion_tokens": 0}', 400,
     "max_completion_tokens is 0; it must be at least 1"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}', 400,
     "max_completion_tokens is 0; it must be at least 1"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, '
     b'"max_completion_tokens": 4}', 400, "max_tokens (5) and max_completion_tokens (4) differ"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "n": 2}', 400,
     "n is 2; this server answers one choice a request"),
    (b'{"prompt": "hi", "max_tokens": 2, "n": 2}', 400, "n is 2"),
    (b'{"prompt": "hi", "max_tokens": 2, "best_of": 3}', 400, "best_of is 3"),
    (b'{"messages": [], "max_tokens": 2}', 400, "messages is empty"),
    (b'{"max_tokens": 2}', 400, "messages is empty"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": -1}', 400,
     "temperature is -1; it must be between 0 and 2"),
    (b'{"prompt": "hi", "temperature": 2.5}', 400, "temperature is 2.5; it must be between 0"),
    (b'{"prompt": "hi", "temperature": "2.5"}', 400, "temperature is 2.5"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "top_p": 1.5}', 400,
     "top_p is 1.5; it must be between 0 and 1"),
], ids=["not-json", "array", "wrong-type", "bad-role", "surrogate", "logprobs", "unknown-model",
        "negative-max-tokens", "chat-negative-max-tokens", "zero-max-tokens",
        "chat-zero-max-tokens", "zero-max-completion-tokens", "chat-zero-max-completion-tokens",
        "max-tokens-differ", "chat-n", "n", "best-of", "no-messages", "messages-missing",
        "negative-temperature", "high-temperature", "temperature-string", "top-p"])
def test_client_errors_are_4xx_with_one_short_line(server, body: bytes, status: int,
                                                   words: str) -> None:
    base, model = server
    path = "/v1/completions" if b'"prompt"' in body else "/v1/chat/completions"
    r = httpx.post(base + path, content=body, headers={"content-type": "application/json"},
                   timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert words in err["message"] and err["type"] == "invalid_request_error", err
    assert "\n" not in err["message"] and "File " not in err["message"] and len(
        err["message"]) < 300, err["message"]
    assert str(model) not in err["message"], err["message"]


def test_a_json_body_is_read_whatever_its_content_type(server) -> None:
    """`curl -d` (and urllib) label a JSON body as a form: it is read as JSON all the same."""
    base, _ = server
    body = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0}
    want = httpx.post(base + "/v1/completions", json=body, timeout=60).json()
    for ctype in ("application/x-www-form-urlencoded", "text/plain", None):
        r = httpx.post(base + "/v1/completions", content=json.dumps(body).encode(),
                       headers={"content-type": ctype} if ctype else {}, timeout=60)
        assert r.status_code == 200, (ctype, r.text)
        assert r.json()["choices"][0]["text"] == want["choices"][0]["text"]

    chat = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 3}
    req = urllib.request.Request(base + "/v1/chat/completions", data=json.dumps(chat).encode())
    assert req.get_method() == "POST"
    with urllib.request.urlopen(req, timeout=60) as resp:  # Content-Type: a form, as curl's
        assert resp.status == 200
        assert json.load(resp)["choices"][0]["message"]["role"] == "assistant"

    # a real form is still one line
    r = httpx.post(base + "/v1/completions", content=b"prompt=Hi&max_tokens=3",
                   headers={"content-type": "application/x-www-form-urlencoded"}, timeout=60)
    assert r.status_code == 400 and "not JSON" in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("how", ["flag", "env"])
def test_an_api_key_guards_every_endpoint(tiny_model, how: str) -> None:
    """--api-key (or FORECACHE_API_KEY; the flag wins): every endpoint answers 401 with one
    OpenAI-style line unless the request sends `Authorization: Bearer KEY`."""
    model = tiny_model("q8_0")
    key = "sk-forecache-test"
    # the flag's server listens beyond loopback: with a key, no warning
    args, env = (["--api-key", key, "--host", "0.0.0.0"], {"FORECACHE_API_KEY": "other"}) \
        if how == "flag" else ([], {"FORECACHE_API_KEY": key})
    log: list[str] = []
    with _serving(model, *args, env=env, key=key, log=log) as base:
        good = openai.OpenAI(base_url=base + "/v1", api_key=key, timeout=60, max_retries=0)
        assert [m.id for m in good.models.list().data] == [model.stem]
        done = good.chat.completions.create(
            model=model.stem, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert done.usage.completion_tokens > 0

        for wrong in ("wrong", "other"):
            bad = openai.OpenAI(base_url=base + "/v1", api_key=wrong, timeout=60, max_retries=0)
            for call in (partial(bad.models.list),
                         partial(bad.completions.create, model=model.stem, prompt="hi",
                                 max_tokens=2)):
                with pytest.raises(openai.AuthenticationError) as e:
                    call()
                assert e.value.status_code == 401 and e.value.code == "invalid_api_key"

        no_model = {"prompt": "hi", "max_tokens": 2}
        endpoints = [("GET", "/v1/models"), ("GET", "/v1/forecache/stats"),
                     ("POST", "/v1/forecache/stats/reset"), ("POST", "/v1/completions"),
                     ("POST", "/v1/chat/completions"), ("POST", "/v1/embeddings"),
                     ("POST", "/extras/tokenize"), ("GET", "/docs"), ("GET", "/openapi.json")]
        for method, path in endpoints:
            for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": key},
                            {"authorization": "Bearer other"}):
                r = httpx.request(method, base + path, headers=headers, timeout=30,
                                  json=no_model if method == "POST" else None)
                assert r.status_code == 401, (path, headers, r.text)
                err = r.json()["error"]
                assert err["code"] == "invalid_api_key" and "\n" not in err["message"], err
                assert key not in r.text
        ok = {"authorization": f"Bearer {key}"}
        r = httpx.get(base + "/v1/forecache/stats", headers=ok, timeout=30)
        assert r.status_code == 200 and r.json()["model"] == model.stem
        r = httpx.post(base + "/v1/completions", json=no_model, timeout=60,
                       headers={"authorization": f"bearer {key}"})  # the scheme: any case
        assert r.status_code == 200, r.text
    assert "warning" not in log[0], log[0]


def test_a_server_open_to_the_network_without_a_key_warns(tiny_model) -> None:
    from forecache.serve import bind, listens_beyond_loopback

    for host, beyond in (("127.0.0.1", False), ("localhost", False), ("0.0.0.0", True)):
        with contextlib.closing(bind(host, 0)) as sock:
            assert listens_beyond_loopback(sock) is beyond, host
    log: list[str] = []
    with _serving(tiny_model("q8_0"), "--host", "0.0.0.0", log=log) as base:
        assert httpx.get(base + "/v1/models", timeout=30).status_code == 200
    warnings = [line for line in log[0].splitlines() if "warning" in line]
    assert warnings == ["forecache: warning: 0.0.0.0 is not a loopback address and no API key "
                        "is set: anyone on the network can use this server (set --api-key or "
                        "FORECACHE_API_KEY)"], log[0]


def test_unsupported_options_are_400_through_the_client(server) -> None:
    """n, an empty messages list and out-of-range numbers: a 400 naming the field, not an
    answer that ignores it."""
    base, model = server
    client = openai.OpenAI(base_url=base + "/v1", api_key="x", timeout=60, max_retries=0)
    hi = [{"role": "user", "content": "hi"}]
    chat_cases: list[tuple[dict, str]] = [
        ({"n": 2}, "n is 2"), ({"messages": []}, "messages is empty"),
        ({"temperature": 2.5}, "temperature is 2.5"), ({"temperature": -1}, "temperature is -1"),
        ({"max_tokens": 0}, "max_tokens is 0"), ({"top_p": 1.5}, "top_p is 1.5"),
        ({"max_tokens": None, "max_completion_tokens": 0}, "max_completion_tokens is 0"),
        ({"max_tokens": 3, "max_completion_tokens": 4}, "differ")]
    for kwargs, words in chat_cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(**{"model": model.stem, "messages": hi,
                                              "max_tokens": 2, **kwargs})
        assert words in e.value.message, (kwargs, e.value.message)
    for kwargs, words in [({"n": 2}, "n is 2"), ({"best_of": 2}, "best_of is 2"),
                          ({"max_tokens": 0}, "max_tokens is 0"),
                          ({"temperature": -0.5}, "temperature is -0.5")]:
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(**{"model": model.stem, "prompt": "hi", "max_tokens": 2,
                                         **kwargs})
        assert words in e.value.message, (kwargs, e.value.message)


def test_max_completion_tokens_is_max_tokens(server) -> None:
    base, model = server
    client = openai.OpenAI(base_url=base + "/v1", api_key="x", timeout=60, max_retries=0)
    hello = [{"role": "user", "content": "hello"}]
    want = client.chat.completions.create(model=model.stem, messages=hello, max_tokens=4,
                                          temperature=0)
    assert want.choices[0].finish_reason == "length" and want.usage.completion_tokens == 4
    for kwargs in ({"max_completion_tokens": 4}, {"max_completion_tokens": 4, "max_tokens": 4}):
        got = client.chat.completions.create(model=model.stem, messages=hello, temperature=0,
                                             **kwargs)
        assert got.usage.completion_tokens == 4, kwargs
        assert got.choices[0].message.content == want.choices[0].message.content
    r = httpx.post(base + "/v1/completions", timeout=60, json={
        "prompt": PROMPT, "max_completion_tokens": 3, "temperature": 0})
    assert r.json()["usage"]["completion_tokens"] == 3, r.text


def test_stream_options_include_usage_ends_the_stream_with_usage(server) -> None:
    """As OpenAI does: a last chunk with no choices and the usage the answer would give."""
    base, model = server
    client = openai.OpenAI(base_url=base + "/v1", api_key="x", timeout=60, max_retries=0)
    usage = {"include_usage": True}
    hello = [{"role": "user", "content": "hello"}]
    whole = client.chat.completions.create(model=model.stem, messages=hello, max_tokens=6,
                                           temperature=0)
    chunks = list(client.chat.completions.create(model=model.stem, messages=hello, max_tokens=6,
                                                 temperature=0, stream=True,
                                                 stream_options=usage))
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None and last.id == chunks[0].id
    assert all(c.choices and c.usage is None for c in chunks[:-1])
    assert (last.usage.prompt_tokens, last.usage.completion_tokens, last.usage.total_tokens) == \
        (whole.usage.prompt_tokens, whole.usage.completion_tokens, whole.usage.total_tokens)
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == \
        whole.choices[0].message.content

    body = {"model": model.stem, "prompt": PROMPT, "max_tokens": 5, "temperature": 0}
    whole = client.completions.create(**body)
    chunks = list(client.completions.create(**body, stream=True, stream_options=usage))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == \
        whole.usage.completion_tokens and chunks[-1].usage.prompt_tokens == \
        whole.usage.prompt_tokens

    # raw: the usage event comes right before [DONE]; a stream that does not ask has none
    for opts, with_usage in ((usage, True), ({"include_usage": False}, False), (None, False)):
        r = httpx.post(base + "/v1/completions", timeout=60,
                       json={**body, "stream": True, "stream_options": opts})
        events = [line[len("data: "):] for line in r.text.splitlines()
                  if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        found = [json.loads(e) for e in events[:-1] if "usage" in json.loads(e)]
        assert found == ([json.loads(events[-2])] if with_usage else []), r.text
        if with_usage:
            assert found[0]["choices"] == [] and found[0]["object"] == "text_completion"
            assert found[0]["usage"] == {
                "prompt_tokens": whole.usage.prompt_tokens,
                "completion_tokens": whole.usage.completion_tokens,
                "total_tokens": whole.usage.total_tokens}


def test_answers_name_the_model_id_models_lists(server) -> None:
    """Not the file's path: the id of /v1/models, with or without a model in the request."""
    base, model = server
    client = openai.OpenAI(base_url=base + "/v1", api_key="x", timeout=60, max_retries=0)
    [listed] = [m.id for m in client.models.list().data]
    hi = [{"role": "user", "content": "hi"}]
    r = httpx.post(base + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
    assert r.json()["model"] == listed, r.text
    r = httpx.post(base + "/v1/chat/completions", json={"messages": hi, "max_tokens": 2},
                   timeout=60)
    assert r.json()["model"] == listed, r.text
    r = httpx.post(base + "/v1/chat/completions", timeout=60,
                   json={"messages": hi, "max_tokens": 2, "stream": True})
    chunks = [json.loads(line[len("data: "):]) for line in r.text.splitlines()
              if line.startswith("data: {")]
    assert chunks and {c["model"] for c in chunks} == {listed}
    assert client.completions.create(model=str(model), prompt="hi", max_tokens=2).model == listed

    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=hi, max_tokens=2)
    assert f"use {listed!r}" in e.value.message and str(model) not in e.value.message
    assert e.value.code == "model_not_found"


def test_embeddings_are_one_4xx_line_and_not_retried(server) -> None:
    base, model = server
    sent: list[httpx.Request] = []
    http = httpx.Client(event_hooks={"request": [sent.append]}, timeout=60)
    client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=2, http_client=http)
    with pytest.raises(openai.NotFoundError) as e:
        client.embeddings.create(model=model.stem, input="hello")
    assert len(sent) == 1  # a 4xx: the client does not retry
    assert e.value.code == "unsupported" and "embeddings are not served" in e.value.message
    r = httpx.post(base + "/v1/embeddings", content=b'{"input": "hi"}', timeout=60)
    err = r.json()["error"]
    assert r.status_code == 404 and err["code"] == "unsupported" and "\n" not in err["message"]

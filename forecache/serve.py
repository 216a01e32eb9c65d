"""``forecache serve``: llama-cpp-python's OpenAI-compatible server on a ``forecache.Llama``.

The endpoints, request types, streaming and locking are llama-cpp-python's
(``llama_cpp.server.app``); forecache supplies the model (through a ``LlamaProxy`` that loads a
``ServedLlama``), adds ``/v1/forecache/stats``, and puts two ASGI middlewares before the routes:
``ApiKey`` (with a key) and ``ClientErrors``, which answers what llama-cpp-python would answer
with a 500 and a traceback, or silently get wrong, and honours what it drops
(``max_completion_tokens``, ``stream_options.include_usage``).
"""

from __future__ import annotations

import errno
import hmac
import ipaddress
import json
import socket
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from forecache.errors import setting
from forecache.llama import Llama

STATS_PATH = "/v1/forecache/stats"


class PortInUseError(OSError):
    """The address to listen on is taken."""


def _proxy_class(load: Callable[[Any], Llama]) -> type:
    from llama_cpp.server.model import LlamaProxy

    class ForecacheProxy(LlamaProxy):
        """llama-cpp-python's model proxy, loading forecache's Llama instead of the stock one."""

        def load_llama_from_model_settings(self, settings: Any) -> Llama:  # type: ignore[override]
            return load(settings)

    return ForecacheProxy


CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
EMBEDDINGS_PATH = "/v1/embeddings"
# The request bodies the routes read, by path: llama-cpp-python's pydantic request models.
_REQUEST_TYPES = {CHAT_PATH: "CreateChatCompletionRequest",
                  COMPLETIONS_PATH: "CreateCompletionRequest"}
# OpenAI's ranges for numbers llama-cpp-python passes on unchecked or checks otherwise (it
# takes max_tokens 0 as "to the end of the context"): (least, most), None for no bound.
_RANGES: dict[str, tuple[float, float | None]] = {
    "max_tokens": (1, None), "max_completion_tokens": (1, None), "temperature": (0, 2),
    "top_p": (0, 1)}
# Fields llama-cpp-python drops: it answers one choice whatever they ask for.
_ONE_CHOICE = ("n", "best_of")


class RequestError(Exception):
    """A request the client got wrong: its HTTP status, a one-line message, the OpenAI error
    code and the field it names."""

    def __init__(self, status: int, message: str, code: str = "invalid_request",
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param


def error_body(message: str, code: str, param: str | None = None) -> bytes:
    """An OpenAI-style error object, as JSON."""
    return json.dumps({"error": {"message": message, "type": "invalid_request_error",
                                 "param": param, "code": code}}).encode()


async def _answer(send: Any, status: int, body: bytes,
                  headers: tuple[tuple[bytes, bytes], ...] = ()) -> None:
    """Send a whole JSON response."""
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()), *headers]})
    await send({"type": "http.response.body", "body": body})


def _lone_surrogate(value: Any) -> bool:
    """Whether a string anywhere in a decoded JSON value is not valid Unicode."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(value, dict):
        return any(_lone_surrogate(k) or _lone_surrogate(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_lone_surrogate(v) for v in value)
    return False


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check_ranges(values: dict) -> None:
    """Refuse numbers outside OpenAI's ranges, and more than one choice."""
    for key, (least, most) in _RANGES.items():
        v = values.get(key)
        if _is_number(v) and (v < least or (most is not None and v > most)):
            bounds = f"at least {least}" if most is None else f"between {least} and {most}"
            raise RequestError(400, f"{key} is {v}; it must be {bounds}", param=key)
    for key in _ONE_CHOICE:
        v = values.get(key)
        if _is_number(v) and v != 1:
            raise RequestError(400, f"{key} is {v}; this server answers one choice a request, "
                               f"so {key} must be 1", param=key)


def _merge_max_tokens(obj: dict) -> None:
    """Take ``max_completion_tokens`` (OpenAI's current name) as ``max_tokens``, which is the
    only name llama-cpp-python reads."""
    given = obj.pop("max_completion_tokens", None)
    if given is None:
        return
    if not isinstance(given, int) or isinstance(given, bool):
        raise RequestError(400, "max_completion_tokens must be an integer",
                           param="max_completion_tokens")
    if obj.get("max_tokens") is not None and obj["max_tokens"] != given:
        raise RequestError(400, f"max_tokens ({obj['max_tokens']}) and max_completion_tokens "
                           f"({given}) differ; give one", param="max_completion_tokens")
    obj["max_tokens"] = given


def _validate(path: str, obj: dict) -> None:
    """llama-cpp-python's own validation of the body, as one line."""
    import pydantic
    from llama_cpp.server import types

    try:
        req = getattr(types, _REQUEST_TYPES[path]).model_validate(obj)
    except pydantic.ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(x) for x in first["loc"]) or "body"
        more = f" (and {e.error_count() - 1} more)" if e.error_count() > 1 else ""
        raise RequestError(400, f"{where}: {first['msg']}{more}",
                           param=str(first["loc"][0]) if first["loc"] else None) from None
    _check_ranges(req.model_dump())  # numbers given as strings, which pydantic converts


def parse_request(path: str, body: bytes, alias: str, names: set[str]) -> dict:
    """The JSON object of a completion or chat request, checked and ready for llama-cpp-python's
    route (``max_completion_tokens`` as ``max_tokens``, ``model`` the served id); raises
    ``RequestError`` for what llama-cpp-python would answer with a 500 and a traceback, or
    silently get wrong."""
    try:
        obj = json.loads(body)
    except (UnicodeDecodeError, ValueError) as e:
        raise RequestError(400, f"the body is not JSON ({e})", "invalid_json") from None
    if not isinstance(obj, dict):
        raise RequestError(400, "the body must be a JSON object")
    if _lone_surrogate(obj):
        raise RequestError(400, "a string in the body is not valid Unicode (a lone surrogate)")
    _check_ranges(obj)  # before pydantic, whose bounds for max_tokens are not OpenAI's
    _merge_max_tokens(obj)
    _validate(path, obj)
    if path == CHAT_PATH and not obj.get("messages"):
        raise RequestError(400, "messages is empty; give at least one message",
                           param="messages")
    model = obj.get("model")
    if model is not None and model not in names:
        raise RequestError(404, f"model {model!r} is not served here; use {alias!r}",
                           "model_not_found", param="model")
    # answers name the id /v1/models lists (llama-cpp-python's default is the file's path)
    obj["model"] = alias
    if obj.get("logprobs") or obj.get("top_logprobs"):
        raise RequestError(400, "logprobs are not available: this server keeps no per-token "
                           "logits", param="logprobs")
    return obj


def wants_usage(obj: dict) -> bool:
    """Whether a request streams and asks for a last chunk with its usage."""
    options = obj.get("stream_options")
    return bool(obj.get("stream")) and isinstance(options, dict) and \
        options.get("include_usage") is True


@dataclass
class Usage:
    """Tokens of one request, counted as its model generates them."""

    prompt_tokens: int = 0
    completion_tokens: int = 0

    def chunk(self, last: dict) -> bytes:
        """The server-sent event OpenAI ends a stream with when asked for usage: no choices,
        the usage, and the id, object, time and model of the stream's ``last`` chunk."""
        usage = {"prompt_tokens": self.prompt_tokens,
                 "completion_tokens": self.completion_tokens,
                 "total_tokens": self.prompt_tokens + self.completion_tokens}
        fields = {k: last[k] for k in ("id", "object", "created", "model") if k in last}
        return b"data: " + json.dumps({**fields, "choices": [], "usage": usage}).encode() + \
            b"\n\n"


# The usage of the streamed request being served, where it asked for it. A context variable:
# llama-cpp-python generates in worker threads, which run in copies of the request's context.
_USAGE: ContextVar[Usage | None] = ContextVar("forecache_serve_usage", default=None)


class ServedLlama(Llama):
    """``forecache.Llama`` as the server runs it: it counts the tokens of a streamed request
    that asked for usage (llama-cpp-python's streams carry none)."""

    def generate(self, tokens: Any, *args: Any, **kwargs: Any) -> Iterator[int]:
        """``Llama.generate``, counting the prompt and the tokens taken into the answer."""
        gen = super().generate(tokens, *args, **kwargs)
        usage = _USAGE.get()
        if usage is None:
            return (yield from gen)
        usage.prompt_tokens = len(tokens)
        sent = None
        try:
            while True:
                token = gen.send(sent)
                # the end-of-generation token ends an answer without joining it
                if not self.is_eog(token):
                    usage.completion_tokens += 1
                sent = yield token
        except StopIteration as stop:
            return stop.value
        finally:
            gen.close()


def _send_with_usage(send: Any, usage: Usage) -> Any:
    """``send`` for a stream that asked for usage: the usage chunk goes before ``[DONE]``."""
    last: dict = {}

    async def wrapped(message: dict) -> None:
        body = message.get("body", b"") if message["type"] == "http.response.body" else b""
        if body.startswith(b"data: {"):
            last.update(json.loads(body[len(b"data: "):]))
        elif body.startswith(b"data: [DONE]") and last:
            await send({"type": "http.response.body", "body": usage.chunk(last),
                        "more_body": True})
        await send(message)

    return wrapped


def _json_scope(scope: dict, length: int) -> dict:
    """``scope`` with the headers of a JSON body of ``length`` bytes: FastAPI reads a body as
    JSON only when the request says so (curl's default is a form)."""
    headers = [(k, v) for k, v in scope["headers"]
               if k not in (b"content-type", b"content-length")]
    headers += [(b"content-type", b"application/json"),
                (b"content-length", str(length).encode())]
    return {**scope, "headers": headers}


async def _read_body(receive: Any) -> bytes | None:
    """A request's whole body, or None when the client went away first."""
    chunks, more = [], True
    while more:
        msg = await receive()
        if msg["type"] != "http.request":
            return None
        chunks.append(msg.get("body", b""))
        more = msg.get("more_body", False)
    return b"".join(chunks)


class ClientErrors:
    """ASGI middleware: requests a client got wrong (not JSON, not Unicode, invalid fields or
    ranges, an unknown model, logprobs, several choices, embeddings) get a 4xx and a one-line
    OpenAI-style error before they reach llama-cpp-python's routes; nothing internal is shown.
    The others go on as JSON, asking for the served model, with ``max_completion_tokens`` as
    ``max_tokens`` and, where asked for, a usage chunk ending their stream."""

    def __init__(self, app: Any, alias: str, names: set[str]) -> None:
        self.app = app
        self.alias = alias
        self.names = names

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        path = scope.get("path")
        if scope["type"] != "http" or scope.get("method") != "POST" or \
                (path not in _REQUEST_TYPES and path != EMBEDDINGS_PATH):
            await self.app(scope, receive, send)
            return
        body = await _read_body(receive)
        if body is None:  # the client went away
            return
        try:
            if path == EMBEDDINGS_PATH:  # llama-cpp-python's route answers a 500 and a trace
                raise RequestError(404, "embeddings are not served by this server (it loads "
                                   "its model for generation only)", "unsupported")
            obj = parse_request(path, body, self.alias, self.names)
        except RequestError as e:
            await _answer(send, e.status, error_body(e.message, e.code, e.param))
            return
        body = json.dumps(obj).encode()
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        scope = _json_scope(scope, len(body))
        if not wants_usage(obj):
            await self.app(scope, replay, send)
            return
        usage = Usage()
        token = _USAGE.set(usage)
        try:
            await self.app(scope, replay, _send_with_usage(send, usage))
        finally:
            _USAGE.reset(token)


def key_matches(headers: list[tuple[bytes, bytes]], key: str) -> bool:
    """Whether ``headers`` carry ``Authorization: Bearer KEY`` (compared in constant time)."""
    for name, value in headers:
        if name.lower() == b"authorization":
            scheme, _, given = value.decode("latin-1").strip().partition(" ")
            return scheme.lower() == "bearer" and \
                hmac.compare_digest(given.strip().encode(), key.encode())
    return False


class ApiKey:
    """ASGI middleware: every request without ``Authorization: Bearer KEY`` gets a 401 and a
    one-line OpenAI-style error."""

    def __init__(self, app: Any, key: str) -> None:
        self.app = app
        self.key = key

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and not key_matches(scope["headers"], self.key):
            await _answer(send, 401, error_body("missing or wrong API key: send the header "
                                                "'Authorization: Bearer KEY'", "invalid_api_key"),
                          headers=((b"www-authenticate", b"Bearer"),))
            return
        await self.app(scope, receive, send)


def create_app(model_path: str, alias: str, load: Callable[[Any], Llama], *, n_ctx: int = 4096,
               verbose: bool = False, api_key: str | None = None) -> Any:
    """The FastAPI app: llama-cpp-python's routes serving ``load(settings)``'s model under the
    name ``alias``, plus GET ``/v1/forecache/stats`` and POST ``/v1/forecache/stats/reset``;
    with ``api_key``, every request must send ``Authorization: Bearer API_KEY``. ``load``
    should make a ``ServedLlama`` for streams to report their usage."""
    from fastapi import Depends
    from llama_cpp.server.app import create_app as llama_create_app
    from llama_cpp.server.app import get_llama_proxy
    from llama_cpp.server.settings import ModelSettings, ServerSettings
    from starlette.middleware import Middleware

    model = ModelSettings(model=model_path, model_alias=alias, n_ctx=n_ctx, verbose=verbose)
    # interrupt_requests (llama-cpp-python's default) ends a stream as soon as another request
    # waits for the model, which leaves concurrent clients with empty answers: requests queue.
    # Its api_key guards its own routes; ApiKey below guards them all, with OpenAI's error.
    server = ServerSettings(interrupt_requests=False, api_key=api_key)
    app = llama_create_app(server_settings=server, model_settings=[model],
                           proxy_class=_proxy_class(load))

    model_lock = Depends(get_llama_proxy)  # the lock every llama-cpp-python route takes

    @app.get(STATS_PATH, tags=["forecache"])
    async def expert_stats(proxy: Any = model_lock) -> dict:
        """Expert-cache counters since the last reset."""
        return {"model": alias, **proxy().expert_stats()}

    @app.post(STATS_PATH + "/reset", tags=["forecache"])
    async def reset_expert_stats(proxy: Any = model_lock) -> dict:
        """Zero the expert-cache counters."""
        proxy().reset_stats()
        return {"model": alias, **proxy().expert_stats()}

    # Innermost (appended, where add_middleware would put them outermost): inside
    # llama-cpp-python's CORS middleware, so browsers' preflights pass and errors carry its
    # headers.
    if api_key is not None:
        app.user_middleware.append(Middleware(ApiKey, key=api_key))
    app.user_middleware.append(Middleware(ClientErrors, alias=alias, names={alias, model_path}))
    return app


def listens_beyond_loopback(sock: socket.socket) -> bool:
    """Whether ``sock`` takes connections from other machines (any address but loopback)."""
    return not ipaddress.ip_address(sock.getsockname()[0]).is_loopback


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port``, taken before the model loads so a busy port fails at
    once, and handed to the server so nothing can take it in between."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise PortInUseError(f"port {port} on {host} is in use: pick another with "
                                 f"{setting('port')}") from None
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.listen(128)
    return sock


def serve(app: Any, sock: socket.socket) -> None:
    """Serve ``app`` on ``sock`` until Ctrl-C or SIGTERM."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    server.run(sockets=[sock])

"""``forecache serve``: llama-cpp-python's OpenAI-compatible server on a ``forecache.Llama``.

The endpoints, request types, streaming and locking are llama-cpp-python's
(``llama_cpp.server.app``); forecache supplies the model (through a ``LlamaProxy`` that loads a
``forecache.Llama``) and adds ``/v1/forecache/stats``.
"""

from __future__ import annotations

import errno
import json
import socket
from collections.abc import Callable
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


# The request bodies the routes read, by path: llama-cpp-python's pydantic request models.
_REQUEST_TYPES = {"/v1/chat/completions": "CreateChatCompletionRequest",
                  "/v1/completions": "CreateCompletionRequest",
                  "/v1/embeddings": "CreateEmbeddingRequest"}


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


def client_error(path: str, body: bytes, names: set[str]) -> tuple[int, str, str] | None:
    """(status, message, code) for a request body the client got wrong, else None. Checked
    before llama-cpp-python's routes, which answer these with 500 and internal tracebacks."""
    import pydantic
    from llama_cpp.server import types

    try:
        obj = json.loads(body)
    except (UnicodeDecodeError, ValueError) as e:
        return 400, f"the body is not JSON ({e})", "invalid_json"
    if not isinstance(obj, dict):
        return 400, "the body must be a JSON object", "invalid_request"
    if _lone_surrogate(obj):
        return 400, "a string in the body is not valid Unicode (a lone surrogate)", \
            "invalid_request"
    try:
        getattr(types, _REQUEST_TYPES[path]).model_validate(obj)
    except pydantic.ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(x) for x in first["loc"]) or "body"
        more = f" (and {e.error_count() - 1} more)" if e.error_count() > 1 else ""
        return 400, f"{where}: {first['msg']}{more}", "invalid_request"
    for key in ("max_tokens", "max_completion_tokens"):
        n = obj.get(key)
        if isinstance(n, int) and not isinstance(n, bool) and n < 0:
            return 400, f"{key} is {n}; it must be 0 or more", "invalid_request"
    model = obj.get("model")
    if model is not None and model not in names:
        return 404, f"model {model!r} is not served here; use {sorted(names)[0]!r}", \
            "model_not_found"
    if obj.get("logprobs") or obj.get("top_logprobs"):
        return 400, "logprobs are not available: this server keeps no per-token logits", \
            "invalid_request"
    return None


class ClientErrors:
    """ASGI middleware: requests a client got wrong (not JSON, not Unicode, invalid fields, an
    unknown model, logprobs) get a 4xx and a one-line OpenAI-style error before they reach
    llama-cpp-python's routes; nothing internal is shown."""

    def __init__(self, app: Any, names: set[str]) -> None:
        self.app = app
        self.names = names

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST" or \
                scope.get("path") not in _REQUEST_TYPES:
            await self.app(scope, receive, send)
            return
        chunks, more = [], True
        while more:
            msg = await receive()
            if msg["type"] != "http.request":  # the client went away
                return
            chunks.append(msg.get("body", b""))
            more = msg.get("more_body", False)
        body = b"".join(chunks)
        problem = client_error(scope["path"], body, self.names)
        if problem is not None:
            status, message, code = problem
            payload = json.dumps({"error": {"message": message, "type": "invalid_request_error",
                                            "param": None, "code": code}}).encode()
            await send({"type": "http.response.start", "status": status,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(payload)).encode())]})
            await send({"type": "http.response.body", "body": payload})
            return
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


def create_app(model_path: str, alias: str, load: Callable[[Any], Llama], *, n_ctx: int = 4096,
               verbose: bool = False) -> Any:
    """The FastAPI app: llama-cpp-python's routes serving ``load(settings)``'s model under the
    name ``alias``, plus GET ``/v1/forecache/stats`` and POST ``/v1/forecache/stats/reset``."""
    from fastapi import Depends
    from llama_cpp.server.app import create_app as llama_create_app
    from llama_cpp.server.app import get_llama_proxy
    from llama_cpp.server.settings import ModelSettings, ServerSettings

    model = ModelSettings(model=model_path, model_alias=alias, n_ctx=n_ctx, verbose=verbose)
    # interrupt_requests (llama-cpp-python's default) ends a stream as soon as another request
    # waits for the model, which leaves concurrent clients with empty answers: requests queue
    server = ServerSettings(interrupt_requests=False)
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

    app.add_middleware(ClientErrors, names={alias, model_path})
    return app


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

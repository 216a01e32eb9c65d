"""``forecache serve``: llama-cpp-python's OpenAI-compatible server on a ``forecache.Llama``.

The endpoints, request types, streaming and locking are llama-cpp-python's
(``llama_cpp.server.app``); forecache supplies the model (through a ``LlamaProxy`` that loads a
``forecache.Llama``) and adds ``/v1/forecache/stats``.
"""

from __future__ import annotations

import contextlib
import errno
import socket
from collections.abc import Callable, Iterator
from typing import Any

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


@contextlib.contextmanager
def _serving_proxy(load: Callable[[Any], Llama]) -> Iterator[None]:
    # create_app builds its proxy from the module-level name LlamaProxy and offers no hook for
    # another model class: the name is swapped while the app is created.
    import llama_cpp.server.app as server_app

    original = server_app.LlamaProxy
    server_app.LlamaProxy = _proxy_class(load)
    try:
        yield
    finally:
        server_app.LlamaProxy = original


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
    with _serving_proxy(load):
        app = llama_create_app(server_settings=server, model_settings=[model])

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
            raise PortInUseError(f"port {port} on {host} is in use: pick another with --port") \
                from None
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.listen(128)
    return sock


def serve(app: Any, sock: socket.socket) -> None:
    """Serve ``app`` on ``sock`` until Ctrl-C or SIGTERM."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    server.run(sockets=[sock])

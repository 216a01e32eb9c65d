"""``forecache serve``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import click

from forecache.cli.generate_cmd import cache_config, cache_options
from forecache.cli.model_arg import model_option


@click.command("serve")
@model_option()
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=8080, show_default=True, type=click.IntRange(0, 65535),
              help="Port to listen on.")
@click.option("--ctx", "n_ctx", default=4096, show_default=True,
              help="Context length (capped by the model's).")
@click.option("--threads", type=int, default=None, help="CPU threads (default: all cores).")
@click.option("--verbose", is_flag=True, help="Show llama.cpp's own log.")
@cache_options
def serve(model: Path | None, host: str, port: int, n_ctx: int, threads: int | None,
          verbose: bool, **cache_opts: object) -> None:
    """Serve a model over an OpenAI-compatible HTTP API (llama-cpp-python's server).

    /v1/completions, /v1/chat/completions (streaming too) and /v1/models, plus
    GET /v1/forecache/stats (the expert cache's counters) and POST /v1/forecache/stats/reset.
    """
    from forecache.default_model import ensure_default_model
    from forecache.gguf_inspect import require_moe
    from forecache.llama import Llama
    from forecache.serve import bind, create_app
    from forecache.serve import serve as run_server

    path = model if model is not None else ensure_default_model()
    mf = require_moe(path)
    n_ctx = min(n_ctx, int(mf.arch_kv("context_length", n_ctx) or n_ctx))
    cfg = cache_config(**cache_opts)  # type: ignore[arg-type]
    threads = threads or os.cpu_count() or 1
    sock = bind(host, port)  # before the model loads: a busy port fails at once
    try:
        def load(settings: Any) -> Llama:
            return Llama(settings.model, cache=cfg, n_ctx=n_ctx, n_threads=threads,
                         n_threads_batch=threads, chat_format=settings.chat_format,
                         verbose=verbose)

        app = create_app(str(path), path.stem, load, n_ctx=n_ctx, verbose=verbose)
        port = sock.getsockname()[1]
        click.echo(f"forecache: serving {path.stem} on http://{host}:{port}/v1 (policy "
                   f"{cfg.policy if cfg else 'none'}); Ctrl-C stops", err=True)
        run_server(app, sock)
    finally:
        sock.close()


COMMANDS = [serve]

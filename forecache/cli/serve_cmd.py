"""``forecache serve``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from forecache.cli.generate_cmd import (
    cache_config,
    cache_options,
    open_args,
    say_choice,
    threads_option,
    ubatch_args,
    ubatch_option,
)
from forecache.cli.model_arg import model_option


@click.command("serve")
@model_option(default="default")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=8080, show_default=True, type=click.IntRange(0, 65535),
              help="Port to listen on.")
@click.option("--ctx", "n_ctx", default=4096, show_default=True,
              help="Context length (capped by the model's).")
@threads_option
@click.option("--verbose", is_flag=True, help="Show llama.cpp's own log.")
@ubatch_option
@cache_options
def serve(model: Path, host: str, port: int, n_ctx: int, threads: int | None,
          verbose: bool, ubatch: int | None, **cache_opts: object) -> None:
    """Serve a model over an OpenAI-compatible HTTP API (llama-cpp-python's server).

    /v1/completions, /v1/chat/completions (streaming too) and /v1/models, plus
    GET /v1/forecache/stats (the expert cache's counters) and POST /v1/forecache/stats/reset.
    """
    from forecache.gguf.header import require_moe
    from forecache.llama import Llama
    from forecache.serve import bind, create_app
    from forecache.serve import serve as run_server

    require_moe(model)  # a bad model fails before the port is taken
    spec = open_args(cache_opts)
    cfg = cache_config(**cache_opts)  # type: ignore[arg-type]
    sock = bind(host, port)  # before the model loads: a busy port fails at once
    policy = [cfg.policy if cfg else "none"]  # what the loaded model runs (the default chooses)
    try:
        def load(settings: Any) -> Llama:
            llm = Llama.open(settings.model, cache=cfg, n_ctx=n_ctx, n_threads=threads,
                             chat_format=settings.chat_format, verbose=verbose,
                             **ubatch_args(ubatch), **spec)
            say_choice(llm)
            policy[0] = llm.cache_config.policy if llm.cache_config else "none"
            return llm

        app = create_app(str(model), model.stem, load, n_ctx=n_ctx, verbose=verbose)
        port = sock.getsockname()[1]
        click.echo(f"forecache: serving {model.stem} on http://{host}:{port}/v1 (policy "
                   f"{policy[0]}); Ctrl-C stops", err=True)
        run_server(app, sock)
    finally:
        sock.close()


COMMANDS = [serve]

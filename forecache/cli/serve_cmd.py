"""``forecache serve``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from forecache.cli.generate_cmd import (
    cache_options,
    cli_options,
    say_choice,
    threads_option,
    ubatch_args,
    ubatch_option,
)
from forecache.cli.model_arg import model_option
from forecache.placement.options import DEFAULT_POLICY


@click.command("serve")
@model_option(default="default")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=8080, show_default=True, type=click.IntRange(0, 65535),
              help="Port to listen on.")
@click.option("--api-key", envvar="FORECACHE_API_KEY", show_envvar=True, default=None,
              help="Answer only requests sending 'Authorization: Bearer KEY' (401 otherwise).")
@click.option("--ctx", "n_ctx", default=4096, show_default=True,
              help="Context length (capped by the model's).")
@threads_option
@click.option("--verbose", is_flag=True, help="Show llama.cpp's own log.")
@ubatch_option
@cache_options
def serve(model: Path, host: str, port: int, api_key: str | None, n_ctx: int,
          threads: int | None, verbose: bool, ubatch: int | None,
          **cache_opts: object) -> None:
    """Serve a model over an OpenAI-compatible HTTP API (llama-cpp-python's server).

    /v1/completions, /v1/chat/completions (streaming too) and /v1/models, plus
    GET /v1/forecache/stats (the expert cache's counters) and POST /v1/forecache/stats/reset.
    With --api-key (or FORECACHE_API_KEY), every request must send 'Authorization: Bearer KEY'.
    """
    from forecache.gguf.header import require_moe
    from forecache.llama import Llama
    from forecache.serve import ServedLlama, bind, create_app, listens_beyond_loopback
    from forecache.serve import serve as run_server

    if api_key is not None and not api_key.strip():
        raise click.BadParameter("the key is empty", param_hint="--api-key")
    require_moe(model)  # a bad model fails before the port is taken
    options = cli_options(cache_opts)
    cfg = options.cache_config()  # bad options fail before the port is taken
    sock = bind(host, port)  # before the model loads: a busy port fails at once
    # what the loaded model runs (until it has loaded: the default's own, which it may change)
    policy = [(cfg.policy or DEFAULT_POLICY) if cfg else "none"]
    try:
        def load(settings: Any) -> Llama:
            llm = ServedLlama.open(settings.model, options=options, n_ctx=n_ctx,
                                   n_threads=threads, chat_format=settings.chat_format,
                                   verbose=verbose, **ubatch_args(ubatch))
            say_choice(llm)
            policy[0] = llm.cache_config.policy if llm.cache_config else "none"
            return llm

        app = create_app(str(model), model.stem, load, n_ctx=n_ctx, verbose=verbose,
                         api_key=api_key)
        port = sock.getsockname()[1]
        click.echo(f"forecache: serving {model.stem} on http://{host}:{port}/v1 (policy "
                   f"{policy[0]}); Ctrl-C stops", err=True)
        if api_key is None and listens_beyond_loopback(sock):
            click.echo(f"forecache: warning: {host} is not a loopback address and no API key is "
                       "set: anyone on the network can use this server (set --api-key or "
                       "FORECACHE_API_KEY)", err=True)
        run_server(app, sock)
    finally:
        sock.close()


COMMANDS = [serve]

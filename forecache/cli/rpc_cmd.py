"""``forecache rpc-server``: this machine's CPU as a device of another forecache (``--rpc``)."""

from __future__ import annotations

import os

import click


@click.command("rpc-server")
@click.argument("endpoint", metavar="HOST:PORT")
@click.option("--threads", type=click.IntRange(1, 512), default=None,
              help="Threads the served CPU computes with (default: every core).")
def rpc_server(endpoint: str, threads: int | None) -> None:
    """Serve this machine's CPU on HOST:PORT through llama.cpp's RPC backend, until stopped: a
    forecache given `--rpc HOST:PORT` computes layers here (llama.cpp's rpc-server, without a
    binary of its own). Listen on 127.0.0.1 unless the network between the machines is
    trusted: the protocol has no authentication."""
    from forecache.native.rpc import parse_endpoints, serve

    try:
        parse_endpoints(endpoint)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="HOST:PORT") from None
    serve(endpoint, threads or os.cpu_count() or 1)


COMMANDS = [rpc_server]

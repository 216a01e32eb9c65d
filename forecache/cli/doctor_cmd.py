"""``forecache doctor``: build, devices and bandwidths."""

from __future__ import annotations

import json

import click


@click.command("doctor")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option("--no-measure", is_flag=True, help="Skip the bandwidth measurements.")
@click.option("--probe-mib", default=256, show_default=True,
              help="Size of each bandwidth probe copy in MiB.")
@click.option("--rpc", default=None, metavar="HOST:PORT[,...]",
              help="Also report these RPC servers' devices and the copy rate to each through "
                   "the network (what a run with --rpc copies experts at).")
def doctor(as_json: bool, no_measure: bool, probe_mib: int, rpc: str | None) -> None:
    """Report the llama.cpp build, patch series, devices and measured bandwidths."""
    from forecache.doctor import collect, format_report
    from forecache.native.rpc import RPCError, add_servers, parse_endpoints

    if rpc:
        try:
            add_servers(parse_endpoints(rpc))
        except RPCError as e:
            raise ValueError(str(e)) from e
    report = collect(measure=not no_measure, probe_bytes=probe_mib << 20)
    click.echo(json.dumps(report, indent=2) if as_json else format_report(report))


COMMANDS = [doctor]

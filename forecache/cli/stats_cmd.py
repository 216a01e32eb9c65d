"""``forecache routing-stats``: how a trace's routing compares with real MoE models'."""

from __future__ import annotations

from pathlib import Path

import click

from forecache.trace.format import TraceFile


@click.command("routing-stats")
@click.argument("trace_path", metavar="TRACE.npz", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the whole report as JSON.")
@click.option("--per-layer", is_flag=True, help="Also print one row per MoE layer and layer pair.")
def routing_stats_cmd(trace_path: Path, as_json: bool, per_layer: bool) -> None:
    """Load balance, per-request skew, expert reuse and cross-layer agreement of a trace.

    Works on traces from `forecache trace` and on the shared format. Real models are balanced
    over a workload (load entropy near 1) but skewed within a request (lower request entropy,
    reuse above the independent expectation, agreement well above 0).
    """
    from forecache.trace.stats import dumps, routing_stats

    with TraceFile(trace_path) as tr:
        stats = routing_stats(tr)
    if as_json:
        click.echo(dumps(stats))
        return
    click.echo(stats.header())
    click.echo(stats.table(per_layer=per_layer))


COMMANDS = [routing_stats_cmd]

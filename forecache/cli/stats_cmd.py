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


@click.command("synth-trace")
@click.option("--like", "like", required=True, type=click.Path(path_type=Path),
              help="Real trace whose routing statistics the synthetic one matches (same expert "
                   "count and top-k as the shape).")
@click.option("--shape", required=True, help="models.yaml model to write routing for, e.g. "
              "qwen2-57b-a14b.")
@click.option("--out", required=True, type=click.Path(path_type=Path), help="Trace file (.npz).")
@click.option("--requests", "n_requests", type=click.IntRange(1, 10_000), default=8,
              show_default=True)
@click.option("--prefill", type=click.IntRange(0, 1 << 20), default=512, show_default=True,
              help="Prompt tokens of each request.")
@click.option("--decode", type=click.IntRange(0, 1 << 20), default=128, show_default=True,
              help="Generated tokens of each request.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--force", is_flag=True, help="Overwrite an existing trace file.")
def synth_trace_cmd(like: Path, shape: str, out: Path, n_requests: int, prefill: int,
                    decode: int, seed: int, force: bool) -> None:
    """Write a synthetic routing trace at a model's shape, fitted to a real trace's statistics.

    For replaying routing at shapes no public trace has (the simulator's target, Qwen2-57B-A14B).
    The fit matches load and request entropy, reuse within 1, 4 and 16 tokens, and cross-layer
    agreement; the file's meta says it is synthetic, what it was fitted to and how close it came.
    """
    import json

    from forecache.trace import synth
    from forecache.trace.stats import routing_stats

    if out.exists() and not force:
        raise click.UsageError(f"{out} exists; pass --force to overwrite it")
    if prefill + decode == 0:
        raise click.BadParameter("a request needs at least one token", param_hint="--prefill")
    try:
        reqs, meta = synth.synthesize_like(
            like, shape, n_requests=n_requests, prefill=prefill, decode=decode, seed=seed,
            progress=lambda s: click.echo(f"[fit] {s}", err=True))
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    spec_layers, top_k = reqs[0].experts.shape[1:]
    targets, params = meta["targets"], meta["params"]
    tmp = out.with_name(out.stem + ".partial.npz")
    synth.write_trace(tmp, reqs, meta)
    tmp.replace(out)
    with TraceFile(out) as tr:
        got = synth.target_values(routing_stats(tr).summary())
    click.echo(f"wrote {out}: {n_requests} requests of {prefill} + {decode} tokens at "
               f"{shape}'s shape ({spec_layers} layers, top-{top_k} of {meta['n_expert']})")
    click.echo(f"{'figure':<18} {like.name[:24]:>24} {'synthetic':>10}")
    for k, v in targets.items():
        click.echo(f"{k:<18} {v:>24.3f} {got[k]:>10.3f}")
    click.echo("parameters: " + json.dumps(params))


COMMANDS = [routing_stats_cmd, synth_trace_cmd]

"""``forecache routing-stats``: how a trace's routing compares with real MoE models'."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import click
import numpy as np

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

    from forecache.gguf.specs import get_spec
    from forecache.trace import synth
    from forecache.trace.stats import routing_stats

    if out.exists() and not force:
        raise click.UsageError(f"{out} exists; pass --force to overwrite it")
    if prefill + decode == 0:
        raise click.BadParameter("a request needs at least one token", param_hint="--prefill")
    spec = get_spec(shape)
    with TraceFile(like) as tr:
        real = routing_stats(tr)
        units = [len(u) for u in tr.units()]
    if (real.n_expert, real.top_k) != (spec.experts, spec.top_k):
        raise click.UsageError(
            f"{like.name} routes top-{real.top_k} of {real.n_expert} experts but {shape} routes "
            f"top-{spec.top_k} of {spec.experts}: fit to a trace with the same expert count and "
            "top-k")
    targets = synth.target_values(real.summary())
    # fit on as many requests as long as the real ones: request entropy depends on the length,
    # and the agreement figures on the number of tokens
    tokens = int(min(512, max(64, np.median(units))))
    params, reached = synth.fit(targets, n_expert=spec.experts, top_k=spec.top_k, tokens=tokens,
                                n_requests=min(len(units), 8), seed=seed,
                                progress=lambda s: click.echo(f"[fit] {s}", err=True))
    reqs = synth.synthesize(params, n_layers=spec.layers, n_expert=spec.experts,
                            top_k=spec.top_k, tokens=[prefill + decode] * n_requests,
                            prefill=[prefill] * n_requests, seed=seed + 1)
    meta = {"n_expert": spec.experts, "preset": spec.name, "synthetic": True,
            "fitted_to": like.name, "params": dataclasses.asdict(params), "targets": targets,
            "fit_reached": reached, "seed": seed}
    tmp = out.with_name(out.stem + ".partial.npz")
    synth.write_trace(tmp, reqs, meta)
    tmp.replace(out)
    with TraceFile(out) as tr:
        got = synth.target_values(routing_stats(tr).summary())
    click.echo(f"wrote {out}: {n_requests} requests of {prefill} + {decode} tokens at "
               f"{spec.name}'s shape ({spec.layers} layers, top-{spec.top_k} of {spec.experts})")
    click.echo(f"{'figure':<18} {like.name[:24]:>24} {'synthetic':>10}")
    for k, v in targets.items():
        click.echo(f"{k:<18} {v:>24.3f} {got[k]:>10.3f}")
    click.echo("parameters: " + json.dumps(dataclasses.asdict(params)))


COMMANDS = [routing_stats_cmd, synth_trace_cmd]

"""``forecache bench``: every placement policy on the same prompts, side by side."""

from __future__ import annotations

import json
from pathlib import Path

import click

from forecache.cache.budget import parse_size
from forecache.cache.registry import POLICIES
from forecache.cli.generate_cmd import threads_option
from forecache.cli.model_arg import model_option


@click.command("bench")
@model_option(required=True)
@click.option("--policies", default=",".join(POLICIES), show_default=True,
              help="Comma-separated policies to run; also all-gpu (every layer on the GPU, no "
                   "cache), ncmoe-mmap (--n-cpu-moe with mmap'd host weights; ncmoe itself "
                   "loads them as --no-mmap does) and default (what a run without --policy "
                   "chooses, reported with why).")
@click.option("--gpu-budget", default=None, help="Device memory for each run (e.g. 24GiB).")
@click.option("--cache-fraction", type=float, default=None,
              help="Share of experts in slots (instead of --gpu-budget; ncmoe needs a budget).")
@click.option("--prompt-len", default=512, show_default=True, help="Prompt tokens.")
@click.option("--gen", "n_gen", default=128, show_default=True, help="Generated tokens.")
@click.option("--prompts", "n_prompts", default=3, show_default=True, help="Prompts per policy.")
@threads_option
@click.option("--ablation", is_flag=True,
              help="ProMoE's ablation instead: lru, then promoe's techniques added one by one.")
@click.option("--rates", default=None,
              help="Cache-rate sweep instead: comma-separated shares of experts in slots "
                   "(e.g. 0.25,0.4,0.55,0.7,0.85), for --policies.")
@click.option("--routing-trace", type=click.Path(path_type=Path), default=None,
              help="Replay this trace's routing in every run (a real model's, or synth-trace's "
                   "fitted to one) instead of the model's router: the tokens are meaningless.")
@click.option("--timeline", is_flag=True,
              help="Record each cached run's timeline (ids read back, gates, waits for copies, "
                   "CPU expert compute, expert groups, copies) and report it per layer.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def bench(model: Path, policies: str, gpu_budget: str | None, cache_fraction: float | None,
          prompt_len: int, n_gen: int, n_prompts: int, threads: int | None, ablation: bool,
          rates: str | None, routing_trace: Path | None, timeline: bool, as_json: bool) -> None:
    """Run each policy on the same prompts; report TTFT, TPOT, hit rate, H2D and ratios."""
    from forecache.bench import (
        DEFAULT_RUN,
        STOCK_RUNS,
        format_ablation,
        format_rates,
        format_table,
        run_ablation,
        run_bench,
        run_rates,
    )

    names = [p.strip() for p in policies.split(",") if p.strip()]
    known = (*POLICIES, *STOCK_RUNS, DEFAULT_RUN)
    bad = [p for p in names if p not in known]
    if bad or not names:
        raise click.BadParameter(f"unknown policy {', '.join(bad) or '(none)'}; choose from "
                                 f"{', '.join(known)}", param_hint="--policies")
    if ablation and rates:
        raise click.UsageError("give --ablation or --rates, not both")
    if (routing_trace is not None or timeline) and (ablation or rates):
        raise click.UsageError("--routing-trace and --timeline go with the policy table, not "
                               "--ablation or --rates")
    if routing_trace is not None and not routing_trace.is_file():
        raise click.BadParameter(f"{routing_trace} does not exist: give a trace from "
                                 "`forecache trace` or `forecache synth-trace`",
                                 param_hint="--routing-trace")
    progress = lambda s: click.echo(s, err=True)  # noqa: E731
    if rates is not None:
        try:
            shares = [float(x) for x in rates.split(",") if x.strip()]
        except ValueError:
            raise click.BadParameter(f"not a list of numbers: {rates}",
                                     param_hint="--rates") from None
        if not shares or any(not 0 < x <= 1 for x in shares):
            raise click.BadParameter("shares must be in (0, 1]", param_hint="--rates")
        names = [p for p in names if p != "ncmoe"]  # ncmoe places by budget, not by share
        rep = run_rates(model, shares, names, prompt_len=prompt_len, n_gen=n_gen,
                        n_prompts=n_prompts, n_threads=threads, progress=progress)
        click.echo(json.dumps(rep) if as_json else format_rates(rep))
        return
    if gpu_budget is None and cache_fraction is None:
        raise click.UsageError("give --gpu-budget or --cache-fraction")
    if prompt_len < 1 or n_gen < 2 or n_prompts < 1:
        raise click.UsageError("--prompt-len and --prompts must be >= 1 and --gen >= 2")
    budget = parse_size(gpu_budget) if gpu_budget else None
    if ablation:
        rep = run_ablation(model, gpu_budget=budget, cache_fraction=cache_fraction,
                           prompt_len=prompt_len, n_gen=n_gen, n_prompts=n_prompts,
                           n_threads=threads, progress=progress)
        click.echo(json.dumps(rep) if as_json else format_ablation(rep))
        return
    report = run_bench(model, names, gpu_budget=budget,
                       cache_fraction=cache_fraction, prompt_len=prompt_len, n_gen=n_gen,
                       n_prompts=n_prompts, n_threads=threads, routing_trace=routing_trace,
                       timeline=timeline,
                       progress=progress)
    click.echo(json.dumps(report) if as_json else format_table(report))
    if report["errors"]:
        raise click.ClickException(f"{len(report['errors'])} of {len(names)} runs failed: "
                                   + "; ".join(f"{k}: {v}" for k, v in report["errors"].items()))


COMMANDS = [bench]

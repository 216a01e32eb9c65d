"""``forecache batch``: JSONL requests in, JSONL results out, resumable (the job itself is
``forecache.jobs.run.run_job``; here its options, progress bar, summary and exit status)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from forecache.cli.generate_cmd import (
    cache_config,
    cache_options,
    open_args,
    say_choice,
    threads_option,
)
from forecache.cli.model_arg import model_option
from forecache.jobs.run import JobProgress
from forecache.native.libs import MAX_SEQUENCES

if TYPE_CHECKING:
    from forecache.llama import Llama


class BatchFailed(click.ClickException):
    """Some requests ended as error records; the job itself ran to the end."""

    def show(self, file: object = None) -> None:
        click.echo(f"forecache: error: {self.message}", err=True)


class _Progress(JobProgress):
    """The job's notes on stderr, and its progress bar there when ``show``."""

    def __init__(self, show: bool) -> None:
        self.show = show
        self.bar: Any = None

    def note(self, text: str) -> None:
        click.echo(f"forecache: {text}", err=True)

    def started(self, llm: Llama, n_requests: int) -> None:
        from tqdm import tqdm

        say_choice(llm)
        # redrawn at each record written: tqdm's default redraws at most every 0.1 s and skips
        # the records written between, leaving the bar behind the output until the next one
        self.bar = tqdm(total=n_requests, unit="req", disable=not self.show, file=sys.stderr,
                        dynamic_ncols=True, mininterval=0, miniters=1)

    def token(self, generated: int, elapsed_s: float) -> None:
        self.bar.set_postfix_str(f"{generated / elapsed_s:.1f} tokens/s" if elapsed_s else "",
                                 refresh=False)

    def record(self, record: dict) -> None:
        self.bar.update(1)

    def finished(self) -> None:
        if self.bar is not None:
            self.bar.close()


@click.command("batch")
@model_option(required=True)
@click.option("--input", "input_path", type=click.Path(path_type=Path), required=True,
              help='JSONL requests: {"id", "prompt" | "messages", "max_tokens", "temperature", '
                   '"top_p", "top_k", "min_p", "seed", "stop"} a line.')
@click.option("--output", "output_path", type=click.Path(path_type=Path), required=True,
              help="JSONL results, appended as requests finish; ids already there are skipped. "
                   "Once every request is there, the file is put in input order.")
@click.option("--plan", "plan_text", default=None, metavar="auto|seq=N,ubatch=U[,kv=host]",
              help="How the job runs: auto (the default) measures this machine once per model "
                   "and picks the sequences decoded together, the ubatch, where the KV cache "
                   "lives and, with no --policy, the expert placement that a roofline model "
                   "predicts fastest for these requests (`forecache plan` lists them); or a plan "
                   "such as seq=16,ubatch=512,kv=host[,experts=cache|ncmoe][,micro=M] "
                   "(micro=M, 2 to 4: the prompts fed in M-1 llama.cpp contexts of their own, "
                   "each step's prompt ubatches going through each layer beside the decoding "
                   "sequences' ubatch, one prompt-bank fill serving them all).")
@click.option("--parallel", default=None, type=click.IntRange(1, MAX_SEQUENCES),
              help="Sequences decoded together in one llama.cpp batch, ubatch 512 (a "
                   "hand-picked plan, instead of --plan).")
@click.option("--max-tokens", default=128, show_default=True, type=click.IntRange(1),
              help="max_tokens of requests that do not give one.")
@click.option("--ctx-per-seq", default=2048, show_default=True, type=click.IntRange(16),
              help="Context of each sequence (prompt + answer); capped by the model's.")
@threads_option
@click.option("--progress/--no-progress", default=None,
              help="Progress bar on stderr (default: when stderr is a terminal).")
@click.option("--verbose", is_flag=True, help="Show llama.cpp's own log.")
@cache_options
def batch(model: Path, input_path: Path, output_path: Path, plan_text: str | None,
          parallel: int | None, max_tokens: int, ctx_per_seq: int, threads: int | None,
          progress: bool | None, verbose: bool, **cache_opts: object) -> None:
    """Run every request of a JSONL file, appending one JSON result a line to OUTPUT.

    Temperature 0 is greedy; a sampled request draws from its own "seed". A record says
    "batched": true when its request shared llama.cpp passes with others, whose kernels round
    its logits otherwise: decoded again beside other requests, its text may differ (README). A
    malformed line becomes an error record and the job goes on; fixed and run again, its
    request's record replaces the error. A killed job is resumed by running the same command
    again. The longest requests start first; once every request is in OUTPUT, its records are
    put in the input's order. Exit 1 while a line of the input has an error record in OUTPUT.
    """
    from forecache.jobs.plan import plan_cache
    from forecache.jobs.run import check_job, run_job
    from forecache.roofline.batch import BatchPlan

    spec = open_args(cache_opts)
    if plan_text is not None and parallel is not None:
        raise click.UsageError("give --plan or --parallel, not both")
    plan = None
    if plan_text is not None and plan_text != "auto":
        try:
            plan = BatchPlan.parse(plan_text)
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--plan") from None
    elif parallel is not None:
        plan = BatchPlan(parallel, 512)
    elif "rpc" in spec:  # the plans are predicted for one local device
        plan = BatchPlan(1, 512)
        click.echo("forecache: --rpc: one sequence at a time, ubatch 512 (--parallel N for "
                   "more)", err=True)
    try:
        check_job(input_path, output_path, spec.get("draft"))
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    cfg = cache_config(**cache_opts)  # type: ignore[arg-type]
    if plan is not None and parallel is None:  # --parallel keeps the placement options' own
        try:
            cfg = plan_cache(cfg, plan)
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--plan") from None
    shown = _Progress(progress if progress is not None else sys.stderr.isatty())
    res = run_job(model, input_path, output_path, cache=cfg, plan=plan, max_tokens=max_tokens,
                  ctx_per_seq=ctx_per_seq, n_threads=threads, verbose=verbose, progress=shown,
                  **spec)
    click.echo(f"forecache: {res.summary()}", err=True)
    if res.interrupted:
        click.echo(f"forecache: interrupted: {res.done + res.skipped} of {res.total} done; rerun "
                   "the same command to resume", err=True)
        sys.exit(128 + res.interrupted)
    if res.failed:
        raise BatchFailed(f"{res.failed} of {res.total} requests failed (see {output_path})")


COMMANDS = [batch]

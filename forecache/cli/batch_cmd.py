"""``forecache batch``: JSONL requests in, JSONL results out, resumable."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import click

from forecache.cli.generate_cmd import (
    cache_config,
    cache_options,
    open_args,
    say_choice,
    threads_option,
)
from forecache.cli.model_arg import model_option
from forecache.native.libs import MAX_SEQUENCES


def rates_text(generated: int, wall_s: float, decode_rates: list[float]) -> str:
    """The summary's speeds, each named: the job's (its generated tokens over its wall time
    after the model loaded, the prompts' prefill and every wait included) and the range of the
    records' own decode rates (``timings.tokens_per_s``: a request's tokens after its first,
    over their time), which leave its prefill and every other request out."""
    text = (f"{generated} tokens in {wall_s:.1f} s: {generated / wall_s:.1f} tokens/s over "
            "the job's wall time (prefill included)")
    if decode_rates:
        lo, hi = min(decode_rates), max(decode_rates)
        span = f"{lo:.1f}" if lo == hi else f"{lo:.1f}-{hi:.1f}"
        text += (f"; each request decoded {span} tokens/s after its first token (its record's "
                 "tokens_per_s)")
    return text


class BatchFailed(click.ClickException):
    """Some requests ended as error records; the job itself ran to the end."""

    def show(self, file: object = None) -> None:
        click.echo(f"forecache: error: {self.message}", err=True)


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
                   "such as seq=16,ubatch=512,kv=host[,experts=cache|ncmoe].")
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
    from tqdm import tqdm

    from forecache.batch import (
        OutputWriter,
        decode_many,
        done_ids,
        prompt_lengths,
        rewrite_in_input_order,
    )
    from forecache.chat import mobile_summary, spec_summary
    from forecache.gguf.header import require_moe
    from forecache.interrupt import deferred_signals
    from forecache.jobs.plan import choose_plan, plan_cache
    from forecache.jobs.requests import read_requests
    from forecache.llama import Llama
    from forecache.roofline.batch import Plan
    from forecache.speculative.speculator import SELF_DRAFTS

    spec = open_args(cache_opts)
    if plan_text is not None and parallel is not None:
        raise click.UsageError("give --plan or --parallel, not both")
    plan = None
    if plan_text is not None and plan_text != "auto":
        try:
            plan = Plan.parse(plan_text)
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--plan") from None
    elif parallel is not None:
        plan = Plan(parallel, 512)
    elif "rpc" in spec:  # the plans are predicted for one local device
        plan = Plan(1, 512)
        click.echo("forecache: --rpc: one sequence at a time, ubatch 512 (--parallel N for "
                   "more)", err=True)
    if "draft" in spec and spec["draft"] not in SELF_DRAFTS:
        raise click.UsageError(f"--draft {spec['draft']}: a batch job drafts with the model's "
                               f"own little pass only ({' or '.join(SELF_DRAFTS)})")
    if output_path.resolve() == input_path.resolve():
        raise click.UsageError("--output must not be the --input file")
    cfg = cache_config(**cache_opts)  # type: ignore[arg-type]
    if plan is not None and parallel is None:  # --parallel keeps the placement options' own
        try:
            cfg = plan_cache(cfg, plan)
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--plan") from None
    requests, bad = read_requests(input_path, max_tokens)
    require_moe(model)  # before OUT is touched
    done, done_failed, cut = done_ids(output_path)
    total = len(requests) + len(bad)
    if cut:
        click.echo(f"forecache: dropped a half-written last record of {output_path}; it will be "
                   "redone", err=True)
    # a fixed line without an id of its own takes its line's id, which its error record holds:
    # that record stands for no request now, so the request runs and its record supersedes it
    redo = {r.id for r in requests if r.id == f"line-{r.line}" and r.id in done_failed}
    todo = [r for r in requests if r.id not in done or r.id in redo]
    # every id of the input, in the order of its lines: the output's order once it is complete
    order = [rid for _, rid in sorted([(r.line, r.id) for r in requests]
                                      + [(b["line"], b["id"]) for b in bad])]
    ids = set(order)
    bad = [b for b in bad if b["id"] not in done]
    # a resumed job still reports the failures it wrote before, but not those of fixed lines
    failed = len((done_failed & ids) - redo)
    if total - len(todo) - len(bad):
        click.echo(f"forecache: {total - len(todo) - len(bad)} of {total} requests are already "
                   f"in {output_path}; skipping them", err=True)
    skipped = total - len(todo) - len(bad) - failed  # done before, not failed
    writer = OutputWriter(output_path)
    by_line = {r.line: r.id for r in requests}  # a fixed line's error record is left out

    def finish_in_order() -> None:
        writer.close()  # nothing more to append; the rewrite replaces the file
        rewrite_in_input_order(output_path, order, by_line)

    try:
        for record in bad:
            writer.write(record)
            failed += 1
        if not todo:
            finish_in_order()
            click.echo(f"forecache: nothing to do ({total} requests, {skipped} done, "
                       f"{failed} failed)", err=True)
            if failed:
                raise BatchFailed(f"{failed} of {total} requests failed (see {output_path})")
            return
        if plan is None:  # auto: the plan the model predicts fastest for these requests
            lens = prompt_lengths(model, todo)
            per_seq = require_moe(model).fit_context(ctx_per_seq)
            chosen = choose_plan(model, cfg, lens, [r.max_tokens for r in todo], per_seq,
                                 n_threads=threads, progress=lambda m: click.echo(
                                     f"forecache: {m}", err=True))
            plan, cfg = chosen.plan, chosen.cache
            click.echo(f"forecache: {chosen.line()}", err=True)
        n_seq = min(plan.n_seq, len(todo))
        llm = Llama.open(model, cache=cfg, **spec, n_ctx=ctx_per_seq, n_seq_max=n_seq,
                         n_threads=threads, verbose=verbose, n_batch=max(plan.n_ubatch, n_seq),
                         n_ubatch=plan.n_ubatch, offload_kqv=not plan.kv_host)
        say_choice(llm)
        show = progress if progress is not None else sys.stderr.isatty()
        # redrawn at each record written: tqdm's default redraws at most every 0.1 s and skips
        # the records written between, leaving the bar behind the output until the next one
        bar = tqdm(total=len(todo), unit="req", disable=not show, file=sys.stderr,
                   dynamic_ncols=True, mininterval=0, miniters=1)
        generated = 0
        ok = 0
        decode_rates: list[float] = []  # the records' own, named apart from the job's
        t0 = time.perf_counter()

        def on_token(n: int) -> None:
            nonlocal generated
            generated += n
            elapsed = time.perf_counter() - t0
            bar.set_postfix_str(f"{generated / elapsed:.1f} tokens/s" if elapsed else "",
                                refresh=False)

        def on_done(record: dict) -> None:
            nonlocal ok, failed
            writer.write(record)
            if "error" in record:
                failed += 1
            else:
                ok += 1
                if record["timings"]["tokens_per_s"] is not None:
                    decode_rates.append(record["timings"]["tokens_per_s"])
            bar.update(1)

        try:
            with deferred_signals() as stop:
                decode_many(llm, todo, n_seq, on_done, stop, on_token)
            stats = llm.expert_stats()
        finally:
            bar.close()
            llm.close()
        wall = time.perf_counter() - t0
        rate = stats["hit_rate"]
        click.echo(f"forecache: {ok} done, {skipped} skipped, {failed} failed of {total}; "
                   f"{rates_text(generated, wall, decode_rates)}; experts: {stats['policy']}"
                   + (f", hit rate {rate * 100:.0f}%" if rate is not None else "")
                   + (f"; {mobile_summary(stats)}" if stats["mode"] == "mobile" else "")
                   + (f"; {spec_summary(stats)}" if "draft" in stats else ""),
                   err=True)
        if stop:
            click.echo(f"forecache: interrupted: {ok + skipped} of {total} done; rerun the same "
                       "command to resume", err=True)
            sys.exit(128 + (stop.signum or signal.SIGINT))
        finish_in_order()  # missing records (none expected here) leave the file as it is
        if failed:
            raise BatchFailed(f"{failed} of {total} requests failed (see {output_path})")
    finally:
        writer.close()


COMMANDS = [batch]

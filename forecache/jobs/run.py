"""A whole batch job from Python, as ``forecache batch`` runs it: read the requests (resuming:
the ids already in the output are skipped), take or choose the plan, open the model, decode,
append each record as it finishes, and put the output in input order once it is complete.

The job prints nothing: what a reader would see (notes, each record, the decoding's speed)
goes to a ``JobProgress``, and ``run_job`` returns a ``JobResult`` that counts the records and
names the job's speeds. Ctrl-C and SIGTERM stop it at the next step (``deferred_signals``), with
every finished record already written; the result says which signal, and rerunning the same job
resumes it.

    from forecache.jobs.run import run_job

    res = run_job("model.gguf", Path("in.jsonl"), Path("out.jsonl"), cache=None)
    print(res.summary())
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from forecache.errors import setting
from forecache.jobs.requests import DEFAULT_MAX_TOKENS
from forecache.speculative.speculator import SELF_DRAFTS

if TYPE_CHECKING:
    from forecache.llama import Llama
    from forecache.placement.options import CacheConfig
    from forecache.roofline.batch import BatchPlan


def rates_text(generated: int, wall_s: float, decode_rates: Sequence[float]) -> str:
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


class JobProgress:
    """What a job reports as it runs; each method does nothing here, so a caller overrides only
    those it shows (the command line: notes on stderr and a progress bar)."""

    def note(self, text: str) -> None:
        """One line for the reader: a resumed job's skipped records, the plan chosen and the
        measuring before it."""

    def started(self, llm: Llama, n_requests: int) -> None:
        """The model is loaded and ``n_requests`` requests are about to be decoded."""

    def token(self, generated: int, elapsed_s: float) -> None:
        """A step sampled tokens: ``generated`` so far, ``elapsed_s`` since decoding began."""

    def record(self, record: dict) -> None:
        """A request's record (or error record) was written to the output."""

    def finished(self) -> None:
        """Decoding ended (done, interrupted or failed), before the model is closed."""


@dataclass
class JobResult:
    """What a job did. Counts are of the input's requests (every line, malformed ones too)."""

    output: Path
    total: int  # requests in the input
    done: int = 0  # decoded by this run
    skipped: int = 0  # already in the output, not as an error record
    failed: int = 0  # lines whose record in the output is an error record (this run's or older)
    generated: int = 0  # tokens sampled by this run
    wall_s: float = 0.0  # from the model loaded to the decoding's end
    decode_rates: list[float] = field(default_factory=list)  # the records' own tokens_per_s
    stats: dict | None = None  # the model's expert_stats(); None: nothing was left to decode
    plan: BatchPlan | None = None  # the plan that ran (None: nothing was left to decode)
    cpu_only: bool = False  # no GPU: the plan is written in the CPU's words
    interrupted: int | None = None  # the signal that stopped it; rerun the job to resume

    def summary(self) -> str:
        """The job's one-line summary: its counts, speeds and expert placement's stats."""
        if self.stats is None:
            return (f"nothing to do ({self.total} requests, {self.skipped} done, {self.failed} "
                    "failed)")
        from forecache.chat import mobile_summary, spec_summary

        stats = self.stats
        rate = stats["hit_rate"]
        plan = f"plan {self.plan.label(self.cpu_only)}; " if self.plan is not None else ""
        return (f"{self.done} done, {self.skipped} skipped, {self.failed} failed of "
                f"{self.total}; {rates_text(self.generated, self.wall_s, self.decode_rates)}; "
                f"{plan}experts: {stats['policy']}"
                + (f", hit rate {rate * 100:.0f}%" if rate is not None else "")
                + (f"; {mobile_summary(stats)}" if stats["mode"] == "mobile" else "")
                + (f"; {spec_summary(stats)}" if "draft" in stats else ""))


def check_job(input_path: Path, output_path: Path, draft: str | None = None) -> None:
    """Refuse, with a ValueError and before anything is read or written, a job that cannot run:
    an output that is its own input, or a draft other than the model's own little pass."""
    if draft is not None and draft not in SELF_DRAFTS:
        raise ValueError(f"{setting('draft', draft)}: a batch job drafts with the model's own "
                         f"little pass only ({' or '.join(SELF_DRAFTS)})")
    if output_path.resolve() == input_path.resolve():
        raise ValueError(f"{setting('output_path', flag='--output')} must not be the "
                         f"{setting('input_path', flag='--input')} file")


def run_job(model: str | os.PathLike[str], input_path: Path, output_path: Path, *,
            cache: CacheConfig | None, plan: BatchPlan | None = None,
            max_tokens: int = DEFAULT_MAX_TOKENS, ctx_per_seq: int = 2048,
            n_threads: int | None = None, verbose: bool = False,
            progress: JobProgress | None = None, **open_kwargs: Any) -> JobResult:
    """Run every request of the JSONL file ``input_path``, appending one JSON record a line to
    ``output_path``; the ids already there are skipped (a half-written last record is dropped
    and redone), so a killed job is resumed by running it again. A malformed line becomes an
    error record; once fixed, its request runs and its record replaces the error. The longest
    requests start first; once every request of the input is in the output, its records are put
    in the input's order.

    ``cache`` is the placement the model opens with (``Llama.open``'s ``cache``); ``plan`` the
    sequences decoded together, ubatch and KV cache's place. With no plan, the plan predicted
    fastest for these requests is chosen under the placement options ``cache`` (measuring this
    machine once per model), and with it the placement. A given plan runs with ``cache`` as it
    is (``jobs.plan.plan_cache`` gives the placement a plan asks of the options). With ``rpc``
    give a plan: the plans are predicted for one local device.

    ``max_tokens`` is that of requests that give none; ``ctx_per_seq`` each sequence's context
    (prompt + answer), capped by the model's. ``open_kwargs`` go to ``Llama.open`` (``draft``:
    self-little or self-cached, ``draft_k``, ``rpc``). Ctrl-C or SIGTERM stops the decoding at
    the next step: the result's ``interrupted`` names the signal and the output keeps every
    finished record, in the order they finished. An unreadable input, an output that is not a
    batch job's or a model that is not MoE raises (ValueError, GGUFError) before the output is
    touched; a load or decode that fails raises too, the records written before it kept.
    """
    from forecache.batch import (
        OutputWriter,
        decode_many,
        done_ids,
        prompt_lengths,
        rewrite_in_input_order,
    )
    from forecache.gguf.header import require_moe
    from forecache.interrupt import deferred_signals
    from forecache.jobs.plan import choose_plan
    from forecache.jobs.requests import read_requests
    from forecache.llama import Llama
    from forecache.models.names import resolve_model_arg
    from forecache.native.ggml_devices import cache_device
    from forecache.roofline.batch import batch_tokens

    report = progress or JobProgress()
    model = resolve_model_arg(model)
    check_job(input_path, output_path, open_kwargs.get("draft"))
    if plan is None and open_kwargs.get("rpc") is not None:
        raise ValueError(f"{setting('rpc')}: give a plan (the plans are predicted for one local "
                         "device)")
    requests, bad = read_requests(input_path, max_tokens)
    require_moe(model)  # before the output is touched
    done, done_failed, cut = done_ids(output_path)
    total = len(requests) + len(bad)
    if cut:
        report.note(f"dropped a half-written last record of {output_path}; it will be redone")
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
    res = JobResult(output_path, total, failed=len((done_failed & ids) - redo))
    if total - len(todo) - len(bad):
        report.note(f"{total - len(todo) - len(bad)} of {total} requests are already in "
                    f"{output_path}; skipping them")
    res.skipped = total - len(todo) - len(bad) - res.failed  # done before, not failed
    writer = OutputWriter(output_path)
    by_line = {r.line: r.id for r in requests}  # a fixed line's error record is left out

    def finish_in_order() -> None:
        writer.close()  # nothing more to append; the rewrite replaces the file
        rewrite_in_input_order(output_path, order, by_line)

    try:
        for record in bad:
            writer.write(record)
            res.failed += 1
        if not todo:
            finish_in_order()
            return res
        if plan is None:  # auto: the plan the model predicts fastest for these requests
            lens = prompt_lengths(model, todo)
            per_seq = require_moe(model).fit_context(ctx_per_seq)
            chosen = choose_plan(model, cache, lens, [r.max_tokens for r in todo], per_seq,
                                 n_threads=n_threads, progress=report.note)
            plan, cache = chosen.plan, chosen.cache
            report.note(chosen.line())
        res.plan, res.cpu_only = plan, cache_device().type == "cpu"
        t0 = 0.0  # decoding's start, once the model is loaded

        def on_token(n: int) -> None:
            res.generated += n
            report.token(res.generated, time.perf_counter() - t0)

        def on_done(record: dict) -> None:
            writer.write(record)  # before anything is reported: a kill loses nothing
            if "error" in record:
                res.failed += 1
            else:
                res.done += 1
                if record["timings"]["tokens_per_s"] is not None:
                    res.decode_rates.append(record["timings"]["tokens_per_s"])
            report.record(record)

        n_seq = min(plan.n_seq, len(todo))
        llm = Llama.open(model, cache=cache, **open_kwargs, n_ctx=ctx_per_seq, n_seq_max=n_seq,
                         n_threads=n_threads, verbose=verbose,
                         n_batch=batch_tokens(n_seq, plan.n_ubatch), n_ubatch=plan.n_ubatch,
                         offload_kqv=not plan.kv_host, micro=plan.micro)
        try:
            try:
                report.started(llm, len(todo))
                t0 = time.perf_counter()
                with deferred_signals() as stop:
                    decode_many(llm, todo, n_seq, on_done, stop, on_token, micro=plan.micro)
                res.stats = llm.expert_stats()
            finally:
                report.finished()
        finally:
            llm.close()
        res.wall_s = time.perf_counter() - t0
        if stop:
            # the output stays in the order the records finished: a rerun resumes from it
            res.interrupted = stop.signum
            return res
        finish_in_order()  # missing records (none expected here) leave the file as it is
        return res
    finally:
        writer.close()

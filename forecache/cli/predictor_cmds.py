"""``forecache trace``, ``forecache train`` and ``forecache eval-predictor``."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import click

from forecache.cli.model_arg import model_option
from forecache.gguf.header import ModelFile, read_model_file, require_moe
from forecache.predictor.registry import TRAINED_PREDICTORS
from forecache.trace.format import TraceError, TraceFile


def _say(msg: str) -> None:
    click.echo(msg, err=True)


@click.command("trace")
@model_option(required=True)
@click.option("--prompts", type=click.Path(path_type=Path), default=None,
              help='JSONL file: one {"prompt": ...} or {"messages": [...]} per line.')
@click.option("--builtin", type=click.Choice(["default"]), default=None,
              help="A prompt set shipped with forecache (chat, code, math, summarization).")
@click.option("--out", required=True, type=click.Path(path_type=Path), help="Trace file (.npz).")
@click.option("-n", "--n-gen", "n_gen", default=64, show_default=True,
              help="Tokens generated (greedy) after each prompt.")
@click.option("--gate-input", is_flag=True,
              help="Also record each MoE layer's router input (float16; large: tokens x layers x "
                   "d_model x 2 bytes). The learned and skip predictors need it.")
@click.option("--limit", type=int, default=None, help="Use only the first N prompts.")
@click.option("--raw", is_flag=True, help="Feed prompts as they are, without the chat template.")
@click.option("--ctx", "n_ctx", default=4096, show_default=True, help="Context size.")
@click.option("--batch", "n_batch", default=512, show_default=True,
              help="Prompt tokens per batch (llama.cpp n_batch).")
@click.option("--force", is_flag=True, help="Overwrite an existing trace file.")
def trace_cmd(model: Path, prompts: Path | None, builtin: str | None, out: Path, n_gen: int,
              gate_input: bool, limit: int | None, raw: bool, n_ctx: int, n_batch: int,
              force: bool) -> None:
    """Record which experts every MoE layer routes each token to, for predictors and caches."""
    from forecache.record import builtin_prompts_path, load_prompts, record_trace

    if (prompts is None) == (builtin is None):
        raise click.UsageError("give exactly one of --prompts FILE and --builtin NAME")
    if out.exists() and not force:
        raise ValueError(f"{out} exists; choose another --out or pass --force")
    require_moe(model)
    source = str(prompts) if prompts else f"builtin:{builtin}"
    items = load_prompts(prompts if prompts else builtin_prompts_path(builtin or "default"))
    if limit is not None:
        items = items[:max(0, limit)]
    t0 = time.perf_counter()

    tty = sys.stderr.isatty()
    step = max(1, len(items) // 10)

    def progress(done: int, total: int, rows: int) -> None:
        if not tty and done % step and done != total:
            return  # a log file gets about ten lines
        rate = rows / max(time.perf_counter() - t0, 1e-9)
        line = f"[trace] {done}/{total} requests, {rows} tokens ({rate:.0f} tokens/s)"
        click.echo(("\r" + line) if tty else line, err=True, nl=not tty or done == total)

    s = record_trace(model, items, out, n_gen=n_gen, gate_input=gate_input, chat=not raw,
                     n_ctx=n_ctx, n_batch=n_batch, source=source, progress=progress)
    if s.interrupted:
        _say(f"\n[trace] interrupted: kept the {s.requests} finished requests")
    _say(f"[trace] wrote {s.path}: {s.requests} requests, {s.tokens} tokens "
         f"({s.prefill_tokens} prefill, {s.decode_tokens} decode) in {s.seconds:.1f} s")
    if s.interrupted:
        sys.exit(128 + (s.signum or signal.SIGINT))


@click.command("train")
@model_option(required=True)
@click.option("--trace", "trace_path", required=True, type=click.Path(path_type=Path),
              help="Trace of the model (learned: recorded with --gate-input).")
@click.option("--predictor", type=click.Choice(TRAINED_PREDICTORS), default=TRAINED_PREDICTORS[0],
              show_default=True,
              help="learned: ProMoE's per-layer MLPs; eam: MoE-Infinity's EAM collection (and "
                   "the per-layer reuse the infinity policy sizes its slots from).")
@click.option("--window", type=click.IntRange(1, 64), default=None,
              help="learned: predict layer i from layer i-K's router input (required).")
@click.option("--out", type=click.Path(path_type=Path), default=None,
              help="learned: directory for the predictors (default: the model's predictor "
                   "cache, where the runtime looks).")
@click.option("--epochs", default=30, show_default=True, help="learned: training epochs per "
              "layer.")
def train_cmd(model: Path, trace_path: Path, predictor: str, window: int | None,
              out: Path | None, epochs: int) -> None:
    """Train a model's predictors from its trace and store them with its identity: ProMoE's
    learned predictors, or MoE-Infinity's EAM collection."""
    from forecache.gguf.identity import require_same_model
    from forecache.predictor.base import source_layer
    from forecache.predictor.learned import LearnedPredictor
    from forecache.predictor.store import learned_dir, write_identity

    mf = require_moe(model)
    if predictor == "eam":
        if window is not None or out is not None:
            raise click.UsageError("--window and --out are for --predictor learned")
        _train_eam(mf, trace_path)
        return
    if window is None:
        raise click.UsageError("--predictor learned needs --window K")
    with TraceFile(trace_path) as tr:
        require_same_model(tr.meta, mf, f"trace {trace_path}",
                           f"record one with `forecache trace -m {model} --gate-input`")
        info = tr.info()
        if not info.has_gate_input:
            raise TraceError(f"{trace_path} has no gate inputs; record it with `forecache trace "
                             f"-m {model} --gate-input ...`")
        pairs = [(source_layer(i, window), i) for i in range(1, info.n_layers)]
        p = LearnedPredictor(info.n_layers, info.n_expert, info.top_k, pairs=pairs,
                             d_model=int(info.meta["n_embd"]), epochs=epochs)
        reqs = list(tr.requests())
        _say(f"[train] {len(pairs)} predictors (window {window}) on {info.n_tokens} tokens of "
             f"{len(reqs)} requests")
        t0 = time.perf_counter()
        p.fit(reqs)
    dest = out or learned_dir(mf, window)
    dest.parent.mkdir(parents=True, exist_ok=True)
    p.save(dest)
    write_identity(dest, mf, {"window": window, "trace": str(trace_path)})
    for (lf, lt), st in sorted(p.train_stats.items()):
        acc = st.get("val_accuracy")
        _say(f"[train] layer {lf} -> {lt}: validation accuracy "
             f"{acc:.3f}" if acc is not None else f"[train] layer {lf} -> {lt}")
    _say(f"[train] saved to {dest} in {time.perf_counter() - t0:.1f} s")


def _train_eam(mf: ModelFile, trace_path: Path) -> None:
    """Store ``mf``'s EAM collection and per-layer decode hit curves from a trace of it."""
    from forecache.gguf.identity import require_same_model
    from forecache.predictor.eam import EAMPredictor
    from forecache.predictor.store import EAMCollection, save_eam
    from forecache.trace.stats import lru_hit_curves

    with TraceFile(trace_path) as tr:
        require_same_model(tr.meta, mf, f"trace {trace_path}",
                           f"record one with `forecache trace -m {mf.path}`")
        info = tr.info()
        reqs = list(tr.requests(gate_input=False))
    p = EAMPredictor(info.n_layers, info.n_expert, info.top_k)
    p.fit(reqs)
    # decode rows when the trace marks phases: the gates a cache serves token by token
    curves = lru_hit_curves([r.experts for r in reqs], info.n_expert,
                            [None if r.phase is None else r.phase != 0 for r in reqs])
    dest = save_eam(mf, EAMCollection(p.collection, p.prior, curves), str(trace_path))
    _say(f"[train] EAM collection of {p.collection_size} requests ({info.n_tokens} tokens) "
         f"saved to {dest}")


@click.command("eval-predictor")
@click.option("--trace", "trace_path", required=True, type=click.Path(path_type=Path),
              help="Trace file (.npz): ours or one in the shared format.")
@click.option("--predictors", default="all", show_default=True,
              help="Comma-separated: learned, skip, token, eam, history (or all).")
@click.option("--window", "windows", default="1,2,4,8", show_default=True,
              help="Comma-separated windows k.")
@model_option(purpose="the skip predictor reads its routers")
@click.option("--folds", default=4, show_default=True, help="Folds of the split by request.")
@click.option("--epochs", default=None, type=int, help="Learned predictor epochs.")
@click.option("--plot", "plot_path", type=click.Path(path_type=Path), default=None,
              help="Write a PNG like ProMoE Fig. 8.")
@click.option("--per-layer", is_flag=True, help="Also print ACCURACY_i(k) for every layer.")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
def eval_cmd(trace_path: Path, predictors: str, windows: str, model: Path | None, folds: int,
             epochs: int | None, plot_path: Path | None, per_layer: bool, as_json: bool) -> None:
    """Per-layer ACCURACY_i(k) of expert predictors, held out by request."""
    from forecache.predictor.evaluate import dumps, evaluate, plot
    from forecache.predictor.registry import parse_names

    names = parse_names(predictors)
    try:
        ks = sorted({int(x) for x in windows.split(",") if x.strip()})
    except ValueError as e:
        raise ValueError(f"--window {windows!r}: give integers such as 1,2,4,8") from e
    if not ks or ks[0] < 1:
        raise ValueError("--window: windows are integers >= 1")
    mf = read_model_file(model) if model else None
    with TraceFile(trace_path) as tr:
        if mf is not None and tr.meta.get("fingerprint"):
            from forecache.gguf.identity import require_same_model

            require_same_model(tr.meta, mf, f"trace {trace_path}", "pass the model it was "
                               "recorded with")
        res = evaluate(tr, names, ks, folds=folds, model=mf, learned_epochs=epochs,
                       progress=None if as_json else (lambda m: _say(f"[eval] {m}")))
    if plot_path:
        plot(res, str(plot_path))
    if as_json:
        click.echo(dumps(res))
        return
    click.echo(f"{res.trace}: {res.n_tokens} tokens, {res.n_requests} requests, "
               f"{res.folds}-fold split by request; mean ACCURACY over target layers")
    for note in res.notes:
        click.echo(f"note: {note}")
    click.echo(res.table())
    if per_layer:
        click.echo(res.layer_table())
    if plot_path:
        _say(f"[eval] plot written to {plot_path}")


COMMANDS = [trace_cmd, train_cmd, eval_cmd]

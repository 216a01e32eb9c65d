"""``forecache generate`` and ``forecache run``."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click

from forecache.cache.budget import format_size
from forecache.cache.registry import POLICIES
from forecache.cli.model_arg import model_option
from forecache.interrupt import deferred_signals
from forecache.native.libs import MAX_THREADS
from forecache.placement.costs import DEFAULT_GPU_MACHINE
from forecache.placement.options import MODES, PREDICTORS, SWITCHES, CacheConfig, Options

if TYPE_CHECKING:
    from forecache.generate import GenerationResult
    from forecache.llama import Llama


def threads_option(fn):  # type: ignore[no-untyped-def]
    """--threads: 1 to MAX_THREADS CPU threads (ggml's limit); default every core."""
    return click.option("--threads", type=click.IntRange(1, MAX_THREADS), default=None,
                        help=f"CPU threads, 1 to {MAX_THREADS} (default: all cores).")(fn)


def ctx_option(fn):  # type: ignore[no-untyped-def]
    """--ctx: the context length, capped at the length the model was trained for."""
    return click.option("--ctx", "n_ctx", default=4096, show_default=True,
                        help="Context length (capped by the model's).")(fn)


def ubatch_option(fn):  # type: ignore[no-untyped-def]
    """--ubatch: prompt tokens per forward pass (llama.cpp's n_batch and n_ubatch)."""
    return click.option("--ubatch", type=click.IntRange(1, 8192), default=None,
                        help="Prompt tokens per forward pass (llama.cpp's n_ubatch; default "
                             "512). Each pass copies the missing experts it routes once, so "
                             "long prompts prefill faster with larger passes; their compute "
                             "buffers take device memory from the expert slots, which slows "
                             "decode (BENCHMARKS.md: ubatch_sim).")(fn)


def ubatch_args(ubatch: int | None) -> dict[str, int]:
    """Llama.open's arguments for --ubatch (none: llama.cpp's defaults)."""
    return {} if ubatch is None else {"n_batch": ubatch, "n_ubatch": ubatch}


def cache_options(fn):  # type: ignore[no-untyped-def]
    """--policy, --gpu-budget, --cache-fraction and promoe's switches."""
    for name, what in reversed(list(SWITCHES.items())):
        fn = click.option(f"--no-{name}", f"no_{name}", is_flag=True, default=False,
                          help=f"promoe without {what} (for ablations).")(fn)
    fn = click.option("--draft-k", type=click.IntRange(1, 16), default=Options.draft_k,
                      help="--draft: tokens drafted before each verification (default: adaptive, "
                           "from how many the model accepts).")(fn)
    fn = click.option("--draft", default=Options.draft, metavar="MODEL|self-little|self-cached",
                      help="Speculative decoding (exact): a draft proposes tokens and the model "
                           "verifies several in one pass. self-little: the model's own little "
                           "pass (half its experts); self-cached: its experts already on the "
                           "device; or a GGUF with the same vocabulary.")(fn)
    fn = click.option("--little-resident", is_flag=True, default=Options.little_resident,
                      help="--mode mobile: the little pass keeps each token's top expert and "
                           "those of its top --little-k (default: all it routes) already on the "
                           "device, so it never waits for a copy (cache-conditional "
                           "routing).")(fn)
    fn = click.option("--little-k", type=click.IntRange(1, 256), default=Options.little_k,
                      help="--mode mobile: experts per token of the little pass (default: half "
                           "the model's).")(fn)
    fn = click.option("--gamma", type=click.FloatRange(0.0, 1.0), default=Options.gamma,
                      show_default=True,
                      help="--mode mobile: a token whose little pass gives its top token a "
                           "lower probability is recomputed by the full model.")(fn)
    fn = click.option("--mode", type=click.Choice(MODES), default=Options.mode,
                      show_default=True,
                      help="exact: the model as it is. mobile (MoBiLE, lossy): each generated "
                           "token runs a little pass over fewer experts, and the full model "
                           "recomputes the tokens the little pass is unsure of.")(fn)
    fn = click.option("--stage-slots", type=click.IntRange(0, 256), default=Options.stage_slots,
                      help="promoe: experts' worth of device memory, held back from the budget, "
                           "into which a long prompt copies the next layer's missing experts "
                           "while the current layer computes (default: as many as a prompt "
                           "layer misses, at most 32 and a 64th of the slots, on a GPU; 0 "
                           "turns it off).")(fn)
    fn = click.option("--prompt-bank/--no-prompt-bank", default=Options.prompt_bank,
                      help="Long prompts (ubatches of 32 tokens or more) compute each layer as "
                           "llama.cpp does for its host layers, from a copy of all its experts "
                           "on the device, but copy only the experts the slots lack, while the "
                           "layer before computes; two layers' experts of device memory held "
                           "back from the budget in place of --stage-slots (default: on a GPU "
                           "when some layer misses experts).")(fn)
    fn = click.option("--machine", default=Options.machine,
                      help="promoe: machine profile (shipped name or JSON) the CPU/device split "
                           f"starts from (default {DEFAULT_GPU_MACHINE} on a GPU; no split on a "
                           "CPU build), or one per device holding slots (A,B,... in llama.cpp's "
                           "order: RPC servers, several GPUs); "
                           "the measured rates correct it during the run.")(fn)
    fn = click.option("--window", type=click.IntRange(1, 64), default=Options.window,
                      help="promoe: predict this many layers ahead (default: the window the "
                           "model's learned predictors were trained for).")(fn)
    fn = click.option("--predictor", type=click.Choice(PREDICTORS),
                      default=Options.predictor, show_default=True,
                      help="promoe's predictor (auto: learned when trained for the model; eam: "
                           "MoE-Infinity's EAM matching, from the collection `forecache train "
                           "--predictor eam` makes).")(fn)
    fn = click.option("--host-budget", default=Options.host_budget,
                      help="Host memory for the model's weights kept on the host, its experts "
                           "included (e.g. 48GiB); experts beyond it stay in the GGUF file and "
                           "are read as they are needed: a model larger than host memory "
                           "(default: every expert in memory).")(fn)
    fn = click.option("--cache-fraction", type=float, default=Options.cache_fraction,
                      help="Share of each layer's experts held in device slots (0-1].")(fn)
    fn = click.option("--gpu-budget", default=Options.gpu_budget,
                      help="All device memory the run may use: weights, KV cache, buffers, "
                           "expert slots (e.g. 24GiB). With layers on several devices (--rpc), "
                           "one size per device in llama.cpp's order (e.g. 20GiB,22GiB), or one "
                           "size for all of them together, shared so that every layer gets the "
                           "same slots.")(fn)
    fn = click.option("--rpc", default=Options.rpc, metavar="HOST:PORT[,...]",
                      help="llama.cpp's RPC servers (`forecache rpc-server` on each): their "
                           "devices take the model's layers as llama.cpp splits them; a cached "
                           "policy keeps each layer's slots on the device that holds the "
                           "layer.")(fn)
    fn = click.option("--policy", type=click.Choice(POLICIES), default=Options.policy,
                      help="Expert placement (default: promoe where it is expected to decode "
                           "at least 1.2x faster than ncmoe for this model and budget, else "
                           "ncmoe, within the GPU's free memory unless a size is given; a "
                           "CPU-only build given no option keeps llama.cpp's own placement).")(fn)
    return fn


def open_args(cache_opts: dict) -> dict:
    """Takes --draft, --draft-k and --rpc out of the cache options: Llama.open's arguments for
    them (none when not given)."""
    draft, draft_k = cache_opts.pop("draft", None), cache_opts.pop("draft_k", None)
    rpc = cache_opts.pop("rpc", None)
    return ({} if draft is None else {"draft": draft, "draft_k": draft_k}) | \
        ({} if rpc is None else {"rpc": rpc})


def cli_options(cache_opts: dict) -> Options:
    """The run's options from the cache options' values (``Options.from_cli``)."""
    return Options.from_cli(**cache_opts)


def cache_config(**cache_opts: object) -> CacheConfig | None:
    """The CacheConfig the cache options ask for, before the load (a batch job plans with it):
    promoe unless a policy is named, sized by the GPU's free memory unless a size is given; None
    (llama.cpp's own placement) on a CPU-only build given no option."""
    return Options.from_cli(**cache_opts).cache_config()


def say_choice(llm: Llama) -> None:
    """The default placement's one line (what forecache chose and why), when it chose, and
    where the disk tier keeps the experts, when there is one."""
    if llm.policy_choice is not None:
        click.echo(llm.policy_choice.reason(), err=True)
    if llm.placement is not None and llm.placement.disk is not None:
        click.echo(llm.placement.disk.describe(), err=True)
        if llm.disk_rate is not None:
            click.echo(f"disk tier: the file reads at {llm.disk_rate.describe()}", err=True)
    elif llm.cache_config is not None and llm.cache_config.host_budget is not None:
        click.echo(f"disk tier: off, {format_size(llm.cache_config.host_budget)} of host memory "
                   "holds every expert", err=True)


def _print_stats(res: GenerationResult) -> None:
    n = len(res.tokens)
    tps = 1.0 / res.tpot_s if res.tpot_s > 0 else 0.0
    click.echo(f"\n[{res.prompt_tokens} prompt tokens, {n} generated ({res.finish_reason}); "
               f"TTFT {res.ttft_s * 1000:.1f} ms, TPOT {res.tpot_s * 1000:.1f} ms, "
               f"{tps:.1f} tokens/s]", err=True)


def _stream(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


@click.command("generate")
@model_option(required=True)
@click.option("-p", "--prompt", required=True, help="Prompt text (special tokens are parsed).")
@click.option("-n", "--n-predict", "n_predict", default=128, show_default=True,
              help="Tokens to generate.")
@click.option("--greedy", is_flag=True, help="Always take the most likely token.")
@click.option("--seed", default=0, show_default=True, help="Sampling seed.")
@click.option("--temp", default=0.8, show_default=True, help="Sampling temperature.")
@ctx_option
@threads_option
@click.option("--n-gpu-layers", default=-1, show_default=True,
              help="Layers on the GPU on a CUDA build (-1 = all).")
@click.option("--ignore-eos", is_flag=True, help="Keep generating past end-of-generation tokens.")
@click.option("--json", "as_json", is_flag=True,
              help="Print one JSON object: tokens, text, stats.")
@click.option("--verbose", is_flag=True, help="Show llama.cpp's own log.")
@ubatch_option
@cache_options
def generate(model: Path, prompt: str, n_predict: int, greedy: bool, seed: int, temp: float,
             n_ctx: int, threads: int | None, n_gpu_layers: int, ignore_eos: bool, as_json: bool,
             verbose: bool, ubatch: int | None, **cache_opts: object) -> None:
    """Generate text from a prompt with a GGUF MoE model."""
    if n_predict < 0:
        raise click.BadParameter("must be >= 0", param_hint="-n")
    from forecache.generate import SamplingParams, generate
    from forecache.llama import Llama

    sampling = SamplingParams(greedy=greedy, temperature=temp)
    with Llama.open(model, options=cli_options(cache_opts), n_ctx=n_ctx, n_threads=threads,
                    n_gpu_layers=n_gpu_layers, seed=seed, verbose=verbose,
                    **ubatch_args(ubatch)) as llm, \
            deferred_signals() as stop:
        res = generate(llm, prompt, n_predict, sampling, on_text=None if as_json else _stream,
                       ignore_eos=ignore_eos, stop=stop)
    stop.raise_if_set()
    if as_json:
        click.echo(json.dumps(res.to_json()))
    else:
        _print_stats(res)


@click.command("run")
@model_option(default="default")
@click.option("-p", "--prompt", default=None, help="Prompt (default: a short built-in question).")
@click.option("-n", "--n-predict", "n_predict", default=64, show_default=True,
              help="Tokens to generate.")
@ctx_option
@cache_options
def run(model: Path, prompt: str | None, n_predict: int, n_ctx: int,
        **cache_opts: object) -> None:
    """Answer a prompt with the default model (or -m MODEL) and print the speed and the expert
    cache's statistics."""
    from forecache.chat import expert_summary, spec_summary
    from forecache.generate import SamplingParams, generate
    from forecache.llama import Llama
    from forecache.models.default import DEFAULT_PROMPT

    path = model
    question = prompt or DEFAULT_PROMPT
    with Llama.open(path, options=cli_options(cache_opts), n_ctx=n_ctx) as llm:
        text = llm.format_chat([{"role": "user", "content": question}])
        mf = llm.model_file
        click.echo(f"model: {path.name} ({mf.arch}, {mf.n_layer} layers, {mf.n_expert} experts, "
                   f"top-{mf.n_expert_used})", err=True)
        if "forecache.preset" in mf.kv:
            click.echo("note: this model has random weights (made by `forecache make-model`), "
                       "so its text is noise; the timings are real", err=True)
        say_choice(llm)
        click.echo(f"> {question}", err=True)
        with deferred_signals() as stop:
            res = generate(llm, text, n_predict, SamplingParams(greedy=True), on_text=_stream,
                           stop=stop)
    stop.raise_if_set()
    _print_stats(res)
    click.echo(f"[{expert_summary(res.stats)}]", err=True)
    if "disk_reads" in res.stats and res.tokens:
        n = len(res.tokens)
        click.echo(f"[disk: {res.stats['disk_reads'] / n:.1f} experts "
                   f"({format_size(res.stats['disk_bytes'] / n)}) read a token, "
                   f"{res.stats['disk_wait_s'] * 1000 / n:.1f} ms waited a token]", err=True)
    if "draft" in res.stats:
        click.echo(f"[{spec_summary(res.stats)}]", err=True)


COMMANDS = [generate, run]

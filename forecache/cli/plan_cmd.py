"""``forecache plan``: the best batch plans for a model, a budget and a job, without running."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING

import click

from forecache.cli.model_arg import MODEL

if TYPE_CHECKING:
    from forecache.roofline.batch import Workload


def spread_workload(n: int, prompt_len: float, gen: float, ctx_per_seq: int | None) -> Workload:
    """A job of ``n`` requests whose lengths spread as ShareGPT's (``sim.run.SHAREGPT``'s
    lognormal shapes) around the mean prompt and answer lengths given, drawn with a fixed
    seed, each within ``ctx_per_seq`` (default: room for four times the means); the medians
    are adjusted a few times so that the draws' means come near those given, which the
    context's cut lowers."""
    import numpy as np

    from forecache.roofline.batch import Workload
    from forecache.sim.run import SHAREGPT, LengthModel

    ctx = ctx_per_seq or max(SHAREGPT.context, int(4 * (prompt_len + gen)))
    sp, sa = SHAREGPT.prompt_sigma, SHAREGPT.answer_sigma
    medians = [prompt_len / math.exp(sp * sp / 2), gen / math.exp(sa * sa / 2)]
    for _ in range(4):
        lengths = LengthModel(prompt_median=medians[0], prompt_sigma=sp,
                              answer_median=medians[1], answer_sigma=sa,
                              max_prompt=max(ctx - SHAREGPT.min_len, 1), context=ctx,
                              min_len=min(SHAREGPT.min_len, max(ctx // 2, 1)))
        prompts, answers = lengths.draw(n, np.random.default_rng(0))
        medians[0] *= prompt_len / max(float(prompts.mean()), 1.0)
        medians[1] *= gen / max(float(answers.mean()), 1.0)
    return Workload(n, float(prompts.mean()), float(answers.mean()),
                    ctx_per_seq or int((prompts + answers).max()),
                    tuple(int(a) for a in answers), tuple(int(p) for p in prompts))


@click.command("plan")
@click.option("-m", "--model", "model", type=MODEL, default=None,
              help="GGUF file or model name (`forecache models` lists them).")
@click.option("--shape", default=None,
              help="Plan for a models.yaml shape instead of a file (e.g. qwen2-57b-a14b, at "
                   "--qtype).")
@click.option("--qtype", default="q4_k", show_default=True, help="Quantization of --shape.")
@click.option("--gpu-budget", required=True, help="Device memory to plan for, e.g. 24GiB.")
@click.option("--prompt-len", type=click.FloatRange(1), required=True,
              help="Mean prompt length of the job, in tokens.")
@click.option("--gen", type=click.FloatRange(1), required=True,
              help="Mean answer length of the job, in tokens.")
@click.option("--requests", type=click.IntRange(1), default=1000, show_default=True,
              help="Requests in the job.")
@click.option("--ctx-per-seq", type=click.IntRange(16), default=None,
              help="Context of each sequence (default: the longest prompt + answer).")
@click.option("--spread", type=click.Choice(["sharegpt", "none"]), default="sharegpt",
              show_default=True,
              help="How the requests' lengths spread around the means: as ShareGPT's "
                   "(lognormal, its shapes; the job's ramp and its tail of long answers are "
                   "priced), or none (every request alike).")
@click.option("--host-memory", default=None,
              help="Host memory the job may use (experts, a host KV cache), e.g. 64GiB; "
                   "default: this machine's.")
@click.option("--machine", default=None,
              help="Machine profile (shipped name or JSON); default: the cache's default.")
@click.option("--top", type=click.IntRange(1), default=5, show_default=True,
              help="Plans to print.")
@click.option("--json", "json_out", type=click.Path(path_type=Path), default=None,
              help="Also write every plan's estimate here.")
def plan(model: Path | None, shape: str | None, qtype: str, gpu_budget: str, prompt_len: float,
         gen: float, requests: int, ctx_per_seq: int | None, spread: str,
         host_memory: str | None, machine: str | None, top: int, json_out: Path | None) -> None:
    """Print the batch plans predicted fastest for a job (sequences together, ubatch, where the
    KV cache lives), with stock llama.cpp's best --n-cpu-moe plan beside them."""
    from forecache.cache.budget import format_size, parse_size
    from forecache.cache.cost import Profile
    from forecache.native.libs import MAX_SEQUENCES
    from forecache.placement.costs import DEFAULT_MACHINE
    from forecache.roofline.batch import MICRO_MAX, Workload, search
    from forecache.roofline.shape import model_shape, shape_of

    if (model is None) == (shape is None):
        raise click.UsageError("give a model (-m FILE) or a models.yaml shape (--shape NAME)")
    try:
        budget = parse_size(gpu_budget)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--gpu-budget") from None
    try:
        host = parse_size(host_memory) if host_memory else \
            os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--host-memory") from None
    non_expert = None
    if model is not None:
        from forecache.gguf.header import require_moe

        mf = require_moe(model)
        sh = model_shape(mf)
        non_expert = mf.non_expert_bytes()
    else:
        try:
            sh = shape_of(shape, qtype)  # type: ignore[arg-type]
        except (KeyError, ValueError) as e:
            raise click.BadParameter(f"{shape}: {e}", param_hint="--shape") from None
    profile = Profile.load(machine or DEFAULT_MACHINE)
    if spread == "none":
        work = Workload(requests, prompt_len, gen, ctx_per_seq or int(prompt_len + gen))
        spread_text = ""
    else:
        if ctx_per_seq is not None and prompt_len + gen > ctx_per_seq:
            raise click.BadParameter(
                f"{ctx_per_seq} tokens hold less than the mean prompt and answer "
                f"({prompt_len:g} + {gen:g}): raise it, or give --spread none",
                param_hint="--ctx-per-seq")
        work = spread_workload(requests, prompt_len, gen, ctx_per_seq)
        spread_text = (f" (spread as ShareGPT's: means {work.prompt_len:.0f} + "
                       f"{work.gen_len:.0f}, longest {work.ctx_per_seq})")
    # the profiles are GPUs': the runtime places prompt banks there by default, which
    # micro-batches share
    ours = search(sh, profile, budget, work, non_expert_bytes=non_expert, host_bytes=host,
                  max_seq=MAX_SEQUENCES, bank=True, micros=range(1, MICRO_MAX + 1))
    stock = search(sh, profile, budget, work, experts=("ncmoe",), non_expert_bytes=non_expert,
                   host_bytes=host)
    if not ours:
        raise click.ClickException(
            f"no plan fits {gpu_budget} and {format_size(host)} of host memory: the non-expert "
            f"weights, one sequence's KV cache and a ubatch's buffers leave no expert slot, or "
            f"the experts do not fit in host memory; raise --gpu-budget or --host-memory, or "
            f"lower --ctx-per-seq")
    click.echo(f"{sh.name} at {gpu_budget} ({format_size(host)} of host memory), profile "
               f"{profile.name}; {requests} requests of {prompt_len:g} + {gen:g} tokens"
               f"{spread_text}")
    for e in ours[:top]:
        click.echo(e.line())
    if stock:
        ratio = ours[0].tokens_per_s / stock[0].tokens_per_s
        click.echo(f"stock llama.cpp's best: {stock[0].line()}; forecache's best is "
                   f"{ratio:.2f}x")
    if json_out is not None:
        def row(e: object) -> dict:
            from dataclasses import asdict

            d = asdict(e)  # type: ignore[call-overload]
            d["plan"] = e.plan.label()  # type: ignore[attr-defined]
            d["line"] = e.line()  # type: ignore[attr-defined]
            return d

        json_out.write_text(json.dumps({"shape": sh.name, "budget": budget,
                                        "profile": profile.name,
                                        "workload": work.__dict__,
                                        "plans": [row(e) for e in ours],
                                        "stock": [row(e) for e in stock]}, indent=1))


COMMANDS = [plan]

"""``forecache plan``: the best batch plans for a model, a budget and a job, without running."""

from __future__ import annotations

import json
import os
from pathlib import Path

import click

from forecache.cli.model_arg import MODEL


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
              help="Context of each sequence (default: prompt + answer lengths).")
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
         gen: float, requests: int, ctx_per_seq: int | None, host_memory: str | None,
         machine: str | None, top: int, json_out: Path | None) -> None:
    """Print the batch plans predicted fastest for a job (sequences together, ubatch, where the
    KV cache lives), with stock llama.cpp's best --n-cpu-moe plan beside them."""
    from forecache.cache.budget import format_size, parse_size
    from forecache.cache.cost import Profile
    from forecache.native.libs import MAX_SEQUENCES
    from forecache.placement.costs import DEFAULT_MACHINE
    from forecache.roofline.batch import Workload, search
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
    work = Workload(requests, prompt_len, gen, ctx_per_seq or int(prompt_len + gen))
    # the profiles are GPUs': the runtime places prompt banks there by default
    ours = search(sh, profile, budget, work, non_expert_bytes=non_expert, host_bytes=host,
                  max_seq=MAX_SEQUENCES, bank=True)
    stock = search(sh, profile, budget, work, experts=("ncmoe",), non_expert_bytes=non_expert,
                   host_bytes=host)
    if not ours:
        raise click.ClickException(
            f"no plan fits {gpu_budget} and {format_size(host)} of host memory: the non-expert "
            f"weights, one sequence's KV cache and a ubatch's buffers leave no expert slot, or "
            f"the experts do not fit in host memory; raise --gpu-budget or --host-memory, or "
            f"lower --ctx-per-seq")
    click.echo(f"{sh.name} at {gpu_budget} ({format_size(host)} of host memory), profile "
               f"{profile.name}; {requests} requests of {prompt_len:g} + {gen:g} tokens")
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

"""``forecache plan``: the best batch plans for a model, a budget and a job, without running."""

from __future__ import annotations

import json
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
@click.option("--machine", default=None,
              help="Machine profile (shipped name or JSON); default: the cache's default.")
@click.option("--top", type=click.IntRange(1), default=5, show_default=True,
              help="Plans to print.")
@click.option("--json", "json_out", type=click.Path(path_type=Path), default=None,
              help="Also write every plan's estimate here.")
def plan(model: Path | None, shape: str | None, qtype: str, gpu_budget: str, prompt_len: float,
         gen: float, requests: int, ctx_per_seq: int | None, machine: str | None, top: int,
         json_out: Path | None) -> None:
    """Print the batch plans predicted fastest for a job (sequences together, ubatch, where the
    KV cache lives), with stock llama.cpp's best --n-cpu-moe plan beside them."""
    from forecache.cache.budget import parse_size
    from forecache.cache.cost import Profile
    from forecache.cache.plans import Workload, search
    from forecache.cache.setup import DEFAULT_MACHINE
    from forecache.sim.shapes import model_shape, shape_of

    if (model is None) == (shape is None):
        raise click.UsageError("give a model (-m FILE) or a models.yaml shape (--shape NAME)")
    try:
        budget = parse_size(gpu_budget)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--gpu-budget") from None
    non_expert = None
    if model is not None:
        from forecache.gguf.header import require_moe

        mf = require_moe(model)
        sh = model_shape(mf)
        non_expert = mf.total_bytes() - mf.expert_bytes()
    else:
        try:
            sh = shape_of(shape, qtype)  # type: ignore[arg-type]
        except (KeyError, ValueError) as e:
            raise click.BadParameter(f"{shape}: {e}", param_hint="--shape") from None
    profile = Profile.load(machine or DEFAULT_MACHINE)
    work = Workload(requests, prompt_len, gen, ctx_per_seq or int(prompt_len + gen))
    ours = search(sh, profile, budget, work, non_expert_bytes=non_expert)
    stock = search(sh, profile, budget, work, experts=("ncmoe",), non_expert_bytes=non_expert)
    if not ours:
        raise click.ClickException(
            f"no plan fits {gpu_budget}: the non-expert weights, one sequence's KV cache and a "
            f"ubatch's buffers leave no expert slot; raise --gpu-budget or lower --ctx-per-seq")
    click.echo(f"{sh.name} at {gpu_budget}, profile {profile.name}; {requests} requests of "
               f"{prompt_len:g} + {gen:g} tokens")
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

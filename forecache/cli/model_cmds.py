"""``forecache make-model``: GGUFs of real MoE architectures with random weights."""

from __future__ import annotations

import time
from pathlib import Path

import click

from forecache.gguf.qtypes import QTYPES


@click.command("make-model")
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--preset", required=True, help="Model shape from models.yaml (e.g. tiny, "
              "qwen2-57b-a14b, qwen3-30b-a3b, mixtral-8x7b, deepseek-v2-lite, gpt-oss-20b; "
              "`forecache models` lists them).")
@click.option("--type", "qtype", type=click.Choice(list(QTYPES)),
              default="f16", show_default=True, help="Type of the weight matrices.")
@click.option("--seed", default=0, show_default=True, help="Seed of the random weights.")
@click.option("--layers", "n_layers", type=int, default=None,
              help="Override the preset's layer count (smaller files for tests).")
@click.option("--workers", type=int, default=None, help="Writer processes (default: all cores).")
@click.option("--fuse-gate-up", is_flag=True,
              help="Gate and up experts in one tensor (as convert_hf_to_gguf.py "
              "--fuse-gate-up-exps writes them; deepseek2).")
@click.option("--force", is_flag=True, help="Overwrite OUT if it exists.")
def make_model_cmd(out: Path, preset: str, qtype: str, seed: int, n_layers: int | None,
                   workers: int | None, fuse_gate_up: bool, force: bool) -> None:
    """Write OUT.gguf: a MoE model of a real architecture with random weights."""
    from forecache.gguf.maker import make_model

    if out.exists() and not force:
        raise FileExistsError(f"{out} exists; pass --force to overwrite it")
    t0 = time.time()
    state = {"last": -1}

    def progress(done: int, total: int) -> None:
        pct = 100 * done // max(total, 1)
        if pct >= state["last"] + 5 or done == total:
            state["last"] = pct
            rate = done / max(time.time() - t0, 1e-9) / 1e6
            click.echo(f"\r  {pct:3d}% of {total / 1e9:.2f} GB ({rate:.0f} MB/s)", nl=False,
                       err=True)

    make_model(out, preset, qtype, seed=seed, n_layers=n_layers, workers=workers,
               progress=progress, fuse_gate_up=fuse_gate_up)
    click.echo("", err=True)
    click.echo(f"wrote {out} ({out.stat().st_size / 1e9:.2f} GB) in {time.time() - t0:.1f} s")


COMMANDS = [make_model_cmd]

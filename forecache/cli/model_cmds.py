"""``forecache make-model``: GGUFs of real MoE architectures (and dense drafts for them) with
random weights."""

from __future__ import annotations

import time
from pathlib import Path

import click

from forecache.gguf.qtypes import QTYPES


@click.command("make-model")
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--preset", required=True, help="Model shape from models.yaml (e.g. tiny, "
              "qwen2-57b-a14b, qwen3-30b-a3b, mixtral-8x7b, deepseek-v2-lite, gpt-oss-20b; the "
              "dense drafts qwen2-0.5b and tiny-draft; `forecache models` lists them).")
@click.option("--type", "qtype", type=click.Choice(list(QTYPES)),
              default="f16", show_default=True, help="Type of the weight matrices.")
@click.option("--seed", default=0, show_default=True, help="Seed of the random weights.")
@click.option("--layers", "n_layers", type=int, default=None,
              help="Override the preset's layer count (smaller files for tests).")
@click.option("--workers", type=int, default=None, help="Writer processes (default: all cores).")
@click.option("--fuse-gate-up", is_flag=True,
              help="Gate and up experts in one tensor (as convert_hf_to_gguf.py "
              "--fuse-gate-up-exps writes them; deepseek2).")
@click.option("--split-max-size", default=None, metavar="SIZE",
              help="Write split files of at most SIZE of tensors each (e.g. 2G), as gguf-split "
              "does: OUT-00001-of-0000N.gguf and so on.")
@click.option("--split-max-tensors", type=click.IntRange(min=1), default=None, metavar="N",
              help="Write split files of at most N tensors each.")
@click.option("--force", is_flag=True, help="Overwrite OUT if it exists.")
def make_model_cmd(out: Path, preset: str, qtype: str, seed: int, n_layers: int | None,
                   workers: int | None, fuse_gate_up: bool, split_max_size: str | None,
                   split_max_tensors: int | None, force: bool) -> None:
    """Write OUT.gguf: a MoE model of a real architecture with random weights, or a dense draft
    for one with its vocabulary (or its split files, with --split-max-size or
    --split-max-tensors)."""
    from forecache.cache.budget import parse_size
    from forecache.gguf.maker import make_model

    max_size = parse_size(split_max_size) if split_max_size is not None else 0
    if split_max_size is not None and max_size <= 0:
        raise click.BadParameter("must be a positive size", param_hint="--split-max-size")
    existing = [out] if out.exists() else []
    if split_max_size is not None or split_max_tensors is not None:
        existing += sorted(out.parent.glob(f"{out.stem}-[0-9]*-of-[0-9]*.gguf"))
    if existing and not force:
        raise FileExistsError(f"{existing[0]} exists; pass --force to overwrite it")
    t0 = time.time()
    state = {"last": -1}

    def progress(done: int, total: int) -> None:
        pct = 100 * done // max(total, 1)
        if pct >= state["last"] + 5 or done == total:
            state["last"] = pct
            rate = done / max(time.time() - t0, 1e-9) / 1e6
            click.echo(f"\r  {pct:3d}% of {total / 1e9:.2f} GB ({rate:.0f} MB/s)", nl=False,
                       err=True)

    info = make_model(out, preset, qtype, seed=seed, n_layers=n_layers, workers=workers,
                      progress=progress, fuse_gate_up=fuse_gate_up, split_max_size=max_size,
                      split_max_tensors=split_max_tensors or 0)
    click.echo("", err=True)
    # a dense draft is not a model for -m: it drafts for a MoE model with its vocabulary
    what = f"the dense draft {info.preset} as " if info.dense else ""
    use = "--draft, beside a MoE model with its vocabulary" if info.dense else "-m"
    if len(info.shards) > 1:
        # a model that was one file before is now its shards: the old file would be taken
        if out.exists() and out not in info.shards:
            out.unlink()
        click.echo(f"wrote {what}{len(info.shards)} split files ({info.file_bytes / 1e9:.2f} "
                   f"GB): {info.shards[0]} ... {info.shards[-1].name} in "
                   f"{time.time() - t0:.1f} s; pass the first to {use}")
    else:
        tail = f"; pass it to {use}" if info.dense else ""
        click.echo(f"wrote {what}{info.path} ({info.file_bytes / 1e9:.2f} GB) in "
                   f"{time.time() - t0:.1f} s{tail}")


COMMANDS = [make_model_cmd]

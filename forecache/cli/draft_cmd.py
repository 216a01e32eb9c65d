"""``forecache make-draft``: a draft for speculative decoding cut from the MoE model itself."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

import click

from forecache.cli.model_arg import MODEL

if TYPE_CHECKING:
    import numpy as np

PROFILE_TOKENS = 16  # tokens generated after the calibration text, as the static policy's profile


@click.command("make-draft")
@click.argument("model", type=MODEL)
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--layers", "layers", type=int, required=True,
              help="Keep the model's first N layers (1 to its layer count).")
@click.option("--experts", "n_keep", type=int, default=None, metavar="M",
              help="Keep only each layer's M most-routed experts, counted by a routing profile "
                   "of the model over the calibration text (as the static policy's).")
@click.option("--calibration", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              default=None, help="Text file the --experts profile is counted over (default: "
                                 "the static policy's calibration text).")
@click.option("--force", is_flag=True, help="Overwrite OUT if it exists.")
def make_draft_cmd(model: Path, out: Path, layers: int, n_keep: int | None,
                   calibration: Path | None, force: bool) -> None:
    """Write OUT.gguf: MODEL's token embedding, first N layers (attention, router, experts,
    shared expert), output norm and head, byte for byte, with its vocabulary and architecture.
    Its first N layers compute the model's own states, so as a --draft for MODEL its states
    through MODEL's routers name the experts the verification routes there."""
    from forecache.gguf.truncate import check_draft, make_draft, top_experts

    if calibration is not None and n_keep is None:
        raise click.UsageError("--calibration goes with --experts")
    mf = check_draft(model, out, layers, n_keep=n_keep, force=force)  # before any slow work
    t0 = time.time()
    experts = None
    if n_keep is not None and n_keep < mf.n_expert:
        counts = _routing_profile(model, calibration)
        experts = top_experts(counts.tolist(), layers, n_keep)
        click.echo(f"routing profile: {int(counts[0].sum())} routings a layer in "
                   f"{time.time() - t0:.1f} s", err=True)
    state = {"last": -1, "t0": time.time()}

    def progress(done: int, total: int) -> None:
        pct = 100 * done // max(total, 1)
        if pct >= state["last"] + 5 or done == total:
            state["last"] = pct
            rate = done / max(time.time() - state["t0"], 1e-9) / 1e6
            click.echo(f"\r  {pct:3d}% of {total / 1e9:.2f} GB ({rate:.0f} MB/s)", nl=False,
                       err=True)

    info = make_draft(model, out, layers, experts=experts, force=force, progress=progress)
    click.echo("", err=True)
    kept = f", {info.n_expert} experts a layer" if experts is not None else ""
    click.echo(f"wrote {info.path}: the first {info.n_layer} of {info.source_n_layer} layers of "
               f"{mf.name}{kept} ({info.file_bytes / 1e6:.1f} MB) in {time.time() - t0:.1f} s; "
               f"pass it to --draft beside -m {model}")


def _routing_profile(model: Path, calibration: Path | None) -> np.ndarray:
    """Routed-expert counts [layer, expert] of a greedy run of ``model`` over the calibration
    text, computed from host memory (the static policy's profile)."""
    from forecache.llama import CALIBRATION_TEXT, Llama
    from forecache.placement.options import CacheConfig

    text = calibration.read_bytes() if calibration is not None else CALIBRATION_TEXT.encode() * 2
    with Llama.open(model, cache=CacheConfig("offload")) as llm:
        tokens = llm.tokenize(text)[:max(llm.n_ctx() - PROFILE_TOKENS, 1)]
        return llm.routing_profile(tokens, PROFILE_TOKENS)


COMMANDS = [make_draft_cmd]

"""``forecache pull``: download a published GGUF model from the Hugging Face hub."""

from __future__ import annotations

import click


@click.command("pull")
@click.argument("model")
@click.option("-q", "--quiet", is_flag=True,
              help="No progress bars or per-file lines; print only the model's path.")
def pull_cmd(model: str, quiet: bool) -> None:
    """Download a GGUF model from the Hugging Face hub into the model directory.

    MODEL is a catalog name (`forecache models` lists them) or a hub repo OWNER/REPO[:QUANT],
    as llama.cpp's -hf takes it: the repo's GGUF whose name contains QUANT, or with no QUANT
    its Q4_K_M, else its only model. A split model comes whole (every shard), each file is
    checked against the hub's sha256, and a pull that was interrupted continues where it
    stopped when run again. Then `-m MODEL` runs it. HF_TOKEN (or `hf auth login`) opens gated
    repos; HF_ENDPOINT names another hub.
    """
    from forecache.models.names import pull_model
    from forecache.models.pull import human_size

    def report(line: str) -> None:
        click.echo(f"  {line}", err=True)

    result = pull_model(model, progress=False if quiet else None, report=None if quiet else report)
    if quiet:
        click.echo(str(result.path))
        return
    shards = f" ({len(result.files)} shards)" if len(result.files) > 1 else ""
    size = sum(p.stat().st_size for p in result.files)
    click.echo(f"pulled {result.model_arg}{shards}, {human_size(size)}: {result.path}")
    click.echo(f"run it with `forecache chat -m {result.model_arg}`")


COMMANDS = [pull_cmd]

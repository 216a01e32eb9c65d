"""``forecache build``: the patched llama-cpp-python."""

from __future__ import annotations

from pathlib import Path

import click

from forecache import build as builder


@click.command("build")
@click.option("--source", type=click.Path(path_type=Path),
              help="Local llama-cpp-python sdist (.tar.gz) or unpacked tree, for offline machines "
              "(default: $FORECACHE_LLAMA_SOURCE, else download).")
@click.option("--backend", type=click.Choice(["auto", "cpu", "cuda"]), default="auto",
              show_default=True,
              help="auto: CUDA when nvcc and a GPU are present (FORECACHE_CUDA=1/0 forces).")
@click.option("--force", is_flag=True, help="Rebuild even when a cached wheel exists.")
@click.option("--export-source", type=click.Path(path_type=Path), metavar="DIR",
              help="Only write a trimmed, unpatched source tree to DIR (to carry offline).")
@click.option("--reference", is_flag=True,
              help="Build the unpatched llama-cpp-python the tests compare with, into the cache "
              "(not into this environment).")
def build(source: Path | None, backend: str, force: bool, export_source: Path | None,
          reference: bool) -> None:
    """Build and install forecache's patched llama-cpp-python (cached after the first time)."""
    if export_source:
        out = builder.export_source(source, export_source)
        click.echo(f"wrote trimmed source tree to {out}")
        return
    if reference:
        site = builder.build_reference(source, builder.choose_backend(backend), force)
        click.echo(f"unpatched reference ready in {site}")
        return
    info = builder.build(source, backend, force)
    click.echo(f"ready: llama-cpp-python {info['version']}+forecache.{info['key']} "
               f"({info['backend']})")


COMMANDS = [build]

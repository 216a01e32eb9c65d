"""Turning the errors users can cause into one clear line and a non-zero exit."""

from __future__ import annotations

import sys

import click

from forecache.bindings import PatchedBuildError
from forecache.engine import ModelLoadError
from forecache.gguf_inspect import GGUFError
from forecache.llama_build import BuildError

USER_ERRORS = (GGUFError, PatchedBuildError, ModelLoadError, BuildError, ValueError,
               FileExistsError, PermissionError)


def main_guard(cli: click.Group) -> None:
    """Run the CLI; known errors print ``forecache: error: ...`` and exit 1, Ctrl-C exits 130."""
    try:
        cli.main(standalone_mode=False)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except click.exceptions.Abort:
        click.echo("forecache: interrupted", err=True)
        sys.exit(130)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        click.echo("\nforecache: interrupted", err=True)
        sys.exit(130)
    except USER_ERRORS as e:
        click.echo(f"forecache: error: {e}", err=True)
        sys.exit(1)

"""Turning the errors users can cause into one clear line and a non-zero exit."""

from __future__ import annotations

import signal
import sys

import click

from forecache.build import BuildError
from forecache.cache.runtime import CacheError
from forecache.errors import use_flag_names
from forecache.gguf.header import GGUFError
from forecache.interrupt import Terminated, raise_on_signals, signal_line
from forecache.native import PatchedBuildError
from forecache.native.libs import ModelLoadError

# OSError covers the file-system problems users meet: disk full, permissions, existing output.
USER_ERRORS = (GGUFError, PatchedBuildError, ModelLoadError, BuildError, CacheError, ValueError,
               OSError)


def main_guard(cli: click.Group) -> None:
    """Run the CLI; known errors print ``forecache: error: ...`` and exit 1, Ctrl-C exits 130."""
    try:
        # from here on SIGTERM unwinds like Ctrl-C, so partial outputs are removed by their
        # writers' cleanup (inside the try: one that comes at once is taken below)
        raise_on_signals()
        use_flag_names()  # the library's messages name --flags, not keyword arguments
        cli.main(standalone_mode=False)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except click.exceptions.Abort as e:  # click's wrapping of KeyboardInterrupt
        _exit_on_signal(e.__cause__, "")
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except KeyboardInterrupt as e:
        _exit_on_signal(e, "\n")
    except USER_ERRORS as e:
        click.echo(f"forecache: error: {e}", err=True)
        sys.exit(1)


def _exit_on_signal(exc: BaseException | None, lead: str) -> None:
    """Exit 143 for SIGTERM (Terminated), 130 for Ctrl-C, saying which."""
    signum = signal.SIGTERM if isinstance(exc, Terminated) else signal.SIGINT
    click.echo(f"{lead}{signal_line(signum)}", err=True)
    sys.exit(128 + signum)

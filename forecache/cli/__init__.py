"""The ``forecache`` command line."""

from __future__ import annotations

import click

from forecache import __version__
from forecache.cli.errors import main_guard


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="forecache")
def cli() -> None:
    """forecache: run Mixture-of-Experts GGUF models larger than GPU memory on llama.cpp."""


def _register() -> None:
    from forecache.cli import (
        batch_cmd,
        bench_cmd,
        build_cmd,
        chat_cmd,
        doctor_cmd,
        draft_cmd,
        generate_cmd,
        model_cmds,
        models_cmd,
        plan_cmd,
        predictor_cmds,
        pull_cmd,
        rpc_cmd,
        serve_cmd,
        simulate_cmd,
        stats_cmd,
    )

    for mod in (batch_cmd, bench_cmd, build_cmd, chat_cmd, doctor_cmd, draft_cmd, generate_cmd,
                model_cmds, models_cmd, plan_cmd, predictor_cmds, pull_cmd, rpc_cmd, serve_cmd,
                simulate_cmd, stats_cmd):
        for cmd in mod.COMMANDS:
            cli.add_command(cmd)


_register()


def main() -> None:
    """The command line, its errors one line each (``forecache.__main__.main`` runs it with
    the signals taken over from the start)."""
    main_guard(cli)

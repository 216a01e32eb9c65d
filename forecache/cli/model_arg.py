"""The ``-m/--model`` option: a GGUF path or a model name from models.yaml."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import click


class ModelArg(click.ParamType):
    """Resolves names to files (forecache.models.names); a missing file is reported by the
    command when it opens it, with the reason."""

    name = "MODEL"

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> Path:
        from forecache.models.names import resolve_model_arg

        return resolve_model_arg(value)  # ModelNotFoundError: one line through the error guard


MODEL = ModelArg()


def model_option(required: bool = False, default: str | None = None,
                 purpose: str = "") -> Callable[[Any], Any]:
    """``-m/--model``: a GGUF file or a name (`forecache models` lists them). ``default="default"``
    makes the built-in default model the default (made on first use, when the option is
    omitted)."""
    text = "GGUF file or model name (`forecache models` lists them)"
    if purpose:
        text += f"; {purpose}"
    if default == "default":
        text += "; default: the built-in default model"
    if required:  # no default at all: click 8.3+ takes an explicit default=None as given
        return click.option("-m", "--model", "model", type=MODEL, required=True, help=text + ".")
    return click.option("-m", "--model", "model", type=MODEL, default=default, help=text + ".")

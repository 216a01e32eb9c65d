"""Naming a setting in a message for whoever reads it.

The library is used from Python (``Llama(model, gpu_budget="8GiB")``) and from the ``forecache``
command line (``--gpu-budget 8GiB``): an error that says what to change names the keyword
argument in the first case and the flag in the second. The command line's entry points call
``use_flag_names()`` once; everything else calls ``setting``.
"""

from __future__ import annotations

# Keyword arguments whose command-line flag is not the keyword with dashes for underscores.
FLAGS = {
    "n_ctx": "--ctx",
    "n_parallel": "--parallel",
    "model_path": "-m",
}

_NO_VALUE = object()
# Process-wide rather than a ContextVar: the command line is the whole process, and messages
# are also made on worker threads, which start with a fresh context.
_flag_names = False


def use_flag_names(enabled: bool = True) -> None:
    """Name settings by their command-line flags from now on (the CLI's entry points call this)."""
    global _flag_names
    _flag_names = enabled


def flag_names() -> bool:
    """Whether messages name command-line flags (the ``forecache`` command is running)."""
    return _flag_names


def setting(name: str, value: object = _NO_VALUE, *, flag: str | None = None) -> str:
    """``name`` (a keyword argument) as the reader spells it: ``--gpu-budget`` on the command
    line, ``gpu_budget=`` in Python. With ``value``: ``--window 2`` / ``window=2`` (a true boolean
    is the bare flag: ``--verbose`` / ``verbose=True``). ``flag`` names the flag where one
    command sets the keyword under another name than ``FLAGS`` gives."""
    if _flag_names:
        flag = flag or FLAGS.get(name, "--" + name.replace("_", "-"))
        if value is _NO_VALUE or value is True:
            return flag
        return f"{flag} {value}"
    if value is _NO_VALUE:
        return f"{name}="
    return f"{name}={value!r}"

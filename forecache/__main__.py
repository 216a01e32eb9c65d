"""``python -m forecache``: the same as the ``forecache`` command."""

from forecache.cli import main

main()

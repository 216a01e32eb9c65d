"""Build and install the patched llama-cpp-python that forecache runs on.

``python -m forecache.build [--source PATH] [--backend auto|cpu|cuda] [--force]
[--export-source DIR] [--reference]``: the same as ``forecache build``, with the standard library
only, so that it runs before the project's dependencies exist (``make setup``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from forecache.build.base import BuildError, log
from forecache.build.reference import build_reference
from forecache.build.sources import export_source
from forecache.build.toolchain import choose_backend
from forecache.build.wheels import build
from forecache.errors import use_flag_names


def main(argv: list[str] | None = None) -> int:
    """Command-line entry: ``python -m forecache.build`` (also ``forecache build``)."""
    ap = argparse.ArgumentParser(prog="forecache build", description=__doc__.splitlines()[0])
    ap.add_argument("--source", type=Path, help="local sdist (.tar.gz) or unpacked source tree "
                    "(default: $FORECACHE_LLAMA_SOURCE, else download)")
    ap.add_argument("--backend", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--force", action="store_true", help="rebuild even when a cached wheel exists")
    ap.add_argument("--export-source", type=Path, metavar="DIR",
                    help="only write a trimmed source tree to DIR (for offline machines)")
    ap.add_argument("--reference", action="store_true",
                    help="build the unpatched reference the tests compare with, into the "
                    "cache, not into the environment")
    args = ap.parse_args(argv)
    use_flag_names()
    try:
        if args.export_source:
            out = export_source(args.source, args.export_source)
            log(f"wrote trimmed source tree to {out}")
            return 0
        if args.reference:
            build_reference(args.source, choose_backend(args.backend), force=args.force)
            return 0
        info = build(args.source, args.backend, args.force)
    except BuildError as e:
        print(f"forecache build: error: {e}", file=sys.stderr)
        return 1
    log(f"ready: llama-cpp-python {info['version']}+forecache.{info['key']} ({info['backend']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

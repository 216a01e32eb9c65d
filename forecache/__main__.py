"""The ``forecache`` command (``python -m forecache`` runs the same).

Ctrl-C and SIGTERM are taken over before the command line is imported: its modules take most of
a second to import, and a signal in that time ends the process with the same one line and exit
status (130, 143) as one while the command runs. Only light standard-library modules above
``main``.
"""

import signal
import sys

from forecache.interrupt import Terminated, exit_on_signals, signal_line


def main() -> None:
    """Console-script entry point: the command line, with signals handled from the start to the
    interpreter's exit."""
    exit_on_signals()
    try:
        from forecache.cli import main as cli_main

        cli_main()
    except KeyboardInterrupt as e:  # one that came while the command line handled another
        exit_on_signals()
        signum = signal.SIGTERM if isinstance(e, Terminated) else signal.SIGINT
        print(signal_line(signum), file=sys.stderr)
        sys.exit(128 + signum)
    finally:
        exit_on_signals()  # the command is over: a signal now cuts only the interpreter's exit
        # A KeyboardInterrupt that passed through code exec() or eval() ran from a string (as
        # dataclasses and namedtuple make methods), even one handled, marks it unhandled, and
        # `python -m` then ends the process by SIGINT instead of with its exit status; each
        # string evaluated clears that mark first.
        eval("None")


if __name__ == "__main__":
    main()

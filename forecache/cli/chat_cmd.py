"""``forecache chat``: multi-turn chat in the terminal."""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click

from forecache.cli.generate_cmd import (
    cache_options,
    cli_options,
    ctx_option,
    say_choice,
    threads_option,
    ubatch_args,
    ubatch_option,
)
from forecache.cli.model_arg import model_option
from forecache.interrupt import Terminated
from forecache.paths import chat_history_file

if TYPE_CHECKING:
    from forecache.chat import ChatSession

HELP = """commands:
  /reset          forget the conversation (the system message stays)
  /stats          speed of the last answer and the expert cache's counters
  /system [TEXT]  show or set the system message
  /save FILE      write the conversation as JSON
  /exit           quit (Ctrl-D too); Ctrl-C stops an answer (before its first token, the
                  message is left out of the conversation)"""


def _line_editing() -> Path | None:
    """Turn on readline's line editing and history for input(); the history file, if any."""
    try:
        import readline
    except ImportError:  # no readline on this platform: plain input still works
        return None
    path = chat_history_file()
    try:
        readline.read_history_file(path)
    except OSError:
        pass
    readline.set_history_length(1000)
    return path


def _save_history(path: Path | None) -> None:
    if path is None:
        return
    import readline

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        readline.write_history_file(path)
    except OSError as e:
        click.echo(f"forecache: could not save the input history to {path}: {e}", err=True)


def _stream(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _command(session: ChatSession, line: str) -> bool:
    """Run a /command; False when the chat should end."""
    name, _, arg = line.partition(" ")
    arg = arg.strip()
    if name in ("/exit", "/quit"):
        return False
    if name == "/reset":
        session.reset()
        click.echo("(conversation cleared)", err=True)
    elif name == "/stats":
        from forecache.chat import stats_report

        click.echo(stats_report(session), err=True)
    elif name == "/system":
        if arg:
            session.system = arg
            click.echo("(system message set)", err=True)
        else:
            click.echo(f"system: {session.system or '(none: the template default)'}", err=True)
    elif name == "/save":
        if not arg:
            click.echo("usage: /save FILE", err=True)
        else:
            path = Path(arg).expanduser()
            try:
                session.save(path)
                click.echo(f"(saved {len(session.messages())} messages to {path})", err=True)
            except OSError as e:
                click.echo(f"could not save to {path}: {e.strerror or e}", err=True)
    elif name in ("/help", "/?"):
        click.echo(HELP, err=True)
    else:
        click.echo(f"unknown command {name}; /help lists them", err=True)
    return True


@click.command("chat")
@model_option(default="default")
@click.option("--system", default=None, help="System message.")
@click.option("--max-tokens", default=512, show_default=True, help="Longest answer, in tokens.")
@click.option("--temp", default=0.7, show_default=True, help="Sampling temperature (0: greedy).")
@click.option("--seed", default=0, show_default=True, help="Sampling seed.")
@ctx_option
@threads_option
@click.option("--verbose", is_flag=True, help="Show llama.cpp's own log.")
@ubatch_option
@cache_options
def chat(model: Path, system: str | None, max_tokens: int, temp: float, seed: int,
         n_ctx: int, threads: int | None, verbose: bool, ubatch: int | None,
         **cache_opts: object) -> None:
    """Chat with a model in the terminal, using the model's own chat template.

    Answers stream as they are generated; earlier turns stay in the KV cache, so only the new
    message is prefilled. After each answer a status line gives tokens/s, TTFT, the expert
    cache's hit rate and its use of GPU memory.
    """
    from forecache.chat import ChatSession
    from forecache.generate import SamplingParams
    from forecache.llama import Llama

    sampling = SamplingParams(greedy=temp <= 0, temperature=temp)
    llm = Llama.open(model, options=cli_options(cache_opts), n_ctx=n_ctx, n_threads=threads,
                     seed=seed, verbose=verbose, **ubatch_args(ubatch))
    mf = llm.model_file
    try:
        llm.format_chat([{"role": "user", "content": "hi"}])  # refuse a model without template
        session = ChatSession(llm, system=system, max_tokens=max_tokens, sampling=sampling)
        stats = llm.expert_stats()
        click.echo(f"forecache chat: {model.name} ({mf.arch}, {mf.n_layer} layers, "
                   f"{mf.n_expert} experts, top-{mf.n_expert_used}), policy {stats['policy']}, "
                   f"context {llm.n_ctx()}", err=True)
        say_choice(llm)
        click.echo("/help lists commands; Ctrl-C stops an answer; Ctrl-D or /exit quits.",
                   err=True)
        _loop(session)
    finally:
        llm.close()


def _loop(session: ChatSession) -> None:
    from forecache.chat import status_line

    history = _line_editing() if sys.stdin.isatty() else None
    try:
        while True:
            try:
                line = input("> ")
            except EOFError:
                click.echo("", err=True)
                break
            except Terminated:
                raise  # SIGTERM quits (exit 143); Ctrl-C only clears the line
            except KeyboardInterrupt:
                click.echo("\n(Ctrl-D or /exit quits)", err=True)
                continue
            line = line.strip()
            if not line:
                continue
            if line.startswith("/"):
                if not _command(session, line):
                    break
                continue
            try:
                turn = session.ask(line, on_text=_stream)
            except ValueError as e:
                click.echo(f"forecache: {e}", err=True)
                continue
            sys.stdout.write("\n")
            sys.stdout.flush()
            click.echo(status_line(turn), err=True)
            if not turn.answered:  # say where the message went: it is not in the conversation
                recall = "; the up arrow brings it back" if history is not None else ""
                click.echo(f"(your message is left out of the conversation{recall})", err=True)
            if turn.signum == signal.SIGTERM:
                raise Terminated
    finally:
        _save_history(history)


COMMANDS = [chat]

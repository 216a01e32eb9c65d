"""Requests as JSON lines: the format ``forecache batch --input`` and ``forecache trace
--prompts`` read, one object a line with "prompt" (text) or "messages" (chat messages), and
optionally "id", "max_tokens" and the sampling fields. Both commands apply the same rules: unknown
fields, empty prompts, lone surrogates and duplicate ids are refused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from forecache.generate import SamplingParams

DEFAULT_MAX_TOKENS = 128
_FIELDS = {"id", "prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "min_p",
           "seed", "stop"}


class BatchInputError(ValueError):
    """The input file cannot be read at all."""


@dataclass
class Request:
    """One line of the input."""

    id: str
    line: int
    prompt: str | None = None
    messages: list[dict] | None = None
    max_tokens: int = DEFAULT_MAX_TOKENS
    sampling: SamplingParams = field(default_factory=SamplingParams)  # temperature 0: greedy
    seed: int = 0
    stop: list[str] = field(default_factory=list)


def _number(obj: dict, key: str, kind: type, default: float | int, lo: float,
            hi: float) -> float | int:
    value = obj.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            (kind is int and not float(value).is_integer()):
        raise ValueError(f'"{key}" must be {"an integer" if kind is int else "a number"}')
    if not lo <= value <= hi:
        raise ValueError(f'"{key}" must be between {lo} and {hi}, not {value}')
    return kind(value)


def _unicode(value: str, what: str) -> str:
    """``value``, refused when it holds a lone surrogate (valid JSON, but no UTF-8 text)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} is not valid Unicode: a lone surrogate "
                         f"U+{ord(value[e.start]):04X} at character {e.start}") from None
    return value


def parse_request(text: str, line: int, default_max_tokens: int) -> Request:
    """A Request from one JSON line; ValueError says what is wrong with it."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise ValueError("not a JSON object")
    unknown = sorted(set(obj) - _FIELDS)
    if unknown:
        raise ValueError(f"unknown field(s) {', '.join(unknown)}; "
                         f"known: {', '.join(sorted(_FIELDS))}")
    rid = obj.get("id", f"line-{line}")
    if not isinstance(rid, (str, int)) or isinstance(rid, bool):
        raise ValueError('"id" must be a string or an integer')
    req = Request(id=_unicode(str(rid), '"id"'), line=line)
    if ("prompt" in obj) == ("messages" in obj):
        raise ValueError('give one of "prompt" and "messages"')
    if "prompt" in obj:
        if not isinstance(obj["prompt"], str) or not obj["prompt"]:
            raise ValueError('"prompt" must be a non-empty string')
        req.prompt = _unicode(obj["prompt"], '"prompt"')
    else:
        msgs = obj["messages"]
        if not isinstance(msgs, list) or not msgs or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and
                isinstance(m.get("content"), str) for m in msgs):
            raise ValueError('"messages" must be a non-empty list of {"role", "content"} strings')
        for i, m in enumerate(msgs):
            _unicode(m["role"], f'"messages"[{i}].role')
            _unicode(m["content"], f'"messages"[{i}].content')
        req.messages = msgs
    req.max_tokens = int(_number(obj, "max_tokens", int, default_max_tokens, 1, 1 << 20))
    sp = req.sampling
    sp.temperature = float(_number(obj, "temperature", float, sp.temperature, 0, 100))
    sp.greedy = sp.temperature == 0
    sp.top_p = float(_number(obj, "top_p", float, sp.top_p, 0, 1))
    sp.top_k = int(_number(obj, "top_k", int, sp.top_k, 0, 1 << 30))
    sp.min_p = float(_number(obj, "min_p", float, sp.min_p, 0, 1))
    req.seed = int(_number(obj, "seed", int, req.seed, 0, 2**63 - 1))
    stop = obj.get("stop", [])
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise ValueError('"stop" must be a string or a list of non-empty strings')
    req.stop = [_unicode(x, '"stop"') for x in stop]
    return req


def read_requests(path: Path, default_max_tokens: int = DEFAULT_MAX_TOKENS,
                  ) -> tuple[list[Request], list[dict]]:
    """The requests of an input file and error records for its malformed lines (with their
    ``line``). A file that cannot be read at all raises BatchInputError."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise BatchInputError(f"input file not found: {path}") from None
    except IsADirectoryError:
        raise BatchInputError(f"{path} is a directory, not a JSONL file") from None
    except OSError as e:
        raise BatchInputError(f"cannot read {path}: {e.strerror or e}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BatchInputError(f"{path} is not UTF-8 text (byte {e.start}); the input must be "
                              "JSON lines") from None
    lines = text.split("\n")
    complete = text.endswith("\n")
    requests: list[Request] = []
    errors: list[dict] = []
    seen: set[str] = set()
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            req = parse_request(line, i, default_max_tokens)
            if req.id in seen:
                raise ValueError(f"duplicate id {req.id!r}")
        except ValueError as e:
            msg = str(e)
            if i == len(lines) and not complete:
                msg += " (the last line has no newline: was the file still being written?)"
            # keyed by its line, never by the id it names: that id may be a valid request's,
            # which a rerun would then take as done
            record = {"id": f"line-{i}", "line": i, "error": msg}
            named = _id_of(line)
            if named is not None:
                record["request_id"] = named
            errors.append(record)
            continue
        seen.add(req.id)
        requests.append(req)
    return requests, errors


def _id_of(line: str) -> str | None:
    """The id a malformed line names, when it can be read and written as UTF-8."""
    try:
        rid = json.loads(line).get("id")
        if isinstance(rid, (str, int)) and not isinstance(rid, bool):
            return _unicode(str(rid), "id")
    except (ValueError, AttributeError):
        pass
    return None

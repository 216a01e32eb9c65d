"""One JSONL request format: `forecache batch --input` and `forecache trace --prompts` read it with
the same rules."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import pytest

from forecache.jobs.requests import read_requests
from forecache.record import load_prompts

GOOD = '{"id": "ok", "prompt": "fine"}'
BAD = {
    "unknown field": ('{"id": "x", "prompt": "hi", "category": "chat"}',
                      "unknown field(s) category"),
    "empty prompt": ('{"prompt": ""}', '"prompt" must be a non-empty string'),
    "lone surrogate": ('{"prompt": "a\\ud800b"}', "lone surrogate U+D800"),
    "not JSON": ('{"prompt": ', "not JSON"),
    "prompt and messages": ('{"prompt": "a", "messages": [{"role": "user", "content": "b"}]}',
                            'give one of "prompt" and "messages"'),
    "bad messages": ('{"messages": [{"role": "user"}]}', '"messages" must be a non-empty list'),
    "duplicate id": ('{"id": "ok", "prompt": "again"}', "duplicate id 'ok'"),
    "bad sampling": ('{"prompt": "a", "temperature": "hot"}', '"temperature" must be a number'),
}


@pytest.mark.parametrize("case", BAD)
def test_batch_and_trace_refuse_the_same_lines(tmp_path: Path, case: str) -> None:
    line, message = BAD[case]
    path = tmp_path / "in.jsonl"
    path.write_text(f"{GOOD}\n{line}\n", encoding="utf-8")
    requests, errors = read_requests(path)
    assert [r.id for r in requests] == ["ok"]
    assert len(errors) == 1 and errors[0]["line"] == 2 and message in errors[0]["error"]
    with pytest.raises(ValueError) as trace_error:
        load_prompts(path)
    assert str(trace_error.value) == f"{path}:2: {errors[0]['error']}"


def test_good_lines_read_the_same(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_text('{"prompt": "plain", "max_tokens": 3, "temperature": 0}\n\n'
                    '{"id": 7, "messages": [{"role": "user", "content": "chat"}]}\n')
    batch, errors = read_requests(path)
    assert not errors
    assert load_prompts(path) == batch
    assert [(r.id, r.prompt, r.messages) for r in batch] == [
        ("line-1", "plain", None), ("7", None, [{"role": "user", "content": "chat"}])]


def test_shipped_prompt_sets_parse() -> None:
    root = resources.files("forecache") / "data" / "prompts"
    files = [Path(str(p)) for p in root.iterdir() if p.name.endswith(".jsonl")]
    assert files
    for path in files:
        requests, errors = read_requests(path)
        assert not errors and requests, path
        assert len(load_prompts(path)) == len(requests)

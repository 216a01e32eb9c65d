"""Bad model files get one clear line and a non-zero exit, never a traceback."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from cli_helpers import run_cli

from forecache.gguf.header import GGUFError, read_model_file, require_moe


def _dense_gguf(path: Path) -> Path:
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_embedding_length(8)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.add_tensor("blk.0.ffn_up.weight", np.zeros((8, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _assert_one_line_error(args: list[str], needle: str) -> None:
    res = run_cli(*args)
    assert res.returncode == 1, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    assert lines[0].startswith("forecache: error:") and needle in lines[0], lines[0]


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(GGUFError, match="model file not found"):
        read_model_file(tmp_path / "nope.gguf")
    _assert_one_line_error(["generate", "-m", str(tmp_path / "nope.gguf"), "-p", "x"],
                           "model file not found")


def test_a_missing_file_points_at_the_names_not_at_make_model(tmp_path: Path) -> None:
    # `make-model PATH --preset tiny` would write random weights under the mistyped name
    for cmd in (["generate", "-p", "x"], ["run"], ["chat"]):
        args = [cmd[0], "-m", str(tmp_path / "defualt.gguf"), *cmd[1:]]
        _assert_one_line_error(args, "a model name such as -m default (the built-in default "
                                     "model; `forecache models` lists the names)")
        assert "make-model" not in run_cli(*args).stderr


def test_not_gguf(tmp_path: Path) -> None:
    p = tmp_path / "notes.gguf"
    p.write_text("just some text\n")
    _assert_one_line_error(["generate", "-m", str(p), "-p", "x"], "is not a GGUF file")


def test_empty_file(tmp_path: Path) -> None:
    p = tmp_path / "empty.gguf"
    p.write_bytes(b"")
    _assert_one_line_error(["generate", "-m", str(p), "-p", "x"], "is not a GGUF file")


def test_truncated_file(tmp_path: Path, tiny_model: Callable[[str], Path]) -> None:
    data = tiny_model("q8_0").read_bytes()
    cut_data = tmp_path / "cut-data.gguf"
    cut_data.write_bytes(data[: len(data) - 1000])
    _assert_one_line_error(["generate", "-m", str(cut_data), "-p", "x"], "is truncated")
    cut_header = tmp_path / "cut-header.gguf"
    cut_header.write_bytes(data[:2000])
    _assert_one_line_error(["generate", "-m", str(cut_header), "-p", "x"], "truncated")


def _with_tail(model: Path, path: Path, tail: int) -> Path:
    """A copy of ``model`` followed by ``tail`` zero bytes (a hole: no disk is used)."""
    shutil.copyfile(model, path)
    with open(path, "r+b") as f:
        f.truncate(model.stat().st_size + tail)
    return path


def test_a_long_tail_after_the_tensors_is_refused_unread(tmp_path: Path,
                                                         tiny_model: Callable[[str], Path]
                                                         ) -> None:
    """A valid model followed by gigabytes of zeros is refused in one line (the file, the bytes
    after the tensors, the fix) before llama.cpp maps the file, which would fault every page
    of it in; padding after the last tensor is still a model."""
    model = tiny_model("q8_0")
    end = model.stat().st_size
    huge = _with_tail(model, tmp_path / "huge.gguf", 64 << 30)
    with pytest.raises(GGUFError, match=f"has {64 << 30} bytes after its last tensor, which "
                       f"ends at byte {end}; .*{re.escape(f'`truncate -s {end} {huge}`')}"):
        require_moe(huge)
    assert require_moe(_with_tail(model, tmp_path / "padded.gguf", 4096)).is_moe
    # through the command line, with a tail of 2 GiB: a run that read it would grow past it
    tail = _with_tail(model, tmp_path / "tail.gguf", 2 << 30)
    proc = subprocess.Popen([sys.executable, "-m", "forecache", "generate", "-m", str(tail),
                             "-p", "x", "-n", "1"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    err = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)  # the child's own peak memory
    proc.returncode = os.waitstatus_to_exitcode(status)
    assert proc.returncode == 1, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and f"has {2 << 30} bytes after its last tensor" in lines[0], err
    assert usage.ru_maxrss * 1024 < 1 << 30, f"peak RSS {usage.ru_maxrss >> 10} MiB"
    for p in (huge, tail):  # holes, but tools that copy the directory would write them out
        p.unlink()


def test_non_moe_model(tmp_path: Path) -> None:
    p = _dense_gguf(tmp_path / "dense.gguf")
    assert read_model_file(p).arch == "llama"
    with pytest.raises(GGUFError, match="not a Mixture-of-Experts model"):
        require_moe(p)
    _assert_one_line_error(["generate", "-m", str(p), "-p", "x"], "not a Mixture-of-Experts")


def test_inspect_reads_tiny(tiny_model: Callable[[str], Path]) -> None:
    mf = require_moe(tiny_model("q4_k"))
    assert mf.arch == "qwen2moe" and mf.is_moe
    assert mf.n_expert == 16 and mf.n_expert_used == 4 and mf.n_layer == 4
    assert 0 < mf.total_expert_bytes() < mf.total_bytes()
    assert mf.data_offset + max(t.offset + t.nbytes for t in mf.tensors) <= mf.file_size


def test_make_model_refuses_to_overwrite(tmp_path: Path) -> None:
    p = tmp_path / "m.gguf"
    p.write_text("precious")
    _assert_one_line_error(["make-model", str(p), "--preset", "tiny"], "exists")
    assert p.read_text() == "precious"


def test_unknown_preset(tmp_path: Path) -> None:
    _assert_one_line_error(["make-model", str(tmp_path / "m.gguf"), "--preset", "nope"], "nope")


def test_budget_too_small(tiny_model: Callable[[str], Path]) -> None:
    args = ["generate", "-m", str(tiny_model("q8_0")), "-p", "x", "--policy", "lru"]
    _assert_one_line_error([*args, "--gpu-budget", "1MiB"], "need at least")


def test_budget_larger_than_device(tiny_model: Callable[[str], Path]) -> None:
    args = ["generate", "-m", str(tiny_model("q8_0")), "-p", "x", "--policy", "lru"]
    _assert_one_line_error([*args, "--gpu-budget", "1000TiB"], "is larger than")


def test_policy_without_size_and_bad_size(tiny_model: Callable[[str], Path]) -> None:
    args = ["generate", "-m", str(tiny_model("q8_0")), "-p", "x"]
    _assert_one_line_error([*args, "--policy", "static"], "needs --gpu-budget")
    _assert_one_line_error([*args, "--gpu-budget", "lots"], "cannot read size")
    _assert_one_line_error([*args, "--cache-fraction", "1.5"], "--cache-fraction")


def test_non_moe_model_with_policy(tmp_path: Path) -> None:
    p = _dense_gguf(tmp_path / "dense.gguf")
    _assert_one_line_error(["generate", "-m", str(p), "-p", "x", "--policy", "lru",
                            "--gpu-budget", "1GiB"], "not a Mixture-of-Experts")


def test_predictor_commands_refuse_bad_input(tmp_path: Path,
                                             tiny_model: Callable[[str], Path]) -> None:
    bad = tmp_path / "t.npz"
    bad.write_bytes(b"garbage")
    _assert_one_line_error(["eval-predictor", "--trace", str(bad)], "not a trace file")
    _assert_one_line_error(["eval-predictor", "--trace", str(tmp_path / "none.npz")],
                           "no such trace file")
    good = tmp_path / "g.npz"
    np.savez(good, experts=np.zeros((4, 2, 2), np.int16), seq=np.zeros(4, np.int32))
    _assert_one_line_error(["eval-predictor", "--trace", str(good), "--predictors", "magic"],
                           "unknown predictor magic")
    _assert_one_line_error(["eval-predictor", "--trace", str(good), "--window", "0"],
                           "windows are integers >= 1")
    _assert_one_line_error(["train", "-m", str(tiny_model("q8_0")), "--trace", str(good),
                            "--window", "1"], "records no model identity")

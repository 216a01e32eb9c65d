"""-m NAME: models.yaml's catalog, the model directory, and what users are told."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from forecache.models.names import ModelNotFoundError, catalog, resolve_model


def _cli(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "forecache", *args], capture_output=True,
                          text=True, timeout=120, env={**os.environ, **env})


def test_a_name_finds_its_file_in_the_model_dir(tmp_path: Path, tiny_model,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FORECACHE_MODEL_DIR", str(tmp_path))
    entry = catalog()["qwen2-57b-a14b-instruct"]
    with pytest.raises(ModelNotFoundError, match=str(tmp_path)):
        resolve_model("qwen2-57b-a14b-instruct")
    # the publisher's file name, in another case
    dest = tmp_path / entry.file.upper().replace(".GGUF", ".gguf")
    shutil.copy(tiny_model("q8_0"), dest)
    assert resolve_model("qwen2-57b-a14b-instruct") == dest
    # another quantization of the same model is found too, and a path passes through
    dest.unlink()
    other = tmp_path / "Qwen2-57B-A14B-Instruct-Q8_0.gguf"
    shutil.copy(tiny_model("q8_0"), other)
    assert resolve_model("qwen2-57b-a14b-instruct") == other
    assert resolve_model(str(tmp_path / "x.gguf")) == tmp_path / "x.gguf"
    res = _cli("generate", "-m", "qwen2-57b-a14b-instruct", "-p", "hi", "-n", "2", "--greedy",
               env={"FORECACHE_MODEL_DIR": str(tmp_path)})
    assert res.returncode == 0, res.stderr


def test_a_missing_named_model_says_where_to_put_which_file(tmp_path: Path) -> None:
    res = _cli("generate", "-m", "qwen2-57b-a14b-instruct", "-p", "hi", "-n", "1",
               env={"FORECACHE_MODEL_DIR": str(tmp_path)})
    assert res.returncode == 1
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1
    assert str(tmp_path) in lines[0] and "qwen2-57b-a14b-instruct-q4_k_m.gguf" in lines[0]
    assert "Qwen/Qwen2-57B-A14B-Instruct-GGUF" in lines[0]

    res = _cli("run", "-m", "no-such-model", env={"FORECACHE_MODEL_DIR": str(tmp_path)})
    assert res.returncode == 1 and len(res.stderr.strip().splitlines()) == 1
    assert "qwen2-57b-a14b-instruct" in res.stderr and "default" in res.stderr


def test_models_lists_names_and_whether_they_are_found(tmp_path: Path, tiny_model) -> None:
    shutil.copy(tiny_model("q8_0"), tmp_path / "qwen1_5-moe-a2_7b-chat-q4_k_m.gguf")
    res = _cli("models", "--json", env={"FORECACHE_MODEL_DIR": str(tmp_path)})
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["model_dir"] == str(tmp_path)
    rows = {r["name"]: r for r in doc["models"]}
    assert rows["qwen1.5-moe-a2.7b-chat"]["found"] is True
    assert rows["qwen2-57b-a14b-instruct"]["found"] is False
    assert rows["default"]["found"] is True and "tiny" in rows
    # a shape make-model cannot write is listed as the simulator's, not offered to make-model
    assert rows["qwen3.5-397b-a17b"]["kind"] == "simulator shape"
    assert rows["qwen3-235b-a22b"]["kind"] == "random-weight shape"


def test_a_bad_catalog_entry_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "models.yaml"
    bad.write_text("catalog:\n  broken:\n    hf_repo: someone/else\n")
    with pytest.raises(ValueError, match="broken.*needs `file`"):
        catalog(bad)

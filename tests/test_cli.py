"""Every command's help works, and the commands users run first do their job."""

from __future__ import annotations

import json
import re
import subprocess

import pytest
from cli_helpers import run_cli

COMMANDS = ["batch", "bench", "build", "chat", "doctor", "eval-predictor", "generate", "make-draft",
            "make-model", "models", "plan", "pull", "routing-stats", "rpc-server", "run", "serve",
            "simulate", "synth-trace", "trace", "train"]


def test_top_level_help_lists_commands() -> None:
    res = run_cli("--help", check=True)
    lines = res.stdout.split("Commands:", 1)[1].splitlines()
    # one line per command, "  name  summary" (click wraps long summaries further indented)
    listed = [line.split()[0] for line in lines if line.startswith("  ") and line[2] != " "]
    assert listed == COMMANDS


@pytest.mark.parametrize("cmd", COMMANDS)
def test_command_help(cmd: str) -> None:
    res = run_cli(cmd, "--help", check=True)
    usage, _, rest = res.stdout.partition("\n")
    # the command's own help: its usage line, a description and its options
    assert usage.startswith("Usage: ") and f" forecache {cmd} [OPTIONS]" in usage
    assert rest.strip() and "Options:" in rest and "--help" in rest


def test_doctor_json_reports_build_and_devices() -> None:
    res = run_cli("doctor", "--json", "--probe-mib", "16", check=True)
    report = json.loads(res.stdout)
    assert report["patch_version"] >= 1
    assert report["patch_series_hash"]
    assert report["cpu_count"] >= 1
    assert report["host_memcpy_gbps"] > 0
    disk = report["disk"]  # the disk tier's read rate where models are kept
    assert disk["qd1_gbps"] > 0 and disk["qd8_gbps"] > 0 and isinstance(disk["direct_io"], bool)
    assert any(d["type"] == "cpu" and d["memory_total_bytes"] > 0 for d in report["devices"])
    for d in report["devices"]:
        if d["type"] == "gpu":
            assert d["h2d_gbps_pinned"] > 0 and d["d2h_gbps_pinned"] > 0


def test_doctor_text() -> None:
    res = run_cli("doctor", "--no-measure", check=True)
    assert "patch series" in res.stdout and "devices:" in res.stdout


@pytest.mark.parametrize("cmd", ["batch", "generate", "bench", "trace", "train"])
def test_model_is_required_where_there_is_no_default(cmd: str) -> None:
    res = run_cli(cmd)
    assert res.returncode == 2 and "Missing option '-m' / '--model'" in res.stderr, res.stderr


@pytest.mark.parametrize("threads", ["-1", "0", "100000"])
def test_threads_out_of_range_is_refused(threads: str, tiny_model) -> None:
    model = str(tiny_model("q8_0"))
    for cmd in (["generate", "-p", "x", "-n", "1", "--policy", "lru", "--cache-fraction", "0.5"],
                ["batch", "--input", "in", "--output", "out"], ["chat"], ["serve"]):
        res = run_cli(cmd[0], "-m", model, "--threads", threads, *cmd[1:])
        assert res.returncode == 2 and "Invalid value for '--threads'" in res.stderr, res.stderr
    from forecache.llama import Llama

    with pytest.raises(ValueError, match="n_threads=.*use 1 to 512"):
        Llama(model, n_threads=int(threads), policy="lru", cache_fraction=0.5, verbose=False)


def test_ubatch_sets_the_prompt_pass(tiny_model) -> None:
    """--ubatch N prefills in passes of N tokens: every pass routes the MoE layers (the last
    layer only the rows whose logits are wanted); out of range is refused before loading."""
    from forecache.gguf.header import read_model_file

    model = tiny_model("q8_0")
    n_moe = len(read_model_file(model).moe_layers())
    args = ["generate", "-m", str(model), "-p", "one two three four five six seven eight nine",
            "-n", "4", "--greedy", "--json", "--policy", "promoe", "--cache-fraction", "0.5"]
    one = json.loads(run_cli(*args, check=True).stdout)["stats"]
    four = json.loads(run_cli(*args, "--ubatch", "4", check=True).stdout)["stats"]
    assert one["prompt_tokens"] == four["prompt_tokens"] > 8
    n = four["prompt_tokens"]
    passes = -(-n // 4)
    multi = passes - (n % 4 == 1)  # a last pass of one token is all one-token gates
    # the hook sees every layer but the last of each pass of several tokens; one-token gates go
    # to the decode gate
    assert one["hook_calls"] == n_moe - 1
    assert four["hook_calls"] == multi * (n_moe - 1)
    for cmd in ("generate", "chat", "serve"):
        res = run_cli(cmd, "-m", str(model), "--ubatch", "0", *(["-p", "x"] if cmd ==
                                                                 "generate" else []))
        assert res.returncode == 2 and "Invalid value for '--ubatch'" in res.stderr, res.stderr


def test_learned_predictor_without_training_says_how_to_make_one(tiny_model) -> None:
    res = run_cli("generate", "-m", str(tiny_model("q8_0")), "-p", "hi", "-n", "2", "--policy",
                  "promoe", "--cache-fraction", "0.5", "--predictor", "learned")
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 1 and len(lines) == 1, res.stderr
    assert "no learned predictors for tiny-q8_0.gguf" in lines[0] and "forecache train" in lines[0]


def test_cli_starts_without_loading_llama_cpp() -> None:
    """`forecache --help` and the command table load no llama.cpp: a build made for another CPU
    must still be refused in one line, and `forecache build` must still run to replace it."""
    import subprocess
    import sys

    code = ("import sys; from forecache.cli import cli; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'llama_cpp'))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert res.stdout.strip() == "[]", res.stdout


def _error_line(res: subprocess.CompletedProcess) -> str:
    """The one error line of a command that failed (``run`` says what it loaded first)."""
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("forecache: error:")]
    assert res.returncode == 1 and len(errors) == 1, res.stderr
    return errors[0]


def test_past_the_models_context_the_hint_is_its_limit_not_ctx(tiny_model) -> None:
    """The context is capped at the length the model was trained for, so a larger --ctx cannot
    help there: the hint says how many new tokens fit, and names no --ctx."""
    from forecache.gguf.header import read_model_file

    model = tiny_model("q8_0")
    trained = int(read_model_file(model).arch_kv("context_length"))
    for cmd in (["generate", "-p", "hi"], ["run"]):
        line = _error_line(run_cli(cmd[0], "-m", str(model), *cmd[1:], "-n", str(trained + 100),
                                   "--ctx", str(2 * trained)))
        m = re.search(r"prompt \((\d+) tokens\) .* that is the model's own context \(the length "
                      r"it was trained for\): at most (\d+) new tokens after this prompt; "
                      r"lower -n or shorten the prompt$", line)
        assert m and int(m[1]) + int(m[2]) == trained, line
        assert "--ctx" not in line


def test_where_a_larger_ctx_helps_the_hint_says_how_large(tiny_model) -> None:
    """Below the model's own context, the hint gives the --ctx that fits (which `run` takes as
    `generate` does), and that context runs."""
    from forecache.gguf.header import read_model_file

    model = str(tiny_model("q8_0"))
    trained = int(read_model_file(model).arch_kv("context_length"))
    need = {}
    for cmd in (["generate", "-p", "hi"], ["run"]):
        line = _error_line(run_cli(cmd[0], "-m", model, *cmd[1:], "-n", "300", "--ctx", "256"))
        m = re.search(rf"prompt \((\d+) tokens\) \+ 300 generated tokens exceed the context of "
                      rf"256; raise --ctx to (\d+) or more \(the model takes up to {trained}\), "
                      r"or lower -n to (\d+)$", line)
        assert m and int(m[2]) == int(m[1]) + 300 and int(m[3]) == 256 - int(m[1]), line
        need[cmd[0]] = m[2]
    for cmd in (["generate", "-p", "hi", "--greedy"], ["run"]):
        run_cli(cmd[0], "-m", model, *cmd[1:], "-n", "300", "--ctx", need[cmd[0]], check=True)

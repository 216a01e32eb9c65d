"""A split model (llama.cpp's NAME-00001-of-0000N.gguf) is the same model as the one file it was
cut from, for every command and option: its header and tensors, its identity (so traces and
trained predictors carry over), its tokens under llama.cpp's placement and forecache's policies,
its placement and budgets, the disk tier's direct reads from each shard, the disk probe, traces
and routing statistics; a missing shard, or one from another model, is one line naming it."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest
from cli_helpers import run_cli, run_cli_json
from conftest import assert_same_greedy
from disk_helpers import cached_pages, direct_io, drop_cached, quarter_budget
from stock_runner import greedy

from forecache.cache.disk import probe_expert_reads, probe_ranges, size_disk_tier
from forecache.gguf.base import GGUFError
from forecache.gguf.header import read_model_file, require_moe
from forecache.gguf.identity import fingerprint, identity
from forecache.gguf.maker import make_model
from forecache.gguf.tensors import tensor_array
from forecache.llama import Llama
from forecache.placement.options import CacheConfig

if TYPE_CHECKING:
    from conftest import StockReference

# tiny's q4_k experts are 576 KiB a tensor: shards of 3 MiB put the experts of layers 1 and 2
# across two shards each, and the model in four files
SPLIT_BYTES = 3 << 20
PARAMS = {"n_ctx": 2048, "n_batch": 1024, "n_ubatch": 256, "n_threads": 2}
TEXT = "The quick brown fox jumps over the lazy dog, again and again. "
N_GEN = 8
SPLIT_KEYS = ("split.no", "split.count", "split.tensors.count")


@pytest.fixture(scope="module")
def pair(tiny_model: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
         ) -> tuple[Path, Path]:
    """(tiny q4_k in one file, the same model written in four split files: its first)."""
    one = tiny_model("q4_k")
    out = tmp_path_factory.mktemp("split") / "tiny-q4_k.gguf"
    info = make_model(out, "tiny", "q4_k", seed=0, workers=1, split_max_size=SPLIT_BYTES)
    assert len(info.shards) == 4 and info.path == info.shards[0]
    return one, info.path


def _copy_split(first: Path, dest: Path) -> Path:
    """A copy of the split model whose first file is ``first`` in ``dest``: its first file."""
    dest.mkdir(parents=True, exist_ok=True)
    for f in read_model_file(first).files:
        shutil.copyfile(f, dest / f.name)
    return dest / first.name


def _prompts(llm: Llama) -> list[list[int]]:
    text = llm.tokenize((TEXT * 80).encode())
    return [text[:1], text[:300]]


def _assert_stock(llm: Llama, one: Path, stock: StockReference, where: str) -> None:
    """``llm``'s greedy tokens and logits are the unpatched build's for ``one``."""
    prompts = _prompts(llm)
    ref = stock.run(one, prompts, N_GEN, **PARAMS)
    for p, (ref_tokens, ref_logits) in zip(prompts, ref, strict=True):
        tokens, logits = greedy(llm, p, N_GEN)
        assert_same_greedy(tokens, logits, ref_tokens, ref_logits, f"{where} prompt={len(p)}",
                           stock.backend == "cpu")


def test_a_split_model_reads_as_the_model_in_one_file(pair: tuple[Path, Path]) -> None:
    one, split = pair
    a, b = require_moe(one), require_moe(split)
    assert not a.is_split and b.is_split and len(b.files) == 4
    assert b.name == one.name and b.path == split
    # the experts of one layer lie in two shards
    shards_of = {il: {t.shard for t in b.expert_tensors(il)} for il in b.moe_layers()}
    assert any(len(s) == 2 for s in shards_of.values()), shards_of
    assert [(t.name, t.shape, t.type) for t in a.tensors] == \
        [(t.name, t.shape, t.type) for t in b.tensors]
    assert {k: v for k, v in b.kv.items() if k not in SPLIT_KEYS} == a.kv
    assert b.kv["split.count"] == 4 and b.kv["split.tensors.count"] == len(a.tensors)
    for f in ("moe_layers", "layer_expert_bytes", "expert_proj_bytes", "total_expert_bytes",
              "non_expert_bytes", "expert_ff"):
        assert getattr(a, f)() == getattr(b, f)(), f
    for t in a.tensors:
        assert np.array_equal(tensor_array(a, t.name), tensor_array(b, t.name)), t.name
    # one identity whatever the layout: traces and predictors of either serve the other
    assert fingerprint(a) == fingerprint(b)
    ia, ib = identity(a), identity(b)
    assert ib["files"] == 4 and ia["files"] == 1
    assert {k: v for k, v in ia.items() if k not in ("file_size", "files")} == \
        {k: v for k, v in ib.items() if k not in ("file_size", "files")}
    # the disk probe reads experts from several shards
    ranges = probe_ranges(b)
    assert len({path for path, _, _ in ranges}) > 1
    for path, off, n in ranges:
        assert off + n <= path.stat().st_size
    assert probe_expert_reads(b, 4).gbps > 0


def test_make_model_writes_split_files_from_the_cli(tmp_path: Path,
                                                    pair: tuple[Path, Path]) -> None:
    out = tmp_path / "m.gguf"
    res = run_cli("make-model", str(out), "--preset", "tiny", "--type", "q4_k",
                  "--split-max-size", "3MiB", check=True)
    files = sorted(tmp_path.glob("m-*-of-00004.gguf"))
    assert len(files) == 4 and not out.exists() and "4 split files" in res.stdout
    assert fingerprint(read_model_file(files[0])) == fingerprint(read_model_file(pair[0]))
    again = run_cli("make-model", str(out), "--preset", "tiny", "--split-max-size", "3MiB")
    lines = [ln for ln in again.stderr.splitlines() if ln.strip()]
    assert again.returncode != 0 and len(lines) == 1 and "--force" in lines[0], again.stderr
    res = run_cli("make-model", str(tmp_path / "t.gguf"), "--preset", "tiny",
                  "--split-max-tensors", "20", check=True)
    mf = read_model_file(next(tmp_path.glob("t-00001-of-*.gguf")))
    assert len(mf.files) == len(list(tmp_path.glob("t-*-of-*.gguf"))) > 1
    assert {len([t for t in mf.tensors if t.shard == i]) for i in range(len(mf.files) - 1)} == {20}
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


@pytest.mark.parametrize("policy", ["offload", "ncmoe", "lru", "promoe", "lru+bank"])
def test_split_model_gives_the_unpatched_tokens(policy: str, pair: tuple[Path, Path],
                                                stock: StockReference) -> None:
    """Each policy on the split model: the unpatched build's tokens and logits for the model in
    one file, and the placement forecache chooses for that file."""
    one, split = pair
    if policy == "ncmoe":
        from forecache.cache.budget import split_budget

        plan = split_budget(read_model_file(one), 1 << 40, n_ctx=PARAMS["n_ctx"],
                           n_ubatch=PARAMS["n_ubatch"], device_name="x", device_total=1 << 50)
        cfg = CacheConfig("ncmoe", gpu_budget=plan.ncmoe_budget(2))
    elif policy == "offload":
        cfg = CacheConfig("offload")
    elif policy == "lru+bank":  # prompt banks, filled from each shard's experts
        cfg = CacheConfig("lru", cache_fraction=0.5, prompt_bank=True)
    else:
        cfg = CacheConfig(policy, cache_fraction=0.5)
    with Llama(str(one), cache=cfg, verbose=False, **PARAMS) as llm:
        placed = llm.placement
    with Llama(str(split), cache=cfg, verbose=False, **PARAMS) as llm:
        assert llm.placement == placed
        _assert_stock(llm, one, stock, f"split {policy}")
        if cfg.prompt_bank:
            assert llm.expert_stats()["banked"] > 0


def test_split_model_under_llama_cpps_placement(pair: tuple[Path, Path]) -> None:
    """No policy (llama.cpp's own placement, weights repacked): the same tokens and logits as
    the model in one file."""
    out = []
    for model in pair:
        with Llama(str(model), cache=None, verbose=False, **PARAMS) as llm:
            out.append([greedy(llm, p, N_GEN) for p in _prompts(llm)])
    for (ta, la), (tb, lb) in zip(*out, strict=True):
        assert ta == tb and np.array_equal(la, lb)


def test_the_disk_tier_reads_each_shard(pair: tuple[Path, Path], stock: StockReference,
                                        tmp_path: Path) -> None:
    """A host budget below the experts on a split model: the same host slots as the model in one
    file, experts read from every shard with direct I/O (none left in the page cache), and the
    unpatched build's tokens."""
    one, first = pair
    split = _copy_split(first, tmp_path)
    a, mf = read_model_file(one), read_model_file(split)
    budget = quarter_budget(a, 0.25)
    assert size_disk_tier(mf, budget, on_gpu=False) == size_disk_tier(a, budget, on_gpu=False)
    cfg = CacheConfig("lru", cache_fraction=0.25, host_budget=budget)
    with Llama(str(split), cache=cfg, verbose=False, **PARAMS) as llm:
        assert llm.placement is not None and llm.placement.disk is not None
        for f in mf.files:
            drop_cached(f)
        _assert_stock(llm, one, stock, "split disk tier")
        stats = llm.expert_cache.stats()
    assert stats["disk_reads"] > len(mf.moe_layers()) * mf.n_expert // 4, stats
    assert stats["disk_bytes"] == stats["disk_reads"] * max(mf.layer_expert_bytes())
    if direct_io(split):
        assert stats["disk_direct_bytes"] == stats["disk_bytes"]
    for i, path in enumerate(mf.files):
        ranges = [(mf.shards[i].data_offset + t.offset,
                   mf.shards[i].data_offset + t.offset + t.nbytes)
                  for il in mf.moe_layers() for t in mf.expert_tensors(il) if t.shard == i]
        assert cached_pages(path, ranges) == 0, path


def _one_line_error(*args: str) -> str:
    res = run_cli(*args)
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode != 0 and len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    return lines[0]


def test_budget_errors_are_the_same_as_for_one_file(pair: tuple[Path, Path]) -> None:
    one, split = pair
    for opts in (["--host-budget", "1MiB"], ["--gpu-budget", "1MiB"]):
        a = _one_line_error("run", "-m", str(one), "-n", "2", "--policy", "lru", *opts)
        b = _one_line_error("run", "-m", str(split), "-n", "2", "--policy", "lru", *opts)
        assert b.replace(str(split), "MODEL").replace(split.name, "MODEL") == \
            a.replace(str(one), "MODEL").replace(one.name, "MODEL"), (a, b)
    # and a budget that holds every expert needs no disk, as for one file
    res = run_cli("run", "-m", str(split), "-n", "2", "--policy", "lru", "--cache-fraction",
                  "0.25", "--host-budget", "64GiB", check=True)
    assert "disk tier: off" in res.stderr


def test_trace_routing_stats_and_predictors_carry_over(pair: tuple[Path, Path],
                                                       tmp_path: Path) -> None:
    """A trace of the split model is a trace of the model in one file; predictors trained from it
    for one are found for the other; routing-stats reads it."""
    one, split = pair
    trace = tmp_path / "t.npz"
    run_cli("trace", "-m", str(split), "--builtin", "default", "--limit", "2", "-n", "4",
            "--gate-input", "--out", str(trace), check=True)
    stats = run_cli_json("routing-stats", str(trace))
    assert stats["n_tokens"] > 0 and stats["model"] == one.name
    env = {**os.environ, "FORECACHE_CACHE_DIR": str(tmp_path / "cache")}

    def cli(*args: str) -> subprocess.CompletedProcess:
        res = subprocess.run([sys.executable, "-m", "forecache", *args], capture_output=True,
                             text=True, env=env, timeout=300)
        assert res.returncode == 0, res.stderr
        return res

    # trained for the model in one file, from the split model's trace (the identities match)
    cli("train", "-m", str(one), "--trace", str(trace), "--window", "1", "--epochs", "2")
    out = json.loads(cli("generate", "-m", str(split), "-p", "hello", "-n", "4", "--greedy",
                         "--policy", "promoe", "--cache-fraction", "0.5", "--predictor",
                         "learned", "--json").stdout)
    assert out["stats"]["hits"] + out["stats"]["misses"] > 0


def test_a_bad_shard_is_one_line(pair: tuple[Path, Path], tmp_path: Path,
                                 tiny_model: Callable[..., Path]) -> None:
    _, first = pair
    cases: dict[str, tuple[Path, str]] = {}
    # a shard missing
    d = tmp_path / "missing"
    f = _copy_split(first, d)
    (d / first.name.replace("00001-of", "00003-of")).unlink()
    cases["missing"] = (f, r"shard 3 of 4 of .* is missing: .*00003-of-00004\.gguf not found")
    # a shard of another model (tiny-olmoe, cut into four as well)
    other = make_model(tmp_path / "o" / "tiny-olmoe.gguf", "tiny-olmoe", "q4_k", workers=1,
                       split_max_tensors=24)
    d = tmp_path / "mixed"
    f = _copy_split(first, d)
    shutil.copyfile(other.shards[1], d / first.name.replace("00001-of", "00002-of"))
    cases["mixed"] = (f, r"00002-of-00004\.gguf does not belong with .*different models")
    # the second shard given
    cases["second"] = (first.with_name(first.name.replace("00001-of", "00002-of")),
                       r"is shard 2 of 4 of a split model; pass its first shard: "
                       + re.escape(first.name))
    # a shard cut short
    d = tmp_path / "short"
    f = _copy_split(first, d)
    last = d / first.name.replace("00001-of", "00004-of")
    os.truncate(last, last.stat().st_size // 2)
    cases["short"] = (f, r"00004-of-00004\.gguf is truncated")
    # the first shard renamed: its others cannot be found
    d = tmp_path / "renamed"
    _copy_split(first, d)
    f = d / "model.gguf"
    os.replace(d / first.name, f)
    cases["renamed"] = (f, r"its name does not end in -00001-of-00004\.gguf")
    for what, (path, pattern) in cases.items():
        with pytest.raises(GGUFError, match=pattern):
            require_moe(path)
        line = _one_line_error("generate", "-m", str(path), "-p", "hi", "-n", "1")
        assert re.search(pattern, line), (what, line)


def _split_with_gguf_py(src: Path, out: Path, n_files: int) -> Path:
    """``src`` rewritten by gguf-py's own writer as ``n_files`` split files (its split naming,
    keys and data layout): the first file's path."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    r = GGUFReader(src)
    w = GGUFWriter(out, str(r.fields["general.architecture"].contents()),
                   split_max_tensors=-(-len(r.tensors) // n_files))
    for name, field in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        vtype = GGUFValueType(field.types[0])
        sub = GGUFValueType(field.types[-1]) if vtype == GGUFValueType.ARRAY else None
        w.add_key_value(name, field.contents(), vtype, sub)
    for t in r.tensors:
        w.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out.with_name(f"{out.stem}-00001-of-{n_files:05d}.gguf")


def test_the_default_model_split_by_gguf_py(tmp_path: Path) -> None:
    """The shipped default model cut into four files by gguf-py's writer: the same identity (its
    predictors and traces are found), and the same tokens and logits under llama.cpp's placement
    and under promoe."""
    from forecache.models.default import REFERENCE_MODEL

    split = _split_with_gguf_py(REFERENCE_MODEL, tmp_path / "ref.gguf", 4)
    a, b = read_model_file(REFERENCE_MODEL), read_model_file(split)
    assert len(b.files) == 4 and fingerprint(a) == fingerprint(b)
    prompts = [list(range(10, 60)), [1, 2, 3]]
    for cfg in (None, CacheConfig("promoe", cache_fraction=0.5, predictor="history")):
        out = []
        for model in (REFERENCE_MODEL, split):
            with Llama(str(model), cache=cfg, verbose=False, **PARAMS) as llm:
                out.append([greedy(llm, p, N_GEN) for p in prompts])
        for (ta, la), (tb, lb) in zip(*out, strict=True):
            assert ta == tb and np.array_equal(la, lb), cfg

"""Two RPC devices on this machine (`forecache rpc-server`, the CPU backend behind each, on the
loopback address): llama.cpp splits a model's layers over them, and forecache runs there as the
unpatched build does with the same servers.

RPC servers stay registered in the process that registered them, so every run that uses them is a
child process of its own (the CLI, or tests/stock_runner.py)."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from cli_helpers import lowest_priority, run_cli
from conftest import ChildRunError, StockReference, greedy_job, run_greedy_child

from forecache.cache.budget import (
    BudgetError,
    device_host_layers,
    device_slots,
    parse_budgets,
)
from forecache.gguf.header import read_model_file
from forecache.native.rpc import parse_endpoints

PROMPTS = [list(range(10, 40)), list(range(200, 212))]
N_GEN = 6


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(endpoint: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "forecache", "rpc-server", endpoint,
                             "--threads", "1"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    host, port = endpoint.rsplit(":", 1)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"rpc-server {endpoint} exited: {proc.stdout.read().decode()}")
        try:
            with socket.create_connection((host, int(port)), timeout=0.2):
                return proc
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"rpc-server {endpoint} did not listen within 30 s")


@pytest.fixture(scope="module")
def servers() -> Iterator[list[str]]:
    """Two RPC servers on the loopback address, stopped after the module's tests."""
    endpoints = [f"127.0.0.1:{_free_port()}" for _ in range(2)]
    procs = []
    try:
        for ep in endpoints:
            procs.append(_start(ep))
        yield endpoints
    finally:
        for p in procs:
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


def _forecache(model: Path, servers: list[str], info: dict | None = None, **params: object
               ) -> list[tuple[list[int], np.ndarray]]:
    return run_greedy_child(greedy_job(model, PROMPTS, N_GEN, loader="forecache",
                                       rpc=servers, n_ctx=256, **params),
                            Path(str(model)).parent, info=info)


def _equal_to_unpatched(model: Path, servers: list[str], stock: StockReference,
                        **params: object) -> dict:
    """forecache's greedy tokens and logits with ``params`` over the servers equal the unpatched
    build's with the same servers; the run's cache info."""
    ref = stock.run(model, PROMPTS, N_GEN, rpc=servers, n_ctx=256)
    info: dict = {}
    ours = _forecache(model, servers, info, **params)
    for (t, lg), (rt, rl) in zip(ours, ref, strict=True):
        assert t == rt
        np.testing.assert_array_equal(lg, rl)
    return info


@pytest.mark.parametrize("policy", [None, "offload", "lru", "lfu", "static", "promoe",
                                    "infinity"])
def test_layers_split_over_two_rpc_devices_equal_unpatched(
        policy: str | None, tiny_model: Callable[..., Path], stock: StockReference,
        servers: list[str]) -> None:
    """llama.cpp's split of every layer over the two servers' devices (no policy); offload
    (experts in this process's memory, the other weights on the servers); and each cached
    policy, its slots on the server that holds the layer: greedy tokens and logits equal to
    the unpatched build's with the same servers."""
    model = tiny_model("q8_0")
    kw: dict[str, object] = {"cache": None} if policy is None else {"policy": policy}
    cached = policy not in (None, "offload")
    if cached:
        kw.update(cache_fraction=0.5)
    info = _equal_to_unpatched(model, servers, stock, **kw)
    if cached:  # the slots are on both servers, and served hits
        assert sorted(set(info["layer_devices"].values())) == ["RPC0", "RPC1"], info
        assert info["stats"]["hits"] > 0 and info["stats"]["misses"] > 0, info["stats"]
    if policy in ("promoe", "infinity"):
        # the host/device split prices each server's copies at that server's link, not this
        # machine's memcpy
        costs = info["split_costs"]
        assert sorted(costs) == ["RPC0", "RPC1"], info
        assert min(c["copy_gbps"] for c in costs.values()) > 0, info


@pytest.mark.parametrize("preset", ["tiny-qwen3moe", "tiny-mixtral", "tiny-olmoe",
                                    "tiny-granitemoe", "tiny-deepseek2", "tiny-gpt-oss",
                                    "tiny-lfm2moe"])
def test_other_architectures_over_rpc_devices_equal_unpatched(
        preset: str, tiny_model: Callable[..., Path], stock: StockReference,
        servers: list[str]) -> None:
    """promoe with its slots on the servers, over the other architectures' layouts (shared
    experts, dense first layers, biased experts, a recurrent state): equal to unpatched."""
    model = tiny_model("q8_0", preset)
    info = _equal_to_unpatched(model, servers, stock, policy="promoe", cache_fraction=0.5)
    assert info["stats"]["hits"] > 0 and len(set(info["layer_devices"].values())) == 2, info


@pytest.mark.parametrize("stream", [True, False])
def test_copies_on_each_rpc_devices_stream(stream: bool, tiny_model: Callable[..., Path],
                                          stock: StockReference, servers: list[str]) -> None:
    """An RPC device has events (its connection's queue, which orders every command): its worker
    issues every chunk on a backend of their own, two in flight, and a decoded token's product
    whose copies have not landed is ordered after them, the host waiting only until they are
    issued. Without the stream each chunk is copied synchronously. Either way equal to the
    unpatched build."""
    model = tiny_model("q8_0")
    info = _equal_to_unpatched(model, servers, stock, cache={
        "policy": "lru", "cache_fraction": 0.5, "copy_stream": stream})
    st = info["stats"]
    assert info["copy_streams"] == (2 if stream else 0), info
    assert st["misses"] > 0 and st["h2d_bytes"] > 0 and st["n_chunks"] > 0, st
    if not stream:  # (with it, whether a product finds its copies landed is a matter of timing)
        assert st["event_waits"] == 0, st


def test_stage_slots_on_each_rpc_device(tiny_model: Callable[..., Path], stock: StockReference,
                                        servers: list[str]) -> None:
    """promoe with stage slots on each server's device: a prompt that streams more experts
    than a layer's slots copies the next layer's into its own device's stage slots; equal to
    unpatched."""
    model = tiny_model("q8_0")
    prompts = [list(range(10, 74)), list(range(300, 400))]
    ref = stock.run(model, prompts, N_GEN, rpc=servers, n_ctx=256)
    info: dict = {}
    ours = run_greedy_child(greedy_job(model, prompts, N_GEN, loader="forecache", rpc=servers,
                                       n_ctx=256, cache={
                                           "policy": "promoe", "cache_fraction": 0.25,
                                           "stage_slots": 2, "predictor": "history",
                                           "features": {"split": False}}),
                            Path(str(model)).parent, info=info)
    for (t, lg), (rt, rl) in zip(ours, ref, strict=True):
        assert t == rt
        np.testing.assert_array_equal(lg, rl)
    st = info["stats"]
    assert st["staged"] > 0 and st["stage_used"] > 0, st
    assert sorted(info["devices"]) == ["RPC0", "RPC1"], info
    assert all(d["staged"] > 0 for d in info["devices"].values()), info["devices"]


def test_promoe_splitting_layers_over_rpc_devices_equals_unpatched(
        tiny_model: Callable[..., Path], stock: StockReference, servers: list[str],
        tmp_path: Path) -> None:
    """promoe against a slow bus: layers split between slots (one product a projection on the
    server that holds the layer) and host experts (computed whole here, their rows written into
    the server's result), equal to the unpatched build with the same servers."""
    slow = json.loads((Path(__file__).parents[1] / "forecache" / "data" / "profiles" /
                       "rtx4090.json").read_text())
    machine = tmp_path / "slow-bus.json"
    machine.write_text(json.dumps(dict(slow, name="slow-bus", h2d_gbps=0.01, cpu_mem_gbps=0.1)))
    model = tiny_model("q8_0")
    info = _equal_to_unpatched(model, servers, stock, policy="promoe", cache_fraction=0.25,
                      predictor="history", machine=str(machine))
    st = info["stats"]
    assert st["host_entries"] > 0 and st["whole"] > 0 and st["hits"] > 0, st
    assert sorted(set(info["layer_devices"].values())) == ["RPC0", "RPC1"], info


def test_each_rpc_device_splits_by_its_own_costs(tiny_model: Callable[..., Path],
                                                stock: StockReference, servers: list[str],
                                                tmp_path: Path) -> None:
    """--machine A,B: a profile per device holding slots, in llama.cpp's order. The first
    server's layers are priced as behind a slow link, so their missing experts are computed on
    this machine's CPU; the second's as behind a fast one with a slow CPU, so theirs are copied
    to it. Greedy output equal to unpatched with the same servers."""
    base = json.loads((Path(__file__).parents[1] / "forecache" / "data" / "profiles" /
                       "rtx4090.json").read_text())
    slow, fast = tmp_path / "slow-bus.json", tmp_path / "fast-bus.json"
    slow.write_text(json.dumps(dict(base, name="slow-bus", h2d_gbps=0.01, cpu_mem_gbps=0.1)))
    fast.write_text(json.dumps(dict(base, name="fast-bus", h2d_gbps=1000.0, cpu_mem_gbps=0.001,
                                    cpu_gflops=0.001)))
    model = tiny_model("q8_0")
    info = _equal_to_unpatched(model, servers, stock, policy="promoe", cache_fraction=0.25,
                      predictor="history", machine=f"{slow},{fast}")
    first = info["layer_devices"][min(info["layer_devices"], key=int)]
    second = ({"RPC0", "RPC1"} - {first}).pop()
    devs = info["devices"]
    assert devs[first]["host_entries"] > 0 and devs[second]["host_entries"] == 0, devs
    assert devs[second]["misses"] > 0, devs  # it missed, and copied every miss
    assert info["stats"]["decode_gates"] > 0, info["stats"]  # decided in C, by each one's tables
    assert sorted(info["split_costs"]) == ["RPC0", "RPC1"], info
    # a profile for each device, or one for all: three for two devices is one line
    with pytest.raises(ChildRunError, match="3 profiles for 2 devices"):
        _forecache(model, servers, policy="promoe", cache_fraction=0.25, predictor="history",
                   machine=f"{slow},{fast},{slow}")


def _three_slot_budgets(model: Path, servers: list[str]) -> tuple[str, list[int]]:
    """``--gpu-budget A,B`` giving the first server's layers 3 slots each and the second's
    every expert, and each layer's device (0: the first server, 1: the second)."""
    mf = read_model_file(model)
    info: dict = {}
    _forecache(model, servers, info, policy="lru", gpu_budget="1GiB")  # where llama.cpp splits
    devs = {int(il): name for il, name in info["layer_devices"].items()}
    names = sorted(set(devs.values()))
    assert names == ["RPC0", "RPC1"] and info["n_slots"] == [mf.n_expert] * mf.n_layer, info
    split = [names.index(devs[il]) for il in range(mf.n_layer)]

    def slots(budgets: str) -> list[int]:
        return device_slots(mf, parse_budgets(budgets), split, dict(enumerate(names)),
                            n_ctx=256, n_ubatch=512)

    def first_slots(b: int) -> int:
        try:
            return slots(f"{b}B,1GiB")[split.index(0)]
        except BudgetError:
            return 0

    lo, hi = 0, 1 << 34  # the least budget for 3 slots a layer on the first device
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if first_slots(mid) >= 3 else (mid, hi)
    return f"{hi}B,1GiB", split


def test_a_budget_per_rpc_device(tiny_model: Callable[..., Path], stock: StockReference,
                                 servers: list[str]) -> None:
    """--gpu-budget A,B: each server's device gets the slots its own budget leaves after its
    layers' weights and buffers (budget.device_slots): 3 a layer on the first, every expert on
    the second; greedy output equal to unpatched."""
    model = tiny_model("q8_0")
    mf = read_model_file(model)
    budgets, split = _three_slot_budgets(model, servers)
    info = _equal_to_unpatched(model, servers, stock, policy="promoe", gpu_budget=budgets)
    assert info["n_slots"] == [3 if s == 0 else mf.n_expert for s in split], info
    # one size is the two devices' total, shared so that every layer gets the same slots
    names = {0: "RPC0", 1: "RPC1"}
    lo, hi = 0, 1 << 34  # the least total for 3 slots a layer

    def total_slots(b: int) -> int:
        try:
            return min(device_slots(mf, (b,), split, names, n_ctx=256, n_ubatch=512))
        except BudgetError:
            return 0

    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if total_slots(mid) >= 3 else (mid, hi)
    info = _equal_to_unpatched(model, servers, stock, policy="lru", gpu_budget=f"{hi}B")
    assert info["n_slots"] == [3 if il in mf.moe_layers() else 0 for il in range(mf.n_layer)]


def test_ncmoe_fits_each_rpc_devices_budget(tiny_model: Callable[..., Path],
                                            stock: StockReference,
                                            servers: list[str]) -> None:
    """--policy ncmoe --gpu-budget A,B over two servers (stock's --n-cpu-moe with llama.cpp's
    split): the fewest layers' experts stay in host memory for each device's budget
    (budget.device_host_layers over the split predicted before the load, and checked after it),
    the first server's first layer here; greedy output equal to unpatched."""
    model = tiny_model("q8_0")
    mf = read_model_file(model)
    _, split = _three_slot_budgets(model, servers)
    names = {0: "RPC0", 1: "RPC1"}

    def host(b: int) -> list[int]:
        try:
            return device_host_layers(mf, parse_budgets(f"{b}B,1GiB"), split, names,
                                      n_ctx=256, n_ubatch=512)
        except BudgetError:
            return list(range(mf.n_layer))

    lo, hi = 0, 1 << 34  # the least budget for which one layer's experts on the host do
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if len(host(mid)) <= 1 else (mid, hi)
    first = [il for il in mf.moe_layers() if split[il] == 0]
    assert host(hi) == first[:1] and host(1 << 34) == [], (host(hi), first)
    info = _equal_to_unpatched(model, servers, stock, policy="ncmoe", gpu_budget=f"{hi}B,1GiB")
    assert info["host_layers"] == first[:1], info
    # a device that cannot hold its layers even with every expert on the host: one line
    with pytest.raises(ChildRunError, match="is too small"):
        _forecache(model, servers, policy="ncmoe", gpu_budget="1KiB,1GiB")


def test_infinity_moves_slots_within_each_device(tiny_model: Callable[..., Path],
                                                 stock: StockReference, servers: list[str],
                                                 tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """infinity under a budget per device: slots move between layers by the stored EAM
    collection's reuse (cache.allocation), but only between the layers of one device, each
    device keeping the slots its budget gives; greedy output equal to unpatched."""
    from forecache.predictor.store import EAMCollection, save_eam

    monkeypatch.setenv("FORECACHE_CACHE_DIR", str(tmp_path / "cache"))
    model = tiny_model("q8_0")
    mf = read_model_file(model)
    budgets, split = _three_slot_budgets(model, servers)
    moe = mf.moe_layers()
    # every other layer's hits grow with each slot, the rest gain nothing from more than one
    curves = np.array([np.arange(mf.n_expert + 1) * (100 if i % 2 == 0 else 0)
                       for i in range(len(moe))], dtype=np.int64)
    save_eam(mf, EAMCollection(np.ones((1, mf.n_layer, mf.n_expert)),
                               np.full((mf.n_layer, mf.n_expert), 1 / mf.n_expert), curves),
             "hand-made")
    info = _equal_to_unpatched(model, servers, stock, policy="infinity", gpu_budget=budgets)
    got = info["n_slots"]
    first = [il for il in moe if split[il] == 0]
    assert sum(got[il] for il in first) == 3 * len(first), got  # the first device's total
    assert len({got[il] for il in first}) > 1, got  # moved between its layers
    assert all(got[il] == mf.n_expert for il in moe if split[il] == 1), got


def test_the_split_is_over_the_servers(tiny_model: Callable[..., Path],
                                       servers: list[str]) -> None:
    """The servers' devices appear as RPC devices and take the layers; the expert cache's device
    stays this machine's."""
    code = (
        "import sys\n"
        "from forecache.native.rpc import add_servers\n"
        "from forecache.native.ggml_devices import cache_device, rpc_devices\n"
        "add_servers(sys.argv[1].split(','))\n"
        "devs = rpc_devices()\n"
        "print(len(devs), sorted(d.description for d in devs), cache_device().name)\n")
    res = subprocess.run([sys.executable, "-c", code, ",".join(servers)], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    n, descs, dev = res.stdout.split(" ", 1)[0], servers, res.stdout.split()[-1]
    assert n == "2" and all(ep in res.stdout for ep in descs) and not dev.startswith("RPC")
    out = run_cli("generate", "-m", str(tiny_model("q8_0")), "-p", "hello", "-n", "4",
                  "--greedy", "--rpc", ",".join(servers), "--verbose", "--threads", "1")
    assert out.returncode == 0, out.stderr
    assert "RPC0" in out.stderr and "RPC1" in out.stderr  # llama.cpp's load log names both


def test_rpc_errors_are_one_line(tiny_model: Callable[..., Path], servers: list[str]) -> None:
    model = str(tiny_model("q8_0"))
    # ncmoe over the servers: each device's budget holds its layers, else one line naming it
    res = run_cli("generate", "-m", model, "-p", "hi", "-n", "2", "--policy", "ncmoe",
                  "--gpu-budget", "1GiB", "--rpc", ",".join(servers))
    assert res.returncode == 0, res.stderr
    res = run_cli("generate", "-m", model, "-p", "hi", "-n", "2", "--policy", "ncmoe",
                  "--gpu-budget", "1KiB", "--rpc", ",".join(servers))
    assert res.returncode == 1 and "on RPC0 is too small" in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr
    # budgets: one per device holding layers, each with room for a slot a layer
    for budget, says in (("1GiB,1GiB,1GiB", "--gpu-budget gives 3 sizes"),
                         ("1MiB", "on RPC0 is too small")):
        res = run_cli("generate", "-m", model, "-p", "hi", "-n", "2", "--policy", "lru",
                      "--gpu-budget", budget, "--rpc", ",".join(servers))
        assert res.returncode == 1 and says in res.stderr, res.stderr
        assert len(res.stderr.strip().splitlines()) == 1 and "Traceback" not in res.stderr
    # a server that does not answer
    dead = f"127.0.0.1:{_free_port()}"
    res = run_cli("generate", "-m", model, "-p", "hi", "-n", "2", "--rpc", dead)
    assert res.returncode != 0 and f"RPC server {dead} does not answer" in res.stderr
    assert "Traceback" not in res.stderr
    # endpoints that are not HOST:PORT
    res = run_cli("generate", "-m", model, "-p", "hi", "-n", "2", "--rpc", "localhost")
    assert res.returncode != 0 and "'localhost' is not HOST:PORT" in res.stderr
    assert run_cli("rpc-server", "nowhere").returncode == 2


def test_endpoints_parse_as_llama_cpp_spells_them() -> None:
    assert parse_endpoints("127.0.0.1:50052, host-b:1") == ["127.0.0.1:50052", "host-b:1"]
    assert parse_endpoints("[::1]:50052") == ["[::1]:50052"]
    for bad in ("127.0.0.1", "a:0", "a:70000", "a:1,a:1", ""):
        with pytest.raises(ValueError):
            parse_endpoints(bad)


def test_a_server_that_goes_away_ends_the_job_in_one_line(tiny_model: Callable[..., Path],
                                                          tmp_path: Path) -> None:
    """An RPC server killed while a batch job decodes over it: the job ends with one line and
    status 1, every record written before it stays, and the job resumes from there once the
    server is back."""
    eps = [f"127.0.0.1:{_free_port()}" for _ in range(2)]
    procs = [_start(ep) for ep in eps]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(f'{{"id": "r{i}", "prompt": "count {i}", "max_tokens": 96, '
                           f'"temperature": 0}}\n' for i in range(60)))
    args = ["-m", str(tiny_model("q8_0")), "--input", str(inp), "--output", str(out),
            "--parallel", "1", "--threads", "1", "--rpc", ",".join(eps)]
    job = subprocess.Popen([sys.executable, "-m", "forecache", "batch", *args],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           preexec_fn=lowest_priority)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and job.poll() is None and \
                (not out.exists() or out.read_text().count("\n") < 2):
            time.sleep(0.05)
        assert job.poll() is None, "the job ended before the server could be stopped"
        procs[1].kill()
        _, err = job.communicate(timeout=120)
    finally:
        for p in procs:
            p.kill()
    assert job.returncode == 1, err[-2000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("forecache: llama.cpp stopped:") and "RPC" in last, err[-2000:]
    assert "Traceback" not in err and "gdb" not in err
    done = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(done) >= 2 and len({r["id"] for r in done}) == len(done)
    # the servers back: the job resumes and finishes every request
    procs = [_start(ep) for ep in eps]
    try:
        res = run_cli("batch", *args, timeout=600)
    finally:
        for p in procs:
            p.kill()
    assert res.returncode == 0, res.stderr[-2000:]
    assert sorted(json.loads(line)["id"] for line in out.read_text().splitlines()) == \
        sorted(f"r{i}" for i in range(60))


def test_doctor_measures_each_rpc_device(servers: list[str]) -> None:
    """`doctor --rpc` lists the servers' devices with the copy rate to each through the network;
    a server that does not answer is one line."""
    res = run_cli("doctor", "--json", "--probe-mib", "4", "--rpc", ",".join(servers))
    assert res.returncode == 0, res.stderr
    rpc = [d for d in json.loads(res.stdout)["devices"] if d["backend"] == "RPC"]
    assert sorted(d["description"] for d in rpc) == sorted(servers)
    assert all(d["h2d_gbps_pageable"] > 0 and d["d2h_gbps_pageable"] > 0 for d in rpc), rpc
    dead = f"127.0.0.1:{_free_port()}"
    res = run_cli("doctor", "--no-measure", "--rpc", dead)
    assert res.returncode == 1 and f"RPC server {dead} does not answer" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr


def test_chat_reports_each_devices_slots(tmp_path: Path, servers: list[str]) -> None:
    """`forecache chat --rpc` with a cached policy: the line after each answer and /stats give
    each server's device its slots and hit rate."""
    from test_chat import STATUS, _finish, _spawn

    from forecache.models.default import REFERENCE_MODEL

    if not REFERENCE_MODEL.is_file():
        pytest.skip("reference model not in this checkout")
    child = _spawn(tmp_path, "--temp", "0", "--max-tokens", "8", "--policy", "lru",
                   "--cache-fraction", "0.5", "--rpc", ",".join(servers))
    child.sendline("And it came to pass")
    child.expect(STATUS)
    experts = child.match.group(5)
    assert re.search(r"RPC0 \d+ slots, hit \d+%, RPC1 \d+ slots, hit \d+%", experts), experts
    child.expect("> ")
    child.sendline("/stats")
    child.expect(r"  RPC1: \d+ slots, hit \d+%, copied [\d.]+ [MG]iB")
    child.expect("> ")
    child.sendeof()
    assert _finish(child) == 0


def test_prompt_banks_on_rpc_devices_equal_unpatched(tiny_model: Callable[..., Path],
                                                     stock: StockReference,
                                                     servers: list[str]) -> None:
    """Prompt banks on the servers' devices (no events there: a thread fills each device's
    regions over the network): a 64-token prompt's layers come from their banks, and greedy
    tokens and logits equal the unpatched build's with the same servers."""
    model = tiny_model("q8_0")
    prompts = [list(range(10, 74))]
    ref = stock.run(model, prompts, N_GEN, rpc=servers, n_ctx=256)
    info: dict = {}
    ours = run_greedy_child(greedy_job(model, prompts, N_GEN, loader="forecache", rpc=servers,
                                       n_ctx=256, cache={"policy": "lru", "cache_fraction": 0.5,
                                                         "prompt_bank": True}),
                            Path(str(model)).parent, info=info)
    for (t, lg), (rt, rl) in zip(ours, ref, strict=True):
        assert t == rt
        np.testing.assert_array_equal(lg, rl)
    assert sorted(set(info["layer_devices"].values())) == ["RPC0", "RPC1"], info
    assert info["stats"]["banked"] > 0 and info["stats"]["readbacks"] > 0, info["stats"]

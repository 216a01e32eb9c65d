"""The fewest disk reads, and so the most decode tokens/s, any lossless expert placement could get
on ``benchmarks/disk_sim.py``'s setup: Qwen3.5-397B-A17B (q4_k) on a 24 GiB card, 64 GiB of host
memory and a 7 GB/s NVMe, over the same fitted routing disk_sim.py times.

    python benchmarks/disk_bound.py [--traces ../shared/traces] [--like T.npz ...]
        [--host 64GiB] [--host-reserve 4GiB] [--budget 24GiB] [--profile rtx4090]
        [--disk-gbps 7] [--requests 4] [--prefill 128] [--decode 128] [--seed 0]
        [--capacities 150,190] [--json OUT]

Each layer's expert uses go through Belady's optimal offline replacement (``sim.belady``: evict
the expert used again furthest ahead, or do not keep the one read) with ``capacity`` experts of
a layer in memory. Two memories: the host slots alone (a device-resident expert also holds a
host slot, as the C tier's copies read from one; the device adds nothing), and the device and
host slots pooled (an expert on the device needs no host slot). ``--capacities`` adds others.

Two counts of the decode reads of the measured requests:

* ``bound``: each measured request's decode alone, starting from the best memory content (its
  prompt could leave any experts): no placement, prediction or read-ahead reads fewer.
* ``cont.``: Belady over the whole replay as disk_sim.py runs it (the warm-up requests, then
  each request's prompt and decode), the decode's reads counted: the optimum for all reads.

Tokens/s follow from the reads alone: a token takes ``reads x`` one read's share of the disk
(its bytes at the disk's rate, or its per-projection latencies plus bytes over the reads in
flight, whichever is more), compute and copies fully overlapped, DRAM uncontended: an upper
bound. ``lru`` is the same memory under online LRU, for scale; ``req.`` knows each request's
total uses of every expert before it starts (an oracle: no online policy has it) and keeps the
experts the request uses most, reading into memory only an expert used more than the one it
would evict; ``req. online`` does the same with the request's uses so far (MoE-Infinity's
request-level counts, admission included). Same arguments, same table.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np

from forecache.cache.cost import DiskProfile
from forecache.sim.belady import belady_misses, min_reads
from forecache.sim.shapes import ModelShape
from forecache.trace.format import Request

sys.path.insert(0, str(Path(__file__).resolve().parent))
from disk_sim import (  # noqa: E402
    FLASH_MOE_TOKS,
    decode_traces,
    machine,
    replay_like,
    setup_args,
)


def layer_steps(requests: list[Request], il: int) -> tuple[list[list[int]], list[bool]]:
    """Layer ``il``'s uses, token by token, over ``requests`` in order; whether each token is
    a decode token."""
    steps, decode = [], []
    for r in requests:
        ex = r.experts[:, il]
        ph = r.phase if r.phase is not None else np.ones(len(ex), dtype=np.int8)
        for t in range(len(ex)):
            steps.append([int(e) for e in ex[t] if e >= 0])
            decode.append(bool(ph[t] == 1))
    return steps, decode


def decode_steps(r: Request, il: int) -> list[list[int]]:
    """Layer ``il``'s uses by ``r``'s decode tokens."""
    ph = r.phase if r.phase is not None else np.ones(r.n_tokens, dtype=np.int8)
    return [[int(e) for e in r.experts[t, il] if e >= 0] for t in np.flatnonzero(ph == 1)]


def read_s(shape: ModelShape, disk: DiskProfile) -> float:
    """Disk time one whole-expert read takes with ``queue_depth`` in flight: its bytes at the
    disk's rate, or its latencies (one a projection) and bytes over the reads in flight."""
    xfer = shape.expert_bytes / (disk.gbps * 1e9)
    lat = len(shape.proj_bytes) * disk.latency_s
    return max(xfer, (lat + xfer) / disk.queue_depth)


def bounds(fit: list[Request], replay: list[Request], shape: ModelShape, capacity: int) -> dict:
    """Decode reads of ``replay`` for ``capacity`` experts a layer: the bound, Belady over the
    whole run, and LRU over the whole run."""
    n_decode = sum(int((r.phase == 1).sum()) if r.phase is not None else r.n_tokens
                   for r in replay)
    bound = cont = lru = oracle = online = 0
    run = fit + replay
    first = sum(r.n_tokens for r in fit)  # the measured requests' first token in ``run``
    for il in range(shape.layers):
        for r in replay:
            bound += min_reads(decode_steps(r, il), capacity, free_start=True)
        steps, decode = layer_steps(run, il)
        misses = belady_misses(steps, capacity)
        mask = np.array(decode, dtype=bool)
        mask[:first] = False
        cont += int(misses[mask].sum())
        # LRU: the measured decode tokens' misses, the run before them warming the memory
        lru += lru_decode_misses(steps, mask, capacity)
        oracle += request_count_misses(run, len(fit), il, capacity, oracle=True)
        online += request_count_misses(run, len(fit), il, capacity, oracle=False)
    return {"capacity": capacity, "decode_tokens": n_decode,
            "bound_reads_per_token": bound / n_decode,
            "belady_reads_per_token": cont / n_decode,
            "lru_reads_per_token": lru / n_decode,
            "req_reads_per_token": oracle / n_decode,
            "req_online_reads_per_token": online / n_decode}


def request_count_misses(run: list[Request], first: int, il: int, capacity: int, *,
                         oracle: bool) -> int:
    """Decode misses of layer ``il`` in requests ``run[first:]`` (all of ``run`` replayed in
    order) when memory keeps the experts the current request uses most (then the most recent):
    its total uses, known in advance (``oracle``), or its uses so far. An expert used less than
    the one it would evict is computed from its read and not kept (bypass)."""
    held: dict[int, int] = {}  # expert -> last use
    n = t = 0
    for ri, r in enumerate(run):
        ex = r.experts[:, il]
        ph = r.phase if r.phase is not None else np.ones(len(ex), dtype=np.int8)
        uses: dict[int, int] = {}
        if oracle:
            for e in ex[ex >= 0].tolist():
                uses[e] = uses.get(e, 0) + 1
        for tok in range(len(ex)):
            t += 1
            row = [int(e) for e in ex[tok] if e >= 0]
            if not oracle:
                for e in row:
                    uses[e] = uses.get(e, 0) + 1
            for e in row:
                if e in held:
                    held[e] = t
                    continue
                n += ri >= first and bool(ph[tok] == 1)
                if len(held) < capacity:
                    held[e] = t
                    continue
                victim = min(held, key=lambda k: (uses.get(k, 0), held[k]))
                if uses.get(e, 0) >= uses.get(victim, 0):
                    del held[victim]
                    held[e] = t
    return n


def lru_decode_misses(steps: list[list[int]], mask: np.ndarray, capacity: int) -> int:
    """LRU's misses at the steps ``mask`` marks, over the whole of ``steps``."""
    held: dict[int, None] = {}
    n = 0
    for i, s in enumerate(steps):
        for e in s:
            if e in held:
                del held[e]
            else:
                n += bool(mask[i])
                if len(held) >= capacity:
                    del held[next(iter(held))]
            held[e] = None
    return n


def main() -> None:
    ap = setup_args(__doc__.splitlines()[0])
    ap.add_argument("--capacities", default="",
                    help="experts a layer, besides the host slots and device + host slots")
    args = ap.parse_args()

    profile, shape, n_slots, n_host = machine(args)
    disk = profile.disk
    assert disk is not None
    caps = {"host": n_host, "pooled": n_host + n_slots}
    for c in filter(None, args.capacities.split(",")):
        caps[f"{int(c)}"] = int(c)
    one = read_s(shape, disk)
    traces = args.like or decode_traces(args.traces)
    if not traces:
        raise SystemExit(f"no decode traces in {args.traces}")
    print(f"{args.shape} q4_k ({shape.experts} experts x {shape.layers} layers, top-"
          f"{shape.top_k}, {shape.expert_bytes / 2**20:.2f} MiB each); {n_slots} device + "
          f"{n_host} host slots a layer; disk {disk.gbps:g} GB/s, {disk.latency_us:g} us a read "
          f"x {len(shape.proj_bytes)} projections, {disk.queue_depth} in flight: "
          f"{one * 1e3:.3f} ms a read, {1 / (FLASH_MOE_TOKS * one):.0f} reads a token at most "
          f"for {FLASH_MOE_TOKS} tokens/s", flush=True)

    results: dict[str, dict] = {}
    for like in traces:
        fit, replay, _, _ = replay_like(like, args)
        got = {}
        for name, c in caps.items():
            b = bounds(fit, replay, shape, c)
            for k in ("bound", "belady", "lru", "req", "req_online"):
                b[f"{k}_tokens_s"] = 1.0 / (b[f"{k}_reads_per_token"] * one) \
                    if b[f"{k}_reads_per_token"] > 0 else math.inf
            got[name] = b
        results[like.stem] = got
        print(f"  {like.stem}: " + "; ".join(
            f"{n} ({v['capacity']}): bound {v['bound_reads_per_token']:.1f} reads/tok "
            f"{v['bound_tokens_s']:.2f} tok/s" for n, v in got.items()), flush=True)

    def gmean(name: str, key: str) -> float:
        return math.exp(np.mean([math.log(v[name][key]) for v in results.values()]))

    print("\ndecode reads a token and the tokens/s they allow, "
          f"{args.requests - args.requests // 2} requests of {args.prefill} + {args.decode} "
          "tokens measured per trace after "
          f"{args.requests // 2} warmed up (disk_sim.py's)")
    head = f"{'routing fitted to':<44} {'memory':<12} " + \
        f"{'bound':>7} {'tok/s':>6} {'cont.':>7} {'tok/s':>6} {'lru':>7} {'tok/s':>6} " + \
        f"{'req.':>7} {'tok/s':>6} {'online':>7} {'tok/s':>6}"
    print(head)
    print("-" * len(head))
    for stem, got in results.items():
        for name, v in got.items():
            print(f"{stem:<44} {name + ' ' + str(v['capacity']):<12} "
                  f"{v['bound_reads_per_token']:>7.1f} {v['bound_tokens_s']:>6.2f} "
                  f"{v['belady_reads_per_token']:>7.1f} {v['belady_tokens_s']:>6.2f} "
                  f"{v['lru_reads_per_token']:>7.1f} {v['lru_tokens_s']:>6.2f} "
                  f"{v['req_reads_per_token']:>7.1f} {v['req_tokens_s']:>6.2f} "
                  f"{v['req_online_reads_per_token']:>7.1f} {v['req_online_tokens_s']:>6.2f}")
    means = {n: {k: gmean(n, f"{k}_tokens_s") for k in ("bound", "belady", "lru", "req",
                                                         "req_online")}
             for n in caps}
    for name, m in means.items():
        print(f"{'geometric mean':<44} {name + ' ' + str(caps[name]):<12} "
              f"{'':>7} {m['bound']:>6.2f} {'':>7} {m['belady']:>6.2f} {'':>7} {m['lru']:>6.2f} "
              f"{'':>7} {m['req']:>6.2f} {'':>7} {m['req_online']:>6.2f}")
    print("bound: each measured decode alone from the best start (no placement reads fewer); "
          "cont.: Belady over the whole run, prompts and warm-up included; lru: online LRU of "
          "the same memory; req.: the most-used experts of the request, its total uses known in "
          "advance (an oracle); online: the same by its uses so far; tok/s: reads x one read's "
          "disk time, nothing else counted")
    for name, m in means.items():
        ok = m["bound"] >= FLASH_MOE_TOKS
        print(f"flash-moe's {FLASH_MOE_TOKS} tokens/s losslessly with the {name} memory "
              f"({caps[name]} experts a layer): {'reachable' if ok else 'NOT reachable'} "
              f"(bound {m['bound']:.2f}; per trace "
              f"{min(v[name]['bound_tokens_s'] for v in results.values()):.2f}-"
              f"{max(v[name]['bound_tokens_s'] for v in results.values()):.2f})")
    if args.json:
        args.json.write_text(json.dumps({
            "shape": args.shape, "budget": args.budget, "host": args.host,
            "host_reserve": args.host_reserve, "profile": profile.name,
            "disk": {"gbps": disk.gbps, "latency_us": disk.latency_us,
                     "queue_depth": disk.queue_depth},
            "n_slots": n_slots, "host_slots": n_host, "capacities": caps,
            "read_s": one, "requests": args.requests, "prefill": args.prefill,
            "decode": args.decode, "flash_moe_tokens_s": FLASH_MOE_TOKS,
            "geomean_tokens_s": means, "traces": results}, indent=1))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()

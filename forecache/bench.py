"""Policy benchmark: every policy on the same prompts in one process, with ratios to baselines."""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from forecache.cache.policies import hit_rate
from forecache.cache.prefetcher import Features
from forecache.cache.registry import NCMOE_RUNS, policy_spec
from forecache.cache.runtime import ExpertCache
from forecache.cache.timeline import format_summary, summarize
from forecache.diskprobe import DiskRate
from forecache.errors import setting
from forecache.generate import SamplingParams, generate, text_tokens
from forecache.gguf.header import read_model_file, require_moe
from forecache.llama import CALIBRATION_TEXT, Llama
from forecache.placement.before import default_choice
from forecache.placement.options import DEFAULT_POLICY, CacheConfig
from forecache.speculative.acceptance import AcceptanceReplay
from forecache.trace.replay import Routing, load_routing

# stock llama.cpp's best (--n-cpu-moe, the faster of --no-mmap and mmap'd host weights) first:
# every speedup is stated over it before the others
BASELINES = ("ncmoe", "offload", "lru")
# stock's best with the benchmark's draft model under the same speculative loop: where a run
# drafts, the gain of forecache's cache and prefetch apart from drafting's own
DRAFT_BASELINE = "ncmoe+draft"
# stock placements a benchmark may name besides the policies: every layer on the GPU (no budget,
# no cache: the bound a cache approaches when every expert fits), and --n-cpu-moe with mmap'd
# (pageable) host weights; "ncmoe" itself is --no-mmap's (pinned host weights copy at the bus rate)
STOCK_RUNS = ("all-gpu", "ncmoe-mmap")
# what a user gets without --policy: the placement the default chooses (``cache.choice``) for
# this model, budget and routing; its row is the chosen policy's run in the same call
DEFAULT_RUN = "default"
@dataclass(frozen=True)
class Variant:
    """A run a benchmark may add to a policy's name: extra CacheConfig fields, a draft, whether
    its tokens may differ from the exact runs' (``lossy``), and whether it routes tokens its own
    way (``routes``: skipped when a replayed routing fixes every token's experts)."""

    kw: dict
    draft: str | None = None
    lossy: bool = False
    routes: bool = True
    note: str = ""


# a Variant's draft that stands for the benchmark's draft model
MODEL_DRAFT = "model"
# MoBiLE's little pass on every generated token (gamma 0, never the full model: lossy, the
# mode's speed bound) over the top half of the top-k ("+little") or the experts in slots and the
# top-1 ("+resident"); speculative decoding with the model's little pass as the draft ("+spec",
# exact); promoe's host split for prompt-sized ubatches too ("+prompt-split"), or for none
# ("+no-split"): the ablations of the split on a GPU
_LITTLE = ("+little/+resident: MoBiLE's little pass on every generated token (lossy; the mode's "
           "speed bound)")
# the +gather variant's smallest prompt group (Features.prompt_gather)
GATHER_ENTRIES = 8
RUN_VARIANTS: dict[str, Variant] = {
    "+little": Variant({"little_k": -1, "gamma": 0.0}, lossy=True, note=_LITTLE),
    "+resident": Variant({"little_k": -1, "gamma": 0.0, "little_resident": True}, lossy=True,
                         note=_LITTLE),
    # the draft model the benchmark is given (``run_bench``'s ``draft_model``): in a context of
    # its own, it keeps a replayed routing
    "+draft": Variant({}, MODEL_DRAFT, routes=False,
                      note="+draft: speculative decoding with the draft model given (exact)"),
    "+spec": Variant({}, "self-little",
                     note="+spec: speculative decoding with the model's little pass as the "
                          "draft (exact)"),
    "+prompt-split": Variant({"features": Features(prompt_split=True)}, routes=False,
                             note="+prompt-split: the host split for prompt-sized ubatches too "
                                  "(the rule before 2026-11-26)"),
    "+no-split": Variant({"features": Features(split=False)}, routes=False,
                         note="+no-split: no expert computed on the CPU beside the slots"),
    "+gather": Variant({"features": Features(prompt_gather=GATHER_ENTRIES)}, routes=False,
                       note=f"+gather: a prompt's expert groups wait for {GATHER_ENTRIES} "
                            "entries while more copies can land (fewer, larger groups)"),
    "+bank": Variant({"prompt_bank": True}, routes=False,
                     note="+bank: prompt banks on (the default on a GPU)"),
    "+nobank": Variant({"prompt_bank": False}, routes=False,
                       note="+nobank: no prompt banks: a prompt's layers read their routing and "
                            "stream their misses through the slots"),
    "+nostream": Variant({"copy_stream": False}, routes=False,
                         note="+nostream: chunks copied one at a time, a decoded token's product "
                              "waiting on the host for them (no copy stream)"),
}
PLAIN = Variant({}, routes=False)


def _ubatch(name: str) -> tuple[str, int | None]:
    """A run's name and its ubatch size: "ncmoe@ub2048" -> ("ncmoe", 2048); None: the default
    (a larger ubatch is how stock llama.cpp users speed up long prompts)."""
    head, sep, tail = name.rpartition("@ub")
    if sep and tail.isdigit() and int(tail) > 0:
        return head, int(tail)
    return name, None


def _variant(name: str) -> tuple[str, Variant]:
    """A benchmark run's policy and variant: "promoe+little" -> ("promoe", RUN_VARIANTS
    ["+little"])."""
    for suffix, v in RUN_VARIANTS.items():
        if name.endswith(suffix):
            return name[:-len(suffix)], v
    return name, PLAIN


def _lossy(name: str) -> bool:
    return _variant(name)[1].lossy


@dataclass
class PolicyResult:
    """Means over the prompts of one policy's runs."""

    policy: str
    ttft_s: float
    tpot_s: float
    tokens_per_s: float
    hit_rate: float
    h2d_gb: float
    stall_share: float
    cache_slots: int
    host_layers: int
    ratios: dict[str, dict[str, float]]
    timeline: dict | None = None  # the cache's timeline summarized (``cache.timeline``)
    disk: dict | None = None  # the disk tier's reads a decoded token (a host budget)
    hot_path: dict | None = None  # the cache's host work a pass (``hot_path``)
    chosen: dict | None = None  # the default run: the policy chosen and why
    spec: dict | None = None  # a run with a draft: speculation's counters


def bench_prompts(llm: Llama, n_prompts: int, prompt_len: int,
                  seed: int = 0) -> list[list[int]]:
    """``n_prompts`` prompts of exactly ``prompt_len`` tokens: seeded shuffles of English words."""
    words = CALIBRATION_TEXT.split()
    rng = random.Random(seed)
    prompts = []
    for _ in range(n_prompts):
        ids: list[int] = []
        while len(ids) < prompt_len:
            rng.shuffle(words)
            ids += text_tokens(llm, " ".join(words))
        prompts.append(ids[:prompt_len])
    return prompts


def workload(model: Path, n_prompts: int, prompt_len: int, n_gen: int,
             n_ctx: int | None = None) -> tuple[int, list[list[int]]]:
    """The context size and the prompts every run of a benchmark shares."""
    n_ctx = n_ctx or max(512, prompt_len + n_gen + 16)
    # the vocabulary alone: loading a model larger than the GPU only to tokenize costs a load
    with Llama(str(model), cache=None, vocab_only=True, verbose=False) as llm:
        return n_ctx, bench_prompts(llm, n_prompts, prompt_len)


def _sized(policy: str, gpu_budget: int | None, fraction: float | None, **kw: object
           ) -> CacheConfig:
    """``policy`` sized by the budget, else by the cache fraction (offload has no slots)."""
    sized = policy_spec(policy).placement != "host" and gpu_budget is None
    return CacheConfig(policy=policy, gpu_budget=gpu_budget,
                       cache_fraction=fraction if sized else None,
                       **kw)  # type: ignore[arg-type]


def run_policy(model: Path, cfg: CacheConfig | None, prompts: list[list[int]], n_gen: int, *,
               n_ctx: int, n_threads: int | None, decode_gate: bool = True,
               draft: str | None = None, use_mmap: bool = False,
               routing_trace: Path | Routing | None = None, timeline: bool = False,
               n_ubatch: int | None = None, acceptance: AcceptanceReplay | None = None
               ) -> dict:
    """Load the model under ``cfg``, warm up, then generate ``n_gen`` tokens for every prompt
    (``decode_gate=False``: every gate calls the Python policy; ``draft``: speculative;
    ``use_mmap``: host weights mmap'd, else read into (pinned) buffers as --no-mmap does;
    ``routing_trace``: every expert matmul reads that trace's routing, not the router's;
    ``timeline``: the expert cache's timeline of the timed prompts, summarized per layer;
    ``n_ubatch``: the ubatch (and batch) size, default llama.cpp's; ``acceptance``: with a
    draft, each verification accepts as many drafts as it replays)."""
    spec: dict = {} if draft is None else {"draft": draft, "acceptance_replay": acceptance}
    if n_ubatch is not None:
        spec.update(n_batch=n_ubatch, n_ubatch=n_ubatch)
    if routing_trace is not None:
        spec["routing_trace"] = routing_trace
    with Llama.open(model, cache=cfg, n_ctx=n_ctx, n_threads=n_threads, use_mmap=use_mmap,
                    **spec) as llm:
        if llm.expert_cache is not None:
            llm.expert_cache.use_decode_gate(decode_gate)
        # a warm-up as long as the prompts (a first pass of a shape sets up its kernels), sharing
        # no prefix with them, so that the first prompt is timed as the others are
        generate(llm, prompts[0][::-1], 2, SamplingParams(greedy=True), ignore_eos=True)
        cache = llm.expert_cache
        first_pass = 0
        if cache is not None:
            cache.reset_stats()
            first_pass = cache.passes(next(iter(cache.layers)))[0]
            if timeline:
                cache.start_timeline()
        phases = _PhaseCounts(llm, cache) if cache is not None else None
        runs = []
        t0 = time.perf_counter()
        for p in prompts:
            if phases is not None:
                phases.begin(len(p))
            runs.append(generate(llm, p, n_gen, SamplingParams(greedy=True), ignore_eos=True,
                                 tokens_flag="--gen"))
            if phases is not None:
                phases.end()
        wall = time.perf_counter() - t0
        stats = llm.expert_stats()
        n_passes = cache.passes(next(iter(cache.layers)))[0] - first_pass if cache else 0
        host_work = hot_path(cache.stats(), n_passes) if cache is not None and n_passes else None
        if host_work is not None and phases is not None:
            host_work["phases"] = phases.per_pass()
        spans = cache.timeline() if cache is not None and timeline else None
        if llm.replay is not None:
            llm.replay.check()
        spec = llm.speculator.stats_json() if llm.speculator is not None else None
    n = len(runs)
    tpot = sum(r.tpot_s for r in runs) / n
    return {
        "ttft_s": sum(r.ttft_s for r in runs) / n,
        "tpot_s": tpot,
        "tokens_per_s": 1.0 / tpot if tpot > 0 else 0.0,
        "hit_rate": hit_rate(stats["hits"], stats["misses"]) or 0.0,
        "h2d_gb": stats["h2d_bytes"] / 1e9,
        "stall_share": stats["stall_s"] / wall if wall > 0 else 0.0,
        "cache_slots": stats["cache_slots"],
        "host_layers": stats["host_layers"],
        "tokens": [r.tokens for r in runs],
        "stats": stats,
        "per_prompt": [(r.ttft_s, r.tpot_s) for r in runs],
        **({"disk": _disk_cost(stats, sum(len(r.tokens) for r in runs), llm.disk_rate)}
           if "disk_reads" in stats else {}),
        **({"timeline": summarize(*spans)} if spans is not None else {}),
        **({"hot_path": host_work} if host_work else {}),
        **({"spec": spec} if spec is not None else {}),
    }


HOT_PATH = ("stops", "readbacks", "uploads", "mini_graphs", "products", "copy_waits", "quiet",
            "banked", "whole", "event_waits")


def hot_path(stats: dict, n_passes: int) -> dict[str, float]:
    """The cache's host work per forward pass (``HOT_PATH`` counters over ``n_passes``)."""
    return {"passes": n_passes, **{k: stats[k] / n_passes for k in HOT_PATH}}


def default_run(model: Path, gpu_budget: int | None, cache_fraction: float | None,
                routing: Routing | None, n_ctx: int, n_ubatch: int = 512, *,
                host_budget: int | None = None) -> dict:
    """The policy a run without ``--policy`` takes for ``model`` at this budget, on ``routing``
    when replayed (``placement.before.default_choice``, as ``Llama`` decides it), the benchmark run
    of the same configuration (``run``), and why."""
    cfg = CacheConfig(policy=None, gpu_budget=gpu_budget,
                      cache_fraction=None if gpu_budget is not None else cache_fraction,
                      host_budget=host_budget)
    choice = default_choice(read_model_file(model), cfg, n_ctx=n_ctx, n_ubatch=n_ubatch,
                            routing_hit=routing.decode_hit_rate if routing is not None else None)
    if choice is None:
        return {"policy": DEFAULT_POLICY, "run": DEFAULT_POLICY,
                "reason": f"policy {DEFAULT_POLICY}: nothing to choose (no "
                f"{setting('gpu_budget')}, a host budget, or a CPU build without a machine "
                "profile)"}
    # the run of the same configuration: promoe's prompt banks as chosen, when that is not
    # what a named promoe run gets
    run = choice.policy
    if choice.policy == "promoe" and choice.alternative:
        run += "+bank" if choice.shape.bank else "+nobank"
    return {"policy": choice.policy, "run": run, "prompt_bank": choice.shape.bank,
            "reason": choice.reason()}


class _PhaseCounts:
    """The cache's ``HOT_PATH`` counters of each prompt split where its decode begins (the first
    batch of one token, or the first after the prompt's tokens): one read of the counters
    there, none a decoded token."""

    def __init__(self, llm: Llama, cache: ExpertCache) -> None:
        self._cache, self._layer = cache, next(iter(cache.layers))
        self._sums = {ph: dict.fromkeys(HOT_PATH, 0) for ph in ("prefill", "decode")}
        self._passes = {"prefill": 0, "decode": 0}
        self._start: tuple[dict, int] | None = None
        self._mid: tuple[dict, int] | None = None
        self._left = 0  # prompt tokens not yet fed
        self._armed = False
        before = llm.on_batch

        def on_batch(tokens: Sequence[int]) -> None:
            if self._armed and (len(tokens) == 1 or self._left <= 0):
                self._armed = False
                self._mid = self._read()
            self._left -= len(tokens)
            if before is not None:
                before(tokens)

        llm.on_batch = on_batch

    def _read(self) -> tuple[dict, int]:
        return self._cache.stats(), self._cache.passes(self._layer)[0]

    def begin(self, prompt_len: int) -> None:
        """A prompt of ``prompt_len`` tokens is about to be generated from."""
        self._start, self._mid = self._read(), None
        self._left, self._armed = prompt_len, True

    def end(self) -> None:
        """Its generation ended: its counters go to their phases."""
        assert self._start is not None
        end = self._read()
        mid = self._mid or end
        for phase, (a, b) in (("prefill", (self._start, mid)), ("decode", (mid, end))):
            for k in HOT_PATH:
                self._sums[phase][k] += b[0][k] - a[0][k]
            self._passes[phase] += b[1] - a[1]
        self._armed = False

    def per_pass(self) -> dict[str, dict[str, float]]:
        """Each phase's counters a pass (phases without a pass left out)."""
        return {ph: hot_path(self._sums[ph], n) for ph, n in self._passes.items() if n}


def llama_cpp_threads(cpuinfo: str | None = None) -> int:
    """The threads llama.cpp's tools compute with by default: one per physical core (SMT
    siblings left out), read from /proc/cpuinfo; every CPU where that says nothing."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(errors="replace")
        except OSError:
            return os.cpu_count() or 1
    cores = set()
    for block in cpuinfo.split("\n\n"):
        fields = dict(line.split(":", 1) for line in block.splitlines() if ":" in line)
        fields = {k.strip(): v.strip() for k, v in fields.items()}
        if "core id" in fields:
            cores.add((fields.get("physical id", "0"), fields["core id"]))
    return len(cores) or os.cpu_count() or 1


def _baseline(raw: dict[str, dict], base: str) -> dict[str, float] | None:
    """TTFT and TPOT of baseline ``base``; for ncmoe the faster of its runs (mmap'd or not, at
    any ubatch size), metric by metric, and for ncmoe+draft the same with the draft model."""
    def stock(name: str, variant: str) -> bool:
        pol, v = _variant(_ubatch(name)[0])
        return pol in NCMOE_RUNS and v is RUN_VARIANTS.get(variant, PLAIN)

    runs = [r for n, r in raw.items()
            if (stock(n, "") if base == "ncmoe" else stock(n, "+draft")
                if base == DRAFT_BASELINE else n == base)]
    if not runs:
        return None
    return {"ttft_s": min(r["ttft_s"] for r in runs), "tpot_s": min(r["tpot_s"] for r in runs)}


def _disk_cost(stats: dict, n_tokens: int, rate: DiskRate | None) -> dict:
    """What the disk tier read and waited for, a generated token (prompt passes included)."""
    n = max(n_tokens, 1)
    return {"reads_per_token": stats["disk_reads"] / n, "bytes_per_token": stats["disk_bytes"] / n,
            "wait_s_per_token": stats["disk_wait_s"] / n,
            "host_hit_rate": hit_rate(stats["host_hits"], stats["host_misses"]),
            "direct_share": stats["disk_direct_bytes"] / stats["disk_bytes"]
            if stats["disk_bytes"] else None,
            "measured_gbps": rate.gbps if rate is not None else None}


def run_bench(model: Path, policies: list[str], *, gpu_budget: int | None,
              cache_fraction: float | None, prompt_len: int, n_gen: int, n_prompts: int = 3,
              n_ctx: int | None = None, n_threads: int | None = None,
              routing_trace: Path | None = None, timeline: bool = False,
              host_budget: int | None = None, acceptance: AcceptanceReplay | None = None,
              draft_model: Path | None = None,
              progress: Callable[[str], None] = lambda s: None) -> dict:
    """Every policy (and stock run, ``STOCK_RUNS``) on the same prompts, each on the routing of
    ``routing_trace`` when given, all with ``n_threads`` (default: as llama.cpp picks them, one
    per physical core); returns results, ratios and whether tokens agreed (``timeline``: with
    each cached run's timeline summarized per layer, ``cache.timeline``; ``host_budget``: the
    cached policies with the disk tier under it, stock's runs with every expert in memory;
    ``acceptance``: the runs with a draft accept as many drafts as it replays, their tokens
    meaningless; ``draft_model``: the draft of the runs named with +draft)."""
    drafts = {_variant(_ubatch(p)[0])[1].draft for p in policies}
    if acceptance is not None and not drafts - {None}:
        raise ValueError("an acceptance replay replays a draft's acceptance: add a run with a "
                         "draft (e.g. promoe+spec, or promoe+draft with a draft model)")
    if MODEL_DRAFT in drafts and draft_model is None:
        raise ValueError("a run named with +draft drafts with a draft model: give one (--draft "
                         "GGUF, with the model's vocabulary)")
    if draft_model is not None and not Path(draft_model).is_file():
        raise ValueError(f"draft model {draft_model} does not exist: give a GGUF with the "
                         "model's vocabulary (`forecache make-model --preset qwen2-0.5b`)")
    n_threads = n_threads or llama_cpp_threads()
    routing = None
    if routing_trace is not None:  # mapped once for every run; a bad trace stops them all here
        mf = require_moe(model)
        routing = load_routing(routing_trace, n_layers=len(mf.moe_layers()),
                               n_expert=mf.n_expert, top_k=mf.n_expert_used)
    n_ctx, prompts = workload(model, n_prompts, prompt_len, n_gen, n_ctx)
    raw: dict[str, dict] = {}
    errors: dict[str, str] = {}
    # the default last: its choice reuses the chosen policy's run when the call makes one
    order = [p for p in policies if p != DEFAULT_RUN] + \
        [DEFAULT_RUN] * (DEFAULT_RUN in policies)
    for pol in order:
        chosen = None
        run = pol
        if pol == DEFAULT_RUN:
            chosen = default_run(model, gpu_budget, cache_fraction, routing, n_ctx,
                                 host_budget=host_budget)
            progress(f"{DEFAULT_RUN}: {chosen['reason']}")
            run = chosen["run"]
            if run in raw:  # the same configuration, run in this call
                raw[pol] = {**raw[run], "chosen": chosen}
                continue
        name, n_ubatch = _ubatch(run)
        if name in NCMOE_RUNS and gpu_budget is None:
            progress(f"{pol} skipped: it needs {setting('gpu_budget')}")
            continue
        base, variant = _variant(name)
        extra, draft = variant.kw, variant.draft
        if draft == MODEL_DRAFT:
            draft = str(draft_model)
        if routing_trace is not None and variant.routes:
            progress(f"{pol} skipped: a replayed routing fixes every token's experts")
            continue
        progress(f"running {pol}{f' ({run})' if run != pol else ''} ...")
        mmap = base == "ncmoe-mmap"
        if host_budget is not None and base != "all-gpu" and \
                policy_spec("ncmoe" if mmap else base).cached:
            extra = {**extra, "host_budget": host_budget}
        cfg = None if base == "all-gpu" else _sized("ncmoe" if mmap else base, gpu_budget,
                                                     cache_fraction, **extra)
        try:
            raw[pol] = run_policy(model, cfg, prompts, n_gen, n_ctx=n_ctx, n_threads=n_threads,
                                  draft=draft, use_mmap=mmap, routing_trace=routing,
                                  timeline=timeline, n_ubatch=n_ubatch, acceptance=acceptance)
        except (ValueError, RuntimeError, OSError) as e:
            # one placement that cannot run (a budget too small, a failed load) leaves the others'
            # figures standing; the report names it
            progress(f"{pol} failed: {e}")
            errors[pol] = str(e)
            continue
        if chosen is not None:
            raw[pol]["chosen"] = chosen
    results = []
    for pol, r in raw.items():
        ratios = {}
        for base in (*BASELINES, DRAFT_BASELINE):
            b = _baseline(raw, base)
            if b is not None and base != pol:
                ratios[base] = {
                    "ttft_speedup": b["ttft_s"] / r["ttft_s"] if r["ttft_s"] > 0 else 0.0,
                    "decode_speedup": b["tpot_s"] / r["tpot_s"] if r["tpot_s"] > 0 else 0.0,
                }
        fields = {k: v for k, v in r.items() if k not in ("tokens", "stats", "per_prompt")}
        results.append(PolicyResult(policy=pol, ratios=ratios, **fields))
    # (a replayed acceptance makes a drafted run's tokens meaningless)
    exact = [r["tokens"] for pol, r in raw.items() if not _lossy(_ubatch(pol)[0]) and
             not (acceptance is not None and _variant(_ubatch(pol)[0])[1].draft)]
    return {
        "model": str(model), "prompt_len": prompt_len, "gen": n_gen, "n_prompts": n_prompts,
        "gpu_budget": gpu_budget, "cache_fraction": cache_fraction, "host_budget": host_budget,
        "routing_trace": str(routing_trace) if routing_trace else None, "threads": n_threads,
        "acceptance_replay": acceptance.label() if acceptance is not None else None,
        "draft_model": str(draft_model) if draft_model is not None else None,
        # replayed routing computes meaningless tokens: they are not compared
        "same_tokens": None if routing_trace else all(t == exact[0] for t in exact),
        "results": [asdict(r) for r in results], "errors": errors,
    }


def format_table(report: dict) -> str:
    """The benchmark as a fixed-width text table."""
    bases = [*BASELINES, *([DRAFT_BASELINE] if any(DRAFT_BASELINE in r["ratios"]
                                                   for r in report["results"]) else [])]
    head = (f"{'policy':<16} {'TTFT ms':>9} {'TPOT ms':>9} {'tok/s':>8} {'hit %':>6} "
            f"{'H2D GB':>8} {'stall %':>8}" + "".join(f"{'vs ' + b:>18}" for b in bases))
    lines = [head, "-" * len(head)]
    for r in report["results"]:
        def ratio(base: str, r: dict = r) -> str:
            x = r["ratios"].get(base)
            return f"{x['ttft_speedup']:.2f}x/{x['decode_speedup']:.2f}x" if x else "-"
        lines.append(f"{r['policy']:<16} {r['ttft_s'] * 1e3:>9.1f} {r['tpot_s'] * 1e3:>9.2f} "
                     f"{r['tokens_per_s']:>8.1f} {r['hit_rate'] * 100:>6.1f} {r['h2d_gb']:>8.3f} "
                     f"{r['stall_share'] * 100:>8.1f}" + "".join(f"{ratio(b):>18}"
                                                                  for b in bases))
    for pol, err in report.get("errors", {}).items():
        lines.append(f"{pol}: failed ({err})")
    for r in report["results"]:
        if r.get("chosen"):
            lines.append(f"{r['policy']} (no --policy): {r['chosen']['reason']}")
    for r in report["results"]:
        h = r.get("hot_path")
        if h:
            lines.append(f"{r['policy']}: per pass " + ", ".join(
                f"{k.replace('_', ' ')} {h[k]:.1f}" for k in HOT_PATH))
            for phase, ph in h.get("phases", {}).items():
                lines.append(f"  {phase} ({ph['passes']} passes): " + ", ".join(
                    f"{k.replace('_', ' ')} {ph[k]:.1f}" for k in HOT_PATH))
    for r in report["results"]:
        d = r.get("disk")
        if d:
            rate = f"; the file read at {d['measured_gbps']:.2f} GB/s at start" \
                if d.get("measured_gbps") else ""
            lines.append(f"{r['policy']}: disk tier {d['reads_per_token']:.1f} experts "
                         f"({d['bytes_per_token'] / 2**20:.1f} MiB) read a token, "
                         f"{d['wait_s_per_token'] * 1e3:.1f} ms waited a token{rate}")
    for r in report["results"]:
        if r.get("timeline"):
            lines.append(f"timeline of {r['policy']} (the cache's work, a pass):")
            lines.append(format_summary(r["timeline"]))
    for r in report["results"]:
        sp = r.get("spec")
        if sp:
            lines.append(f"{r['policy']}: draft {sp['draft']}, {sp['verify_passes']} "
                         f"verifications, {sp['accepted']} of {sp['drafted']} drafts accepted, "
                         f"{sp['undrafted']} tokens undrafted" +
                         (f"; cross-model prefetch {sp['spec_prefetch']}"
                          if "spec_prefetch" in sp else ""))
    if report.get("acceptance_replay"):
        lines.append(f"every run with a draft: {report['acceptance_replay']} (benchmarks only)")
    if report.get("routing_trace"):
        lines.append("ratios: prefill (TTFT) speedup / decode (TPOT) speedup; every run replays "
                     f"the routing of {Path(report['routing_trace']).name} (tokens meaningless, "
                     "not compared); vs ncmoe: the faster of --no-mmap and mmap")
    else:
        lines.append("ratios: prefill (TTFT) speedup / decode (TPOT) speedup; same greedy "
                     f"tokens (exact runs): {'yes' if report['same_tokens'] else 'NO'}")
    notes = [_variant(_ubatch(r["policy"])[0])[1].note for r in report["results"]]
    lines.extend(dict.fromkeys(n for n in notes if n))
    return "\n".join(lines)


def run_ablation(model: Path, *, gpu_budget: int | None, cache_fraction: float | None,
                 prompt_len: int, n_gen: int, n_prompts: int = 3, n_threads: int | None = None,
                 progress: Callable[[str], None] = lambda s: None) -> dict:
    """ProMoE's ablation (Fig. 13/14) measured: lru, then promoe's techniques added one by one
    (the rows of ``cache.prefetcher.ABLATION``), on the same prompts; ratios to lru."""
    from forecache.cache.prefetcher import ABLATION

    n_ctx, prompts = workload(model, n_prompts, prompt_len, n_gen)
    rows = []
    for label, policy, feats in ABLATION:
        progress(f"running {label} ...")
        cfg = _sized(policy, gpu_budget, cache_fraction, features=feats)
        r = run_policy(model, cfg, prompts, n_gen, n_ctx=n_ctx, n_threads=n_threads)
        rows.append({"run": label, **{k: v for k, v in r.items() if k != "per_prompt"}})
    base = rows[0]
    for r in rows:
        r["prefill_speedup"] = base["ttft_s"] / r["ttft_s"] if r["ttft_s"] > 0 else 0.0
        r["decode_speedup"] = base["tpot_s"] / r["tpot_s"] if r["tpot_s"] > 0 else 0.0
        r["stall_cut"] = (base["stats"]["stall_s"] / r["stats"]["stall_s"]
                          if r["stats"]["stall_s"] > 0 else float("inf"))
    first = rows[0]["tokens"]
    return {"model": str(model), "prompt_len": prompt_len, "gen": n_gen, "n_prompts": n_prompts,
            "gpu_budget": gpu_budget, "cache_fraction": cache_fraction,
            "same_tokens": all(r["tokens"] == first for r in rows),
            "runs": [{k: v for k, v in r.items() if k != "tokens"} for r in rows]}


def format_ablation(report: dict) -> str:
    """The measured ablation as a text table."""
    head = (f"{'run':<20} {'TTFT ms':>9} {'TPOT ms':>9} {'hit %':>6} {'stall s':>8} "
            f"{'prefill':>8} {'decode':>8} {'stall cut':>9}")
    lines = [head, "-" * len(head)]
    for r in report["runs"]:
        lines.append(f"{r['run']:<20} {r['ttft_s'] * 1e3:>9.2f} {r['tpot_s'] * 1e3:>9.3f} "
                     f"{r['hit_rate'] * 100:>6.1f} {r['stats']['stall_s']:>8.4f} "
                     f"{r['prefill_speedup']:>7.2f}x {r['decode_speedup']:>7.2f}x "
                     f"{r['stall_cut']:>8.2f}x")
    lines.append("ratios to base (lru); stall = compute waiting for copies; same greedy tokens: "
                 f"{'yes' if report['same_tokens'] else 'NO'}")
    return "\n".join(lines)


def run_rates(model: Path, rates: list[float], policies: list[str], *, prompt_len: int,
              n_gen: int, n_prompts: int = 3, n_threads: int | None = None,
              progress: Callable[[str], None] = lambda s: None) -> dict:
    """ProMoE's cache-rate sweep (Fig. 17) measured: TTFT and TPOT of each policy at each share
    of experts in slots (offload, which has no slots, once)."""
    n_ctx, prompts = workload(model, n_prompts, prompt_len, n_gen)
    table: dict[str, dict[str, tuple[float, float]]] = {}
    fixed = None
    for rate in rates:
        row = {}
        for pol in policies:
            if pol == "offload" and fixed is not None:
                row[pol] = fixed
                continue
            progress(f"running {pol} at {rate:g} ...")
            r = run_policy(model, _sized(pol, None, rate), prompts, n_gen, n_ctx=n_ctx,
                           n_threads=n_threads)
            row[pol] = (r["ttft_s"], r["tpot_s"])
            if pol == "offload":
                fixed = row[pol]
        table[f"{rate:g}"] = row
    return {"model": str(model), "prompt_len": prompt_len, "gen": n_gen, "n_prompts": n_prompts,
            "policies": policies, "rates": table}


def format_rates(report: dict) -> str:
    """The measured cache-rate sweep: TTFT ms / TPOT ms per policy and rate."""
    pols = report["policies"]
    lines = [f"{'cache rate':<11}" + "".join(f"{p:>20}" for p in pols)]
    for rate, row in report["rates"].items():
        lines.append(f"{rate:<11}" + "".join(
            f"{row[p][0] * 1e3:>11.1f} / {row[p][1] * 1e3:>5.2f}" for p in pols))
    lines.append("TTFT ms / TPOT ms")
    return "\n".join(lines)

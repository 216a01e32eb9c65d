"""Setting up a simulation from a trace file: shape, cache size, predictor fitting, ablations."""

from __future__ import annotations

import argparse
import copy
import json
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from forecache.cache.allocation import layer_decay, reallocate
from forecache.cache.budget import fraction_slots, parse_size
from forecache.cache.choice import DecodeShape
from forecache.cache.cost import Profile
from forecache.cache.prefetcher import ABLATION
from forecache.cache.registry import NCMOE_RUNS
from forecache.errors import setting
from forecache.predictor.base import Predictor, source_layer
from forecache.predictor.eam import EAMPredictor
from forecache.predictor.metrics import topk_accuracy
from forecache.predictor.registry import AUTO_FALLBACKS, make_predictor, unavailable
from forecache.sim.shapes import ModelShape, shape_of, trace_model_names
from forecache.sim.simulate import SimConfig, SimResult, simulate
from forecache.trace import synth
from forecache.trace.format import Request, TraceFile, TraceInfo
from forecache.trace.stats import lru_hit_curves

# the run a simulated budget is split for: forecache's commands' default context and llama.cpp's
# ubatch, one sequence (the KV cache and compute buffers the runtime keeps out of the slots)
SIM_CONTEXT = 4096
SIM_UBATCH = 512


def buffer_bytes(shape: ModelShape) -> int:
    """Device memory a simulated budget keeps beside the weights: the KV cache and compute
    buffers of a run of ``SIM_CONTEXT`` tokens in ubatches of ``SIM_UBATCH``."""
    return shape.kv_cache_bytes(SIM_CONTEXT) + shape.compute_bytes(SIM_UBATCH)


def speedup(a: float, b: float) -> str:
    """``a / b`` as a speedup ("1.25x"); "-" when both are zero, "inf" when only ``b`` is."""
    return f"{a / b:.2f}x" if b > 0 else ("-" if a == 0 else "inf")


# what a report's ratios over ncmoe are over (``StockBest``), and its legend's words for them
NCMOE_BEST = ("the faster of ncmoe (--no-mmap, host experts pinned) and ncmoe-mmap (llama.cpp's "
              "default mmap: pageable host experts, copied up slower for a prompt), metric by "
              "metric (TTFT and TPOT separately)")
NCMOE_LEGEND = f"over ncmoe: over {NCMOE_BEST}"
# the figures ``StockBest`` takes the lowest of
STOCK_METRICS = ("ttft_s", "tpot_s", "prefill_s", "decode_s", "stall_s")


@dataclass(frozen=True)
class StockBest:
    """Stock llama.cpp's best --n-cpu-moe, metric by metric: each figure the lowest of its
    ``runs`` (``NCMOE_RUNS``: host experts pinned, and mmap'd), so that a ratio over ncmoe is
    over stock's faster choice in that figure (TTFT and TPOT may come from different runs)."""

    runs: dict[str, SimResult]

    def of(self, metric: str) -> tuple[str, float]:
        """The run with the lowest ``metric`` and its value; ties (within rounding: decode is
        the same run either way, its sums taken at other clock times) go to the first, pinned."""
        got = {n: float(getattr(r, metric)) for n, r in self.runs.items()}
        low = min(got.values())
        name = next(n for n, v in got.items() if v <= low + 1e-9 * abs(low))
        return name, got[name]

    @property
    def ttft_s(self) -> float:
        return self.of("ttft_s")[1]

    @property
    def tpot_s(self) -> float:
        return self.of("tpot_s")[1]

    @property
    def prefill_s(self) -> float:
        return self.of("prefill_s")[1]

    @property
    def decode_s(self) -> float:
        return self.of("decode_s")[1]

    @property
    def stall_s(self) -> float:
        return self.of("stall_s")[1]

    def to_json(self) -> dict:
        """Each figure and the run it comes from (``ttft_from``, ...)."""
        out: dict = {}
        for m in STOCK_METRICS:
            name, v = self.of(m)
            out[m] = v
            out[m.removesuffix("_s") + "_from"] = name
        return out


def stock_best(runs: Mapping[str, SimResult]) -> StockBest:
    """``StockBest`` of the ncmoe runs among ``runs`` (keyed by policy)."""
    got = {n: runs[n] for n in NCMOE_RUNS if n in runs}
    if not got:
        raise ValueError(f"no ncmoe run ({', '.join(NCMOE_RUNS)}) to state speedups over")
    return StockBest(got)


def trace_shape(path: Path, info: TraceInfo, name: str | None, qtype: str) -> ModelShape:
    """The model shape to replay ``path`` at: ``name``, else the trace's own model."""
    if name is None:
        name = info.meta.get("preset") or trace_model_names().get(path.stem)
        if name is None:
            raise ValueError(f"{path.name}: its model is not in models.yaml; give "
                             f"{setting('shape', 'NAME')}")
    shape = shape_of(name, qtype)
    got = (shape.layers, shape.experts, shape.top_k)
    want = (info.n_layers, info.n_expert, info.top_k)
    if got != want:
        raise ValueError(f"shape {name} has layers/experts/top-k {got} but the trace has {want}; "
                         f"{setting('shape')} must agree on those")
    return shape


def slots_for(shape: ModelShape, n_layers_cached: int, budget: str | None,
              fraction: float | None) -> int:
    """Slots per cached layer for a device budget or a cache fraction."""
    if (budget is None) == (fraction is None):
        raise ValueError(f"give exactly one of {setting('budget')} and "
                         f"{setting('cache_fraction')}")
    if fraction is not None:
        return fraction_slots(shape.experts, fraction)
    assert budget is not None
    mem = shape.memory(parse_size(budget), n_ctx=SIM_CONTEXT, n_ubatch=SIM_UBATCH,
                       layers=n_layers_cached)
    left = mem.expert_budget
    if left < shape.expert_bytes * n_layers_cached:
        raise ValueError(f"budget {budget} leaves {max(left, 0) / 2**30:.1f} GiB after the "
                         f"non-expert weights and buffers ({mem.fixed_bytes / 2**30:.1f} GiB): "
                         f"not one expert per layer; raise {setting('budget')}")
    return min(mem.slots_per_layer())


def decode_shape(shape: ModelShape, n_slots: int) -> DecodeShape:
    """The default placement's view (``cache.choice``) of ``shape`` with ``n_slots`` slots a
    layer, ncmoe's layers split as the simulator splits them."""
    on_gpu = min(shape.layers, n_slots * shape.layers // shape.experts)
    return DecodeShape(shape.layers, shape.experts, shape.top_k, n_slots, shape.layers - on_gpu,
                       shape.dense_bytes, shape.layers)


def split_requests(tf: TraceFile, fit_fraction: float) -> tuple[list[Request], list[Request]]:
    """(fit, replay): the first ``fit_fraction`` of the requests fit predictors and profiles; a
    single-request trace is split into two contiguous halves."""
    reqs = list(tf.requests())
    if len(reqs) == 1:
        r = reqs[0]
        h = r.n_tokens // 2

        def part(sl: slice) -> Request:
            def cut(a: np.ndarray | None) -> np.ndarray | None:
                return None if a is None else a[sl]
            return Request(experts=r.experts[sl], token_ids=cut(r.token_ids),
                           weights=cut(r.weights), gate_input=cut(r.gate_input),
                           phase=cut(r.phase))
        return [part(slice(0, h))], [part(slice(h, None))]
    n_fit = min(max(1, int(round(len(reqs) * fit_fraction))), len(reqs) - 1)
    return reqs[:n_fit], reqs[n_fit:]


def fit_predictor(name: str, info: TraceInfo, fit: Sequence[Request], window: int
                  ) -> tuple[str, Predictor]:
    """Fit ``name`` (``auto``: learned with gate inputs, else the best of eam, token and history
    by top-k accuracy on the last third of ``fit``) for ``window``."""
    pairs = [(source_layer(t, window), t) for t in range(1, info.n_layers)]
    if name == "auto":
        if unavailable("learned", info, None) is None:
            name = "learned"
        else:
            names = [n for n in AUTO_FALLBACKS if unavailable(n, info, None) is None]
            name = _best(names, info, fit, pairs) if len(fit) > 2 else names[0]
    why = unavailable(name, info, None)
    if why:
        raise ValueError(f"predictor {name}: {why}")
    p = make_predictor(name, info, pairs)
    p.fit(fit)
    return name, p


def _best(names: list[str], info: TraceInfo, fit: Sequence[Request],
          pairs: list[tuple[int, int]]) -> str:
    cut = max(1, len(fit) * 2 // 3)
    scored = []
    for name in names:
        p = make_predictor(name, info, pairs)
        p.fit(fit[:cut])
        total = rows = 0.0
        for req in fit[cut:]:
            out = p.score_request(req, pairs)
            for (_, b), sc in out.items():
                s, n = topk_accuracy(sc, req.experts[:, b])
                total, rows = total + s, rows + n
        scored.append((total / rows if rows else 0.0, name))
    return max(scored)[1]


def static_profile(fit: Sequence[Request], info: TraceInfo) -> np.ndarray:
    """Routed counts [L, E] of the fit requests (the static policy's hottest experts)."""
    counts = np.zeros((info.n_layers, info.n_expert), dtype=np.int64)
    for r in fit:
        for il in range(info.n_layers):
            ids = r.experts[:, il].ravel()
            np.add.at(counts[il], ids[ids >= 0], 1)
    return counts


def infinity_setup(fit: Sequence[Request], info: TraceInfo, shape: ModelShape,
                   layers: Sequence[int], n_slots: int, *, decay: bool = False,
                   ) -> tuple[list[int], EAMPredictor]:
    """What the infinity policy is run with: slots per model layer (``n_slots`` on each of
    ``layers``, moved between them by the ``fit`` requests' decode reuse, as ``placement``
    does with a stored collection; ``decay``: weighted by MoE-Infinity's layer term) and the
    EAM predictor fitted to ``fit`` without a prior (experts no match activates score 0)."""
    layers = list(layers)
    even = [n_slots if il in layers else 0 for il in range(shape.layers)]
    counted = [None if r.phase is None else r.phase != 0 for r in fit]
    curves = lru_hit_curves([r.experts[:, layers] for r in fit], info.n_expert, counted)
    slots = reallocate(even, layers, curves, layer_decay(len(layers)) if decay else None)
    p = EAMPredictor(info.n_layers, info.n_expert, info.top_k, prior_weight=0.0)
    p.fit(fit)
    return slots, p


def fresh(p: Predictor | None) -> Predictor | None:
    """A copy with the fitted state only (eam learns online: runs must not share it)."""
    if p is None or p.name == "learned":  # learned keeps no per-run state
        return p
    return copy.deepcopy(p)


def run_one(replay: Sequence[Request], shape: ModelShape, profile: Profile, cfg: SimConfig,
            predictor: Predictor | None) -> SimResult:
    return simulate(replay, shape, profile, cfg, fresh(predictor))


def run_ncmoe(replay: Sequence[Request], shape: ModelShape, profile: Profile, cfg: SimConfig
              ) -> dict[str, SimResult]:
    """``cfg``'s budget as stock llama.cpp's --n-cpu-moe, with pinned and with mmap'd host
    experts (``NCMOE_RUNS``)."""
    return {p: run_one(replay, shape, profile, replace(cfg, policy=p), None) for p in NCMOE_RUNS}


def ablation(replay: Sequence[Request], shape: ModelShape, profile: Profile, base: SimConfig,
             predictor: Predictor | None) -> list[tuple[str, SimResult]]:
    """ProMoE Fig. 13/14: LRU, then prefetch, chunking, early preemption and reordering added."""
    out = []
    for label, policy, feats in ABLATION:
        cfg = replace(base, policy=policy, features=feats)
        out.append((label, run_one(replay, shape, profile, cfg, predictor)))
    return out


def target_options(ap: argparse.ArgumentParser, like: Path) -> None:
    """A target benchmark's options: the real trace whose routing statistics are synthesized
    (``--like``), the shape, budget and profile, the requests, and ``--json``."""
    ap.add_argument("--like", type=Path, default=like)
    ap.add_argument("--shape", default="qwen2-57b-a14b")
    ap.add_argument("--budget", default="24GiB")
    ap.add_argument("--profile", default="rtx4090")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--decode", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None)


def target_replay(args: argparse.Namespace, progress: Callable[[str], None] = print
                  ) -> tuple[ModelShape, Profile, int, TraceInfo, list[Request], list[Request],
                             dict]:
    """Routing at ``args.shape`` (q4_k) synthesized like ``args.like``, split into the requests
    that fit predictors and those replayed: (shape, profile, slots a layer at ``args.budget``,
    trace info, fit, replay, the synthesis's meta)."""
    if not args.like.is_file():
        raise SystemExit(f"{args.like}: no such trace; give --like a real trace with the "
                         "shape's expert count and top-k")
    profile = Profile.load(args.profile)
    shape = shape_of(args.shape, "q4_k")
    info, fit, replay, meta = routed_like(args.like, args.shape, args, progress=progress)
    n_slots = slots_for(shape, shape.layers, args.budget, None)
    return shape, profile, n_slots, info, fit, replay, meta


def routed_like(like: Path, shape: str, args: argparse.Namespace, *, scale_free: bool = False,
                progress: Callable[[str], None] = lambda s: None
                ) -> tuple[TraceInfo, list[Request], list[Request], dict]:
    """``args.requests`` requests of ``args.prefill`` + ``args.decode`` tokens at the
    models.yaml model ``shape``, routed like the trace ``like`` (``synth.synthesize_like``,
    seed ``args.seed``), written as a trace and split into the half that fits predictors and
    the half replayed: (trace info, fit, replay, the synthesis's meta)."""
    reqs, meta = synth.synthesize_like(like, shape, n_requests=args.requests,
                                       prefill=args.prefill, decode=args.decode, seed=args.seed,
                                       progress=progress, scale_free=scale_free)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "routing.npz"
        synth.write_trace(path, reqs, meta)
        with TraceFile(path) as tf:
            info = tf.info()
            fit, replay = split_requests(tf, 0.5)
    return info, fit, replay, meta


@dataclass
class TargetBaselines:
    """A target benchmark's replay and its two baselines: ncmoe (the faster of its pinned and
    mmap'd runs, ``ncmoe_best``) and exact promoe."""

    shape: ModelShape
    profile: Profile
    n_slots: int
    replay: list[Request]
    predictor: Predictor
    base: SimConfig  # promoe at the budget, window 2
    ncmoe: SimResult  # --no-mmap: host experts pinned
    promoe: SimResult
    ncmoe_mmap: SimResult  # llama.cpp's default mmap: host experts pageable

    @property
    def ncmoe_best(self) -> StockBest:
        """What ratios over ncmoe are stated over."""
        return stock_best({"ncmoe": self.ncmoe, "ncmoe-mmap": self.ncmoe_mmap})

    def header(self, args: argparse.Namespace) -> str:
        """The line that names the setting and the baselines' decode times."""
        sh, nc, pro = self.shape, self.ncmoe_best, self.promoe
        return (f"{args.shape} q4_k at {args.budget} ({self.n_slots}/{sh.experts} slots a "
                f"layer), top-{sh.top_k}, profile {self.profile.name}, {len(self.replay)} "
                f"requests of {args.prefill} + {args.decode} tokens; ncmoe TPOT "
                f"{nc.tpot_s * 1e3:.2f} ms (the faster of --no-mmap and mmap), exact promoe "
                f"{pro.tpot_s * 1e3:.2f} ms ({speedup(nc.tpot_s, pro.tpot_s)})")

    def write_json(self, args: argparse.Namespace, runs: list[dict], promoe_key: str) -> None:
        """The setting, both baselines (promoe's under ``promoe_key``) and ``runs`` into
        ``args.json``, when given."""
        if not args.json:
            return
        args.json.write_text(json.dumps({"shape": args.shape, "budget": args.budget,
                                         "profile": self.profile.name, "n_slots": self.n_slots,
                                         "ncmoe": self.ncmoe.to_json(),
                                         "ncmoe-mmap": self.ncmoe_mmap.to_json(),
                                         "ncmoe_best": self.ncmoe_best.to_json(),
                                         promoe_key: self.promoe.to_json(), "runs": runs},
                                        indent=1))
        print(f"wrote {args.json}")


def target_baselines(args: argparse.Namespace) -> TargetBaselines:
    """``target_replay``, a predictor fitted for window 2, and the ncmoe (pinned and mmap'd) and
    promoe runs every variant is compared with."""
    shape, profile, n_slots, info, fit, replay, _ = target_replay(args)
    _, pred = fit_predictor("auto", info, fit, 2)
    base = SimConfig("promoe", n_slots, window=2, seed=args.seed)
    nc = run_ncmoe(replay, shape, profile, base)
    exact = run_one(replay, shape, profile, base, pred)
    return TargetBaselines(shape, profile, n_slots, replay, pred, base, ncmoe=nc["ncmoe"],
                           promoe=exact, ncmoe_mmap=nc["ncmoe-mmap"])


@dataclass(frozen=True)
class LengthModel:
    """Prompt and answer lengths of a chat workload: lognormal, each at least ``min_len``
    tokens, the prompt at most ``max_prompt`` and both within ``context`` (draws outside are
    drawn again)."""

    prompt_median: float
    prompt_sigma: float
    answer_median: float
    answer_sigma: float
    max_prompt: int
    context: int
    min_len: int = 4

    def draw(self, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """``n`` (prompt, answer) lengths in tokens."""
        prompts, answers = np.empty(n, np.int64), np.empty(n, np.int64)
        got = 0
        while got < n:
            p = np.rint(rng.lognormal(np.log(self.prompt_median), self.prompt_sigma, n))
            a = np.rint(rng.lognormal(np.log(self.answer_median), self.answer_sigma, n))
            ok = (p >= self.min_len) & (a >= self.min_len) & (p <= self.max_prompt) & \
                (p + a <= self.context)
            take = min(int(ok.sum()), n - got)
            prompts[got:got + take] = p[ok][:take]
            answers[got:got + take] = a[ok][:take]
            got += take
        return prompts, answers


# ShareGPT as serving benchmarks use it (vLLM's benchmark: prompts of at most 1024 tokens,
# prompt + answer at most 2048), its published means about 161 prompt and 338 answer tokens;
# the lognormal shapes (medians and sigmas) are assumed, chosen to give those means
SHAREGPT = LengthModel(prompt_median=100.0, prompt_sigma=1.15, answer_median=250.0,
                       answer_sigma=0.85, max_prompt=1024, context=2048)


def window_requests(pool: Sequence[Request], prompts: Sequence[int], answers: Sequence[int],
                    rng: np.random.Generator) -> list[Request]:
    """Requests of ``prompts[i]`` + ``answers[i]`` rows, each the routing of a window of a
    ``pool`` entry (drawn at random, at a random offset), its first rows the prompt: a few
    long synthesized requests stand for many, the windows' offsets keeping requests that run
    together from routing alike."""
    out = []
    for p, a in zip(prompts, answers, strict=True):
        n = int(p) + int(a)
        fits = [r for r in pool if r.n_tokens >= n]
        if not fits:
            raise ValueError(f"no pool entry holds a request of {n} tokens")
        src = fits[int(rng.integers(len(fits)))]
        at = int(rng.integers(src.n_tokens - n + 1))

        def cut(x: np.ndarray | None, at: int = at, n: int = n) -> np.ndarray | None:
            return None if x is None else x[at:at + n]
        out.append(Request(experts=src.experts[at:at + n], token_ids=cut(src.token_ids),
                           weights=cut(src.weights), gate_input=cut(src.gate_input),
                           phase=np.r_[np.zeros(int(p), np.int8), np.ones(int(a), np.int8)]))
    return out

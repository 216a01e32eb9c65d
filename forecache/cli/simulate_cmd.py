"""``forecache simulate``: replay a routing trace through a policy on a modelled machine."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import click

from forecache.cache.budget import format_size, parse_size
from forecache.cache.cost import DiskProfile, Profile
from forecache.cache.prefetcher import Features
from forecache.errors import setting
from forecache.sim.disk_reads import host_slots_for, host_weight_bytes
from forecache.sim.run import (
    NCMOE_BEST,
    StockBest,
    ablation,
    fit_predictor,
    infinity_setup,
    run_one,
    slots_for,
    speedup,
    split_requests,
    static_profile,
    stock_best,
    trace_shape,
)
from forecache.sim.simulate import SIM_POLICIES, SimConfig, SimResult
from forecache.trace.format import TraceFile, logged_layers


def _row(label: str, r: SimResult, base: SimResult | StockBest | None) -> str:
    d = r.to_json()
    sp = ""
    if base is not None:
        sp = (f"{speedup(base.ttft_s, r.ttft_s):>8} {speedup(base.tpot_s, r.tpot_s):>8} "
              f"{speedup(base.stall_s, r.stall_s):>8}")
    return (f"{label:<20} {r.ttft_s * 1e3:>10.1f} {r.tpot_s * 1e3:>9.2f} "
            f"{d['hit_rate'] * 100:>6.1f} {r.h2d_bytes / 1e9:>8.2f} {r.stall_s:>8.3f} {sp}")


HEAD = (f"{'run':<20} {'TTFT ms':>10} {'TPOT ms':>9} {'hit %':>6} {'H2D GB':>8} {'stall s':>8} "
        f"{'prefill':>8} {'decode':>8} {'stall-cut':>8}")


@click.command("simulate")
@click.option("--trace", "trace_path", required=True, type=click.Path(path_type=Path),
              help="Routing trace (.npz).")
@click.option("--policy", type=click.Choice(SIM_POLICIES), default="promoe", show_default=True)
@click.option("--shape", default=None, help="models.yaml model to replay at (default: the "
              "trace's own; must agree on layers, experts and top-k).")
@click.option("--qtype", default="q4_k", show_default=True, help="Quantization of the experts.")
@click.option("--budget", default=None, help="Device memory for the whole model (e.g. 24GiB).")
@click.option("--cache-fraction", type=float, default=None, help="Share of experts in slots.")
@click.option("--profile", "profile_name", default="rtx4090", show_default=True,
              help="Machine profile: a shipped name or a JSON file.")
@click.option("--predictor", default="auto", show_default=True,
              help="promoe's predictor: auto, learned, eam, token or history.")
@click.option("--window", type=click.IntRange(1, 64), default=2, show_default=True)
@click.option("--fit-fraction", type=float, default=0.5, show_default=True,
              help="Leading share of the requests that fits the predictor (the rest replay).")
@click.option("--n-ubatch", type=click.IntRange(1, 8192), default=512, show_default=True)
@click.option("--no-prefetch", is_flag=True)
@click.option("--no-chunk", is_flag=True)
@click.option("--no-preempt", is_flag=True)
@click.option("--no-reorder", is_flag=True)
@click.option("--no-split", is_flag=True)
@click.option("--stage-slots", type=click.IntRange(0, 256), default=None,
              help="promoe: stage slots for prompt passes, taken from the slots (default: as "
                   "many as a prompt layer misses, at most 32 and a 64th of the slots).")
@click.option("--ablation", "do_ablation", is_flag=True,
              help="ProMoE's ablation: lru, then each technique added (ignores --policy).")
@click.option("--compare", is_flag=True,
              help="Every policy at the same budget, with ratios to ncmoe (stock llama.cpp's "
                   "--n-cpu-moe: the faster of its --no-mmap and mmap runs in each figure; "
                   "ignores --policy).")
@click.option("--host-budget", default=None,
              help="Host memory for the model's experts and host-resident weights (e.g. "
                   "64GiB); experts beyond it are read from the model file by the disk tier "
                   "(llama.cpp's ncmoe-mmap: its page cache).")
@click.option("--disk-gbps", type=click.FloatRange(min=0, min_open=True), default=None,
              help="The disk's read rate (default: the profile's disk section).")
@click.option("--disk-latency-us", type=click.FloatRange(min=0), default=None,
              help="One read's fixed cost (default: the profile's, else 60).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def simulate_cmd(trace_path: Path, policy: str, shape: str | None, qtype: str,
                 budget: str | None, cache_fraction: float | None, profile_name: str,
                 predictor: str, window: int, fit_fraction: float, n_ubatch: int,
                 no_prefetch: bool, no_chunk: bool, no_preempt: bool, no_reorder: bool,
                 no_split: bool, stage_slots: int | None, do_ablation: bool, compare: bool,
                 host_budget: str | None, disk_gbps: float | None,
                 disk_latency_us: float | None, as_json: bool) -> None:
    """Replay TRACE through a policy with a timing model; TTFT, TPOT, hits, bytes, stalls."""
    profile = _with_disk(Profile.load(profile_name), disk_gbps, disk_latency_us)
    with TraceFile(trace_path) as tf:
        info = tf.info()
        sh = trace_shape(trace_path, info, shape, qtype)
        fit, replay = split_requests(tf, fit_fraction)
        layers = logged_layers(replay, info.n_layers)
        # a budget holds every MoE layer's slots, logged or not; the simulated run is the
        # logged layers (a partial trace's other layers are left out)
        n_slots = slots_for(sh, sh.layers, budget, cache_fraction)
        feats = Features(prefetch=not no_prefetch, chunk=not no_chunk, preempt=not no_preempt,
                         reorder=not no_reorder, split=not no_split)
        pred_name, pred = None, None
        if do_ablation or compare or (policy == "promoe" and feats.prefetch):
            pred_name, pred = fit_predictor(predictor, info, fit, window)
        n_host = None
        if host_budget is not None:
            n_host = host_slots_for(sh, parse_size(host_budget),
                                    host_weight_bytes(sh.name, sh.qtype))
            if n_host < sh.experts and profile.disk is None:
                raise click.UsageError(f"profile {profile.name} has no disk section: give "
                                       f"{setting('disk_gbps', 'GBPS')} for the disk tier")
        cfg = SimConfig(policy=policy, n_slots=n_slots, features=feats, window=window,
                        n_ubatch=n_ubatch, static_profile=static_profile(fit, info),
                        stage_slots=stage_slots, host_slots=n_host)
        # infinity: slots moved between layers by the fit requests' reuse, EAM predictions
        inf = infinity_setup(fit, info, sh, layers, n_slots) \
            if compare or policy == "infinity" else None

        def one(p: str) -> SimResult:
            if p == "infinity" and inf is not None:
                return run_one(replay, sh, profile, replace(cfg, policy=p, n_slots=inf[0]),
                               inf[1])
            return run_one(replay, sh, profile, replace(cfg, policy=p),
                           pred if p == "promoe" else None)
        head = {"trace": str(trace_path), "shape": sh.name, "qtype": sh.qtype,
                "profile": profile.name, "n_slots": n_slots, "host_slots": n_host,
                "disk": None if profile.disk is None else profile.disk.__dict__,
                "experts": sh.experts,
                "cached_layers": len(layers), "predictor": pred_name, "window": window,
                "fit_requests": len(fit), "replay_requests": len(replay)}
        if compare:
            runs = []
            for p in SIM_POLICIES:
                try:
                    runs.append((p if p != "promoe" else feats.label(), one(p)))
                except ValueError as e:  # a placement that cannot load the model at this host
                    if n_host is None:
                        raise
                    head.setdefault("cannot_run", {})[p] = str(e)
        elif do_ablation:
            runs = ablation(replay, sh, profile, cfg, pred)
            runs.append(("static", run_one(replay, sh, profile, replace(cfg, policy="static"),
                                           None)))
        else:
            runs = [(feats.label() if policy == "promoe" else policy, one(policy))]
    best = stock_best(dict(runs)) if compare else None
    if best is not None:
        head["ncmoe_best"] = best.to_json()
    if as_json:
        click.echo(json.dumps({**head, "runs": [{"run": k, **r.to_json()} for k, r in runs]}))
        return
    logged = (f"{len(layers)} layers" if len(layers) == sh.layers else
              f"{len(layers)} of {sh.layers} layers (the others logged no routing and are left "
              "out of the timings)")
    click.echo(f"{trace_path.name}: {sh.name} {sh.qtype}, {n_slots}/{sh.experts} slots in "
               f"{logged}, profile {profile.name}, predictor {pred_name} "
               f"(window {window}), {len(replay)} requests replayed")
    if n_host is not None:
        click.echo(_disk_line(sh.experts, sh.expert_bytes * sh.layers, n_host, profile))
    click.echo(HEAD)
    base: SimResult | StockBest | None = best if compare else \
        runs[0][1] if do_ablation else None
    for label, r in runs:
        click.echo(_row(label, r, base))
    for p, why in head.get("cannot_run", {}).items():
        click.echo(f"{p}: cannot run ({why})")
    for label, r in runs:
        if r.decode_disk_reads or r.disk_reads:
            waited = r.extra.get("decode_disk_stall_s", 0.0)
            click.echo(f"{label}: {r.disk_reads_per_token:.1f} reads "
                       f"({format_size(r.disk_bytes_per_token)}) from the file a decoded token "
                       f"(the disk tier's: whole experts; mmap's: read-ahead windows), "
                       f"{waited / r.decode_s if r.decode_s else 0:.0%} of decode waiting on "
                       "reads")
    if compare:
        click.echo(f"prefill/decode/stall-cut: ratios to ncmoe, {NCMOE_BEST}; stall = loading "
                   "time on the critical path")
    elif do_ablation:
        click.echo(f"prefill/decode/stall-cut: ratios to {runs[0][0]}; stall = loading time on "
                   "the critical path")


def _with_disk(profile: Profile, gbps: float | None, latency_us: float | None) -> Profile:
    """``profile`` with its disk's rate and latency replaced where given."""
    if gbps is None and latency_us is None:
        return profile
    base = profile.disk
    if base is None:
        if gbps is None:
            raise click.UsageError(f"profile {profile.name} has no disk section: give "
                                   f"{setting('disk_gbps', 'GBPS')} with --disk-latency-us")
        base = DiskProfile(gbps, 60.0, source="--disk-gbps")
    return replace(profile, disk=replace(
        base, gbps=base.gbps if gbps is None else gbps,
        latency_us=base.latency_us if latency_us is None else latency_us))


def _disk_line(experts: int, layer_bytes: int, n_host: int, profile: Profile) -> str:
    """Where the experts live with a host budget."""
    if n_host >= experts:
        return "disk tier: off, the host budget holds every expert"
    d = profile.disk
    assert d is not None
    return (f"disk tier: {n_host}/{experts} experts a layer in host slots "
            f"({format_size(n_host * layer_bytes)}, {n_host / experts:.0%}), the rest read from "
            f"the file at {d.gbps:g} GB/s, {d.latency_us:g} us a read, {d.queue_depth} in flight")


COMMANDS = [simulate_cmd]

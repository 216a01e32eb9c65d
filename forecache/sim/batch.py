"""A batch job replayed through the simulator: ``forecache batch``'s continuous batching of
``n_seq`` sequences, whose ubatches hold rows of several requests and also pay attention over
each row's context (``simulate_batch``), and how llama.cpp splits a batch into ubatches
(``split_batch``)."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from forecache.cache.cost import Profile
from forecache.cache.policies import hit_rate
from forecache.cache.prefetcher import ProMoEPolicy
from forecache.predictor.base import Predictor
from forecache.roofline.batch import (
    MICRO_MAX,
    admit_lane,
    batch_tokens,
    fill_rows,
    prefill_seqs,
    prompt_take,
    split_batch,
)
from forecache.sim.shapes import ModelShape
from forecache.sim.simulate import SimConfig, Simulator
from forecache.trace.format import Request, logged_layers

# what a batch job's critical path waits on: the device's compute, the CPU (host experts,
# host attention), the bus (copies the compute waits for) and the runtime's own steps
RESOURCES = ("GPU", "CPU", "PCIe", "runtime")


@dataclass
class BatchResult:
    """A batch job replayed by ``simulate_batch``."""

    n_requests: int
    n_seq: int
    job_s: float  # virtual time from the first admission to the last finish (or the drain)
    generated: int  # tokens sampled: the requests' answer lengths (up to the drain)
    complete: bool  # every request finished (not stopped at the drain)
    prompt_tokens: int  # prompt rows fed
    prefill_s: float  # ubatches with prompt rows (the decode rows beside them included)
    decode_s: float  # ubatches of decode rows only
    n_steps: int  # llama batches
    n_ubatches: int
    hits: int
    misses: int
    decode_hits: int  # in the ubatches of decode rows only
    decode_misses: int
    h2d_bytes: int
    stall_s: float  # compute waiting for copies
    host_layers: int  # layers computed wholly on the CPU by the policy
    attention_s: float
    latency_s: float  # mean time from a request's admission to its last token (finished ones)
    busy: dict[str, float]  # critical-path seconds by resource (RESOURCES)
    extra: dict
    # the job with each step's device, CPU and bus time side by side instead of one after
    # another (the busiest of them, the bus busy for every byte it copied, plus the runtime's
    # own steps): what a pipeline of micro-batches over the same cache (MoE-Lightning's
    # CGOPipe) could reach at this plan, copying the same bytes
    overlapped_s: float = 0.0
    # ... and with its ubatches going through each layer before the next (MoE-Lightning's
    # weights paging: CGOPipe's micro-batches), so that one fill of a layer's prompt bank
    # serves every ubatch of a step
    paged_s: float = 0.0

    @property
    def overlapped_tokens_per_s(self) -> float:
        """Generated tokens a second over ``overlapped_s``."""
        return self.generated / self.overlapped_s if self.overlapped_s > 0 else 0.0

    @property
    def paged_tokens_per_s(self) -> float:
        """Generated tokens a second over ``paged_s``."""
        return self.generated / self.paged_s if self.paged_s > 0 else 0.0

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens a second over the job (up to the drain, for a steady replay)."""
        return self.generated / self.job_s if self.job_s > 0 else 0.0

    @property
    def hit_rate(self) -> float:
        return hit_rate(self.hits, self.misses) or 0.0

    @property
    def bound(self) -> str:
        """The resource the job's critical path spends most of its time on."""
        return max(RESOURCES, key=lambda k: self.busy.get(k, 0.0))

    def to_json(self) -> dict:
        out = {k: v for k, v in self.__dict__.items() if k != "extra"}
        out.update(self.extra)
        out.update(tokens_per_s=self.tokens_per_s,
                   overlapped_tokens_per_s=self.overlapped_tokens_per_s,
                   paged_tokens_per_s=self.paged_tokens_per_s, hit_rate=self.hit_rate,
                   decode_hit_rate=hit_rate(self.decode_hits, self.decode_misses) or 0.0,
                   bound=self.bound)
        return out


@dataclass
class _Seq:
    """A request decoding in sequence ``seq`` of a batch job (``batch.decode_many``'s)."""

    req: int
    seq: int
    first_row: int  # of the request's rows in the merged request
    prompt: int
    answer: int
    admitted: float
    fed: int = 0  # prompt rows already in a batch
    out: int = 0  # tokens sampled; the last one is fed in the next batch
    lane: int = 0  # its context: 0 decoding, 1.. the prompts' (micro-batches)


def merge_requests(requests: Sequence[Request]) -> tuple[Request, np.ndarray]:
    """One request whose rows are ``requests``' rows one after the other, and where each
    starts: a ubatch of a batch job takes rows of several requests from it."""
    starts = np.cumsum([0] + [r.n_tokens for r in requests])

    def cat(name: str) -> np.ndarray | None:
        parts = [getattr(r, name) for r in requests]
        return None if any(p is None for p in parts) else np.concatenate(parts)

    merged = Request(experts=np.concatenate([r.experts for r in requests]),
                     token_ids=cat("token_ids"), weights=cat("weights"),
                     gate_input=cat("gate_input"), phase=cat("phase"))
    return merged, starts[:-1]


def simulate_batch(requests: Sequence[Request], shape: ModelShape, profile: Profile,
                   cfg: SimConfig, predictor: Predictor | None = None, *,
                   steady: bool = False, micro: int = 1) -> BatchResult:
    """Replay ``requests`` as one batch job, as ``forecache batch`` decodes it
    (``batch.decode_many``): up to ``cfg.n_seq`` sequences; each step's llama batch holds
    every decoding sequence's next token, then prompt chunks of the sequences still prefilling
    up to ``n_batch`` tokens, each whole ubatches of its prompt or the prompt's rest
    (``roofline.batch.prompt_take``; with ``split="simple"`` the batch is filled to whole
    ubatches instead, up to ``n_batch`` where the decoding rows already take them), handed
    over in sequence-id order (a new request takes the lowest free id), and runs as the
    ubatches llama.cpp splits it into
    (``split_batch`` by ``cfg.split``: ``n_ubatch`` consecutive rows by default); a finished
    sequence frees its slot for the next request, longest first (prompt + answer, ties in
    input order); with ``split="equal"``, once none is left to admit, the highest sequence
    moves into a freed lower id, its KV stream copied (``decode_many``'s ``move_down``). A
    request's prefill rows are its prompt and its decode rows its answer: the last prompt row
    samples the first answer token, each answer token but the last is fed back. Every layer's
    attention, on the device or, with ``cfg.kv_host``, on the CPU: with a KV stream per
    sequence (``split="equal"``) a ubatch reads each of its sequences' KV once (its context so
    far) and computes every row against its own context; with a unified KV cache
    (``"simple"``) every row attends over all the cells in use, as llama.cpp masks the others.
    The policy and predictor see one job, as at run time.
    ``steady``: stop when no request is left to admit and a sequence finishes (the batch would
    drain from there): the throughput of a full batch, without the job's tail.
    ``micro`` > 1 (decode_many's micro-batches): the prompts are fed in ``micro - 1``
    contexts of their own (``prefill_seqs`` of them each; with several, a ubatch each a step)
    and each sequence moves to the decoding context once its first token is sampled (its KV
    copied); a step's ubatches go in rounds, the k-th of each
    context together, the round's second pass reading the first's bank fills. The clock runs
    the passes one after the other (as on a CPU, where both contexts' threads share its
    cores); ``overlapped_s`` takes each round's passes side by side."""
    if not requests:
        raise ValueError("no requests to simulate")
    if not 1 <= micro <= MICRO_MAX:
        raise ValueError(f"micro={micro}: one micro-batch a step, up to {MICRO_MAX}")
    if micro > 1 and cfg.split != "equal":
        raise ValueError("micro-batches run with a KV stream per sequence (split='equal')")
    if cfg.little_k or cfg.spec_draft:
        raise ValueError("a batch replay decodes exactly: no MoBiLE little passes or drafts")
    n_batch = cfg.n_batch if cfg.n_batch is not None else batch_tokens(cfg.n_seq, cfg.n_ubatch)
    n_fill = fill_rows(n_batch, cfg.n_ubatch)
    if cfg.n_seq < 1 or n_batch < cfg.n_seq:
        raise ValueError(f"a batch of {n_batch} tokens cannot hold the next tokens of "
                         f"{cfg.n_seq} sequences")
    prompt, answer = [], []
    for i, r in enumerate(requests):
        phase = r.phase if r.phase is not None else np.ones(r.n_tokens, np.int8)
        p = int((phase == 0).sum())
        if p < 1 or p == r.n_tokens or (phase[:p] != 0).any():
            raise ValueError(f"request {i}: a batch replay needs prompt rows, then answer rows")
        prompt.append(p)
        answer.append(r.n_tokens - p)
    merged, starts = merge_requests(requests)
    sim = Simulator(shape, profile, cfg, logged_layers(requests, shape.layers), predictor)
    # one job for the policy and the predictor, as decode_many runs it
    if sim.policy is not None:
        sim.policy.begin_request()
    if sim.forecaster is not None:
        sim.forecaster.begin_request()
    pending = deque(sorted(range(len(requests)), key=lambda i: -requests[i].n_tokens))
    # each context's free sequence ids: the decoding one's, then the prompts' (micro > 1)
    free = [list(range(cfg.n_seq))] + \
        [list(range(prefill_seqs(cfg.n_seq, micro))) for _ in range(micro - 1)]
    active: list[_Seq] = []
    t0 = sim.t
    latency = 0.0
    generated = finished = prompt_fed = 0
    prefill_s = decode_s = overlapped = paged_total = 0.0
    n_steps = n_ubatches = moves = migrated = 0
    decode_steps = decode_step_ubatches = 0  # steps of decoding rows only, and their ubatches
    # each sequence's KV stream: its share of the context llama.cpp is loaded with
    ctx_per_seq = max(p + a for p, a in zip(prompt, answer, strict=True))
    dec_hits = dec_misses = 0
    kv, d = shape.kv_bytes, shape.d_model

    def spend(dt: float) -> float:
        """The runtime's own ``dt`` seconds between steps (a KV stream copied)."""
        sim.t += dt
        sim.runtime_s += dt
        sim.engine.advance_to(sim.t)
        return dt
    while pending or active:
        while pending and len(active) < cfg.n_seq and any(free[1:] if micro > 1 else free):
            i = pending.popleft()
            k = admit_lane([len(f) for f in free], micro)
            seq = free[k].pop(free[k].index(min(free[k])))  # the lowest free id
            active.append(_Seq(i, seq, int(starts[i]), prompt[i], answer[i], sim.t, lane=k))
        rows: list[int] = []
        ctx: list[int] = []  # each row's context: its sequence's tokens up to it
        seqs: list[int] = []
        lanes: list[int] = []  # each row's context
        sampled: list[int] = []  # batch rows with logits
        done: list[_Seq] = []  # sequences sampled from this batch, in row order
        for s in active:  # each decoding sequence's last sampled token first
            if s.out:
                sampled.append(len(rows))
                done.append(s)
                rows.append(s.first_row + s.prompt + s.out - 1)
                ctx.append(s.prompt + s.out)
                seqs.append(s.seq)
                lanes.append(s.lane)
        n_decode = len(rows)
        # then prompt chunks, while the batch has room, as decode_many fills a batch: with a
        # KV stream per sequence (``equal``) whole ubatches of each prompt (``prompt_take``);
        # in one stream (``simple``) up to whole ubatches of the batch, unless the decoding
        # rows already take them (then up to n_batch)
        room = n_batch if cfg.split == "equal" or len(rows) >= n_fill else n_fill
        for s in active:
            # (micro-batches: a prompts' context's rows counted apart, a batch of its own)
            used = len(rows) if micro == 1 else sum(x == s.lane for x in lanes)
            lane_room = room if micro < 3 else cfg.n_ubatch
            if s.fed < s.prompt and used < lane_room:
                take = min(s.prompt - s.fed, lane_room - used)
                if cfg.split == "equal":
                    take = prompt_take(s.prompt - s.fed, lane_room - used, cfg.n_ubatch)
                rows.extend(range(s.first_row + s.fed, s.first_row + s.fed + take))
                ctx.extend(range(s.fed + 1, s.fed + take + 1))
                seqs.extend([s.seq] * take)
                lanes.extend([s.lane] * take)
                s.fed += take
                prompt_fed += take
                if s.fed == s.prompt:
                    sampled.append(len(rows) - 1)
                    done.append(s)
        n_steps += 1
        logit = np.zeros(len(rows), bool)
        logit[sampled] = True
        decoding = np.arange(len(rows)) < n_decode
        # the rows go to llama.cpp in sequence-id order, as decode_many hands them over (each
        # context's its own batch)
        order = np.lexsort((np.array(seqs), np.array(lanes)))
        rows_a, ctx_a = np.array(rows)[order], np.array(ctx, np.float64)[order]
        seqs_a, logit, decoding = np.array(seqs)[order], logit[order], decoding[order]
        lanes_a = np.array(lanes)[order]
        per_lane = []
        for k in range(len(free)):
            at = np.flatnonzero(lanes_a == k)
            per_lane.append([at[u] for u in split_batch(seqs_a[at].tolist(), cfg.n_ubatch,
                                                        cfg.split)] if at.size else [])
        parts = [u for lane_parts in per_lane for u in lane_parts]
        # rounds: where both contexts have rows, their k-th ubatches together
        rounds = [[lp[k] for lp in per_lane if k < len(lp)]
                  for k in range(max(len(lp) for lp in per_lane))]
        if len([lp for lp in per_lane if lp]) == 1:
            rounds = [[u] for u in parts]  # one context's batch: its ubatches one by one
        if decoding.all():
            decode_steps += 1
            decode_step_ubatches += len(parts)
        before = _busy(sim)
        bytes_before, bus_before = sim.engine.stats["h2d_bytes"], sim.bus_s
        bank_before, bank_most = sim.bank_bytes, 0.0  # the step's fills, its largest ubatch's
        if cfg.split == "simple":
            # a unified KV cache holds every sequence's cells in one stream, and each row
            # attends over all the cells in use, the others masked
            cells = float(ctx_a[np.r_[seqs_a[1:] != seqs_a[:-1], True]].sum())
        micro_bound = 0.0  # micro-batches: the step's rounds, each round's passes side by side
        for members in rounds:
            round_before = _busy(sim)
            round_bytes, round_bus = sim.engine.stats["h2d_bytes"], sim.bus_s
            for j, u in enumerate(members):
                c, q = ctx_a[u], seqs_a[u]
                if cfg.split == "simple":
                    attention = (cells * kv, 4.0 * d * len(u) * cells)
                else:
                    # a sequence's rows are contiguous: its last row in the ubatch has its
                    # longest context, the KV the ubatch reads for it
                    last = np.r_[q[1:] != q[:-1], True]
                    attention = (float(c[last].sum()) * kv, 4.0 * d * float(c.sum()))
                hits, misses, banked = sim.hits, sim.misses, sim.bank_bytes
                sim.keep_fills = j > 0  # the round's first pass's fills serve the others
                t = sim._ubatch(merged, rows_a[u], attention, int(logit[u].sum()))
                sim.keep_fills = False
                bank_most = max(bank_most, sim.bank_bytes - banked)
                n_ubatches += 1
                if decoding[u].all():
                    decode_s += t
                    dec_hits += sim.hits - hits
                    dec_misses += sim.misses - misses
                else:
                    prefill_s += t
            if micro == 1:
                continue  # (a round of one ubatch: the step's bound below stands)
            micro_bound += _side_by_side(sim, round_before, round_bytes, round_bus)[0]
        # the step's ops side by side (micro-batches: its rounds one after another)
        side, step, bus = _side_by_side(sim, before, bytes_before, bus_before)
        overlapped += micro_bound if micro > 1 else side
        # MoE-Lightning's weights paging besides: the step's ubatches go through each layer
        # before the next, so one fill of a layer's bank serves them all (the largest's)
        paged = bus - (sim.bank_bytes - bank_before - bank_most) / \
            (sim.profile.h2d_gbps * sim.n_devices * 1e9)
        paged_total += min(sum(step.values()),
                           max(step["GPU"], step["CPU"], paged) + step["runtime"])
        generated += len(done)
        ended = False
        for s in done:
            s.out += 1
            if s.out >= s.answer:
                active.remove(s)
                free[s.lane].append(s.seq)
                latency += sim.t - s.admitted
                finished += 1
                ended = True
            elif s.lane > 0:
                # its prompt is in: to the decoding context, its KV read out and written in
                # (forecache_seq_move: host memory, or the device's over the bus both ways)
                free[s.lane].append(s.seq)
                s.lane, s.seq = 0, free[0].pop(free[0].index(min(free[0])))
                stream = s.prompt * shape.layers * kv
                spent = spend(2.0 * stream / ((profile.cpu_mem_gbps if cfg.kv_host else
                                               profile.h2d_gbps) * 1e9))
                overlapped += spent
                paged_total += spent
                migrated += 1
        if steady and not pending and ended:
            break
        decoders = [x for x in active if x.lane == 0]
        while (not pending or micro > 1) and cfg.split == "equal" and free[0] and decoders:
            # decode_many's move_down: the highest sequence takes the lowest free id below
            # it, its whole KV stream copied (read and written) where the cache lives (with
            # micro-batches at once: a hole in the decoding ids splits a step's ubatch)
            top = max(decoders, key=lambda x: x.seq)
            low_id = min(free[0])
            if low_id > top.seq:
                break
            free[0].remove(low_id)
            free[0].append(top.seq)
            top.seq = low_id
            stream = 2.0 * ctx_per_seq * shape.layers * kv
            spent = spend(stream / ((profile.cpu_mem_gbps if cfg.kv_host else
                                     profile.gpu_mem_gbps) * 1e9))
            overlapped += spent
            paged_total += spent
            moves += 1
    if sim.forecaster is not None:
        sim.forecaster.end_request()
    job = sim.t - t0
    eng = sim.engine
    busy = _busy(sim)
    busy["GPU"] = max(busy["GPU"] - t0, 0.0)  # the job's, from its first admission
    extra = {k: v for k, v in eng.stats.items() if k != "h2d_bytes"}
    extra.update(layers_simulated=len(sim.layers), stage_slots=sim.n_stage,
                 bank_bytes=int(sim.bank_bytes), banked=sim.banked,
                 decode_gates_in_c=sim.decode_gates, n_batch=n_batch, n_ubatch=cfg.n_ubatch,
                 kv_host=cfg.kv_host, policy=cfg.policy, split=cfg.split, moves=moves,
                 micro=micro, migrated=migrated,
                 decode_steps=decode_steps, decode_step_ubatches=decode_step_ubatches)
    if isinstance(sim.policy, ProMoEPolicy):
        extra.update(prefetch_loads=sim.policy.prefetch_loads,
                     stale_predictions=sim.policy.stale_predictions)
    return BatchResult(
        n_requests=len(requests), n_seq=cfg.n_seq, job_s=job, generated=generated,
        complete=finished == len(requests), prompt_tokens=prompt_fed, prefill_s=prefill_s,
        decode_s=decode_s, n_steps=n_steps,
        n_ubatches=n_ubatches, hits=sim.hits, misses=sim.misses, decode_hits=dec_hits,
        decode_misses=dec_misses, h2d_bytes=int(eng.stats["h2d_bytes"]), stall_s=sim.stall,
        host_layers=sim.host_layers, attention_s=sim.attn_s,
        latency_s=latency / max(finished, 1), busy=busy, extra=extra, overlapped_s=overlapped,
        paged_s=paged_total)


def _side_by_side(sim: Simulator, before: dict[str, float], bytes_before: float,
                  bus_before: float) -> tuple[float, dict[str, float], float]:
    """The replay since ``before`` (``_busy``'s, with the copied bytes and bus time then) with
    the device, CPU and bus time side by side, plus the runtime's own steps; also the time by
    resource and the bus's. The bus is busy for every byte it copies, also where copies ran
    beside the ops (prompt banks' fills, prefetches) and the critical path never waited for
    them; the replay's fills and copies run on clocks of their own and may overrun the ops,
    so the figure is never past the ops one after another."""
    spent = {k: v - before[k] for k, v in _busy(sim).items()}
    bus = (sim.engine.stats["h2d_bytes"] - bytes_before) / \
        (sim.profile.h2d_gbps * sim.n_devices * 1e9) + sim.bus_s - bus_before
    side = min(sum(spent.values()),
               max(spent["GPU"], spent["CPU"], spent["PCIe"], bus) + spent["runtime"])
    return side, spent, bus


def _busy(sim: Simulator) -> dict[str, float]:
    """The simulator's critical-path seconds so far by resource (``RESOURCES``)."""
    out = {"CPU": sim.cpu_s, "PCIe": sim.stall + sim.bus_s, "runtime": sim.runtime_s}
    out["GPU"] = sim.t - sum(out.values())
    return out

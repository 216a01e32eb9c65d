"""Batch jobs: JSONL requests in, JSONL results appended as they finish, several sequences
decoded together in one llama.cpp batch.

A killed job loses nothing: every finished record is one ``write`` to a file opened for
appending, and a rerun skips the ids already in the output. A job that ends with every request
of its input in the output puts the records in the input's order (``rewrite_in_input_order``),
leaving out the error records of lines that have since been fixed.
"""

from __future__ import annotations

import codecs
import ctypes
import json
import os
import re
import stat
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from forecache.errors import setting
from forecache.generate import SamplingParams
from forecache.interrupt import StopFlag
from forecache.jobs.requests import Request
from forecache.llama import Llama, top_probability
from forecache.paths import write_atomic
from forecache.roofline.batch import (
    MICRO_MAX,
    admit_lane,
    prefill_seqs,
    prompt_take,
    split_batch,
)
from forecache.speculative.speculator import Sampler, SelfDraft, verify


class BatchOutputError(ValueError):
    """The output file is not one this job can append to."""


def done_ids(path: Path) -> tuple[set[str], set[str], bool]:
    """Ids already in an output file, those of them whose newest record is an error record, and
    whether a half-written last record was cut off. A complete line that is not a JSON record is
    refused (the file is not touched)."""
    if not path.exists():
        return set(), set(), False
    try:
        data = path.read_bytes()
    except OSError as e:
        raise BatchOutputError(f"cannot read {path} to resume: {e.strerror or e}") from None
    lines = data.split(b"\n")
    tail = lines.pop()  # after the last newline: empty, or a record cut short
    ids: set[str] = set()
    failed: set[str] = set()
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            rid = str(rec["id"])
            ids.add(rid)
            if "error" in rec:
                failed.add(rid)
            else:  # a newer record of the id (a fixed line's) replaces its error
                failed.discard(rid)
        except (ValueError, KeyError, TypeError):
            raise BatchOutputError(f"{path} line {i} is not a forecache batch record; fix or "
                                   f"remove it, or write to another {setting('output')}") \
                from None
    if tail:
        with open(path, "r+b") as f:
            f.truncate(len(data) - len(tail))
    return ids, failed, bool(tail)


class OutputWriter:
    """Appends one record per line: a single write of the whole line, then fsync."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as e:
            raise BatchOutputError(f"cannot write {path}: {e.strerror or e}") from None

    def write(self, record: dict) -> None:
        try:
            line = (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate: JSON's \u escapes carry it
            line = (json.dumps(record) + "\n").encode("ascii")
        view = memoryview(line)
        while view:  # a regular file takes it in one write; a short write is finished here
            view = view[os.write(self._fd, view):]
        os.fsync(self._fd)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


_LINE_ID = re.compile(r"line-([0-9]+)")


def _superseded(rid: str, rec: dict, index: int, last: Mapping[str, int],
                requests_by_line: Mapping[int, str]) -> bool:
    """Whether ``rec`` (the ``index``-th record, of id ``rid``) is the error record of an input
    line (id ``line-N``) that now holds a valid request, whose own newest record (``last``:
    each id's newest index) is another one: the fixed line's result supersedes its error."""
    m = _LINE_ID.fullmatch(rid)
    if m is None or "error" not in rec or rec.get("line", int(m[1])) != int(m[1]):
        return False
    now = requests_by_line.get(int(m[1]))
    return now is not None and now in last and last[now] != index


def rewrite_in_input_order(path: Path, ids: Sequence[str],
                           requests_by_line: Mapping[int, str] | None = None) -> bool:
    """Put the records of the output file ``path`` in the order of ``ids`` (the input's ids, in
    the order of its lines); records of other ids follow them in the order they had. Each record
    keeps its bytes, and the file is replaced atomically (a temp file beside it, fsync, rename),
    so an interruption leaves the old file whole.

    ``requests_by_line`` maps each input line that holds a valid request to its id: the error
    record written for such a line while it was malformed (``line-N``) is left out once the
    request has a record of its own, so the output keeps one record per request.

    Only a complete output is rewritten: with a record of ``ids`` missing, a half-written last
    record or a line that is not a record, the file is left as it is (a rerun resumes it), as it
    is when already in order. Returns whether the file was rewritten."""
    target = path.resolve()  # a symlinked output stays a link to the rewritten file
    try:
        data = target.read_bytes()
    except OSError as e:
        raise BatchOutputError(f"cannot read {path} to put it in input order: "
                               f"{e.strerror or e}") from None
    lines = data.split(b"\n")
    if lines.pop():  # a record cut short: not a complete output
        return False
    rank: dict[str, int] = {}
    for i, rid in enumerate(ids):
        rank.setdefault(rid, i)
    records: list[tuple[str, dict, bytes]] = []
    for line in lines:
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            records.append((str(rec["id"]), rec, line))
        except (ValueError, KeyError, TypeError):
            return False
    if not {rid for rid, _, _ in records}.issuperset(rank):
        return False
    last = {rid: i for i, (rid, _, _) in enumerate(records)}
    keyed = [(rank.get(rid, len(ids)), line) for i, (rid, rec, line) in enumerate(records)
             if not _superseded(rid, rec, i, last, requests_by_line or {})]
    keyed.sort(key=lambda k: k[0])  # stable: other ids (and any repeats) keep their order
    ordered = b"".join(line + b"\n" for _, line in keyed)
    if ordered == data:
        return False
    try:
        write_atomic(target, ordered, mode=stat.S_IMODE(target.stat().st_mode))
    except OSError as e:
        raise BatchOutputError(f"cannot put {path} in input order ({e.strerror or e}); every "
                               "record is in it, in the order they finished") from None
    return True


@dataclass
class _Sequence:
    """A request being decoded in sequence ``seq``."""

    req: Request
    seq: int
    prompt: list[int]
    rng: np.random.Generator
    fed: int = 0  # prompt tokens already in the batch
    out: list[int] = field(default_factory=list)  # the last one is decoded in the next batch
    text: str = ""
    decoder: codecs.IncrementalDecoder = field(
        default_factory=lambda: codecs.getincrementaldecoder("utf-8")(errors="replace"))
    t0: float = field(default_factory=time.perf_counter)
    t_first: float = 0.0
    # some llama.cpp pass held another request's rows too: its logits were computed by kernels
    # for several rows (and its prompt split by theirs), which round them otherwise
    batched: bool = False
    admitted: int = 0  # requests admitted before it (a replayed routing's rows for it)
    lane: _Lane | None = None  # the decode_many lane whose context holds its KV cells


def sampler(sp: SamplingParams) -> Sampler:
    """A request's sampling as llama.cpp's chain (top-k, top-p and min-p at temperature 1, then
    the temperature), as generate and chat sample."""
    greedy = sp.greedy or sp.temperature <= 0
    return Sampler(temp=0.0 if greedy else sp.temperature, top_k=sp.top_k, top_p=sp.top_p,
                   min_p=sp.min_p)


def sample(logits: np.ndarray, sp: SamplingParams, rng: np.random.Generator) -> int:
    """The next token: argmax when greedy, else drawn by llama.cpp's chain (``sampler``)."""
    return sampler(sp).pick(logits, rng)[0]


def _ctx_per_seq() -> str:
    # the context of each sequence: Llama.open's n_ctx, which forecache batch sets per sequence
    return setting("n_ctx", flag="--ctx-per-seq")


def decode_failure(rc: int, n_active: int) -> str:
    """What a non-zero llama_decode status means, and what to do about it."""
    if rc == 1:
        return (f"no room in the KV cache for {n_active} sequences; lower "
                f"{setting('n_parallel')} or raise {_ctx_per_seq()}")
    if rc == 2:
        return (f"llama.cpp aborted the computation (its reason is above; "
                f"{setting('verbose', True)} shows more)")
    return (f"llama_decode failed ({rc}) with {n_active} sequences; rerun with "
            f"{setting('verbose', True)} for llama.cpp's reason")


def prompt_lengths(model: str | os.PathLike[str], requests: Sequence[Request]) -> list[int]:
    """Each request's prompt tokens (its chat template applied), from the model's vocabulary
    alone: what a job's plan is chosen by, before the model is loaded."""
    vocab = Llama(os.fspath(model), cache=None, vocab_only=True, verbose=False)
    try:
        return [len(vocab.tokenize((vocab.format_chat(r.messages) if r.messages is not None
                                    else r.prompt).encode("utf-8"), add_bos=True, special=True))
                for r in requests]
    finally:
        vocab.close()


PACKINGS = ("longest", "input")


def admission_order(requests: Sequence[Request], prompts: Sequence[list[int]],
                    packing: str = "longest") -> list[int]:
    """The indices of ``requests`` in the order they take a free sequence. ``"longest"``: the
    most tokens (prompt + max_tokens) first, ties in input order, so the sequences that take
    longest start first and the job does not end with a few of them decoding alone (the
    longest-processing-time rule for makespan); ``"input"``: the input's order."""
    if packing not in PACKINGS:
        raise ValueError(f"packing={packing!r}: use one of {', '.join(map(repr, PACKINGS))}")
    order = list(range(len(requests)))
    if packing == "longest":
        order.sort(key=lambda i: -(len(prompts[i]) + requests[i].max_tokens))  # stable
    return order


@dataclass
class _Lane:
    """A llama.cpp context a batch job decodes in (the model's own, or a micro-batch's: a
    ``forecache.micro.Sibling``), its free sequence ids and the batch being built for it."""

    ctx: int
    replay: Any  # its trace.replay.RoutingReplay, or None
    free: list[int]
    batch: object  # llama_batch of n_batch rows
    tokens: list[int] = field(default_factory=list)
    entries: list[tuple[int, int, bool]] = field(default_factory=list)  # position, seq, logits
    where: list[int] = field(default_factory=list)  # each row's index in its llama batch
    # a micro-batched step's rows decoded in passes of their own: each logits row read right away
    kept: dict[int, np.ndarray] = field(default_factory=dict)

    def add(self, tok: int, pos: int, seq: int, logits: bool) -> int:
        """Add a row; returns its index."""
        self.tokens.append(tok)
        self.entries.append((pos, seq, logits))
        return len(self.tokens) - 1

    def clear(self) -> None:
        self.tokens.clear()
        self.entries.clear()
        self.kept.clear()

    def order(self) -> list[int]:
        """The rows in the order they go to llama.cpp: by sequence id (with a KV stream per
        sequence it splits a batch into ubatches of sequences whose ids follow each other in
        the batch, split_equal, so rows in any other order would be computed a few at a time)."""
        return sorted(range(len(self.tokens)), key=lambda r: self.entries[r][1])


def decode_many(llm: Llama, requests: list[Request], n_parallel: int,
                on_done: Callable[[dict], None], stop: StopFlag | None = None,
                on_token: Callable[[int], None] | None = None,
                packing: str = "longest", compact: bool = True, micro: int = 1) -> None:
    """Decode ``requests`` with up to ``n_parallel`` sequences in each llama.cpp batch
    (continuous batching: a finished sequence's cells are freed and the next request takes its
    sequence id; new prompts are prefilled in the same batches as the others' next tokens, in
    chunks that fill the batch's ubatches). ``packing`` orders the admissions
    (``admission_order``: ``"longest"`` first, or ``"input"``).
    ``micro`` > 1 splits each step into micro-batches (MoE-Lightning's CGOPipe): the prompts
    are fed in ``micro - 1`` contexts of their own (``forecache.micro.Sibling``s holding
    ``prefill_seqs`` of them each; with one, as many rows a step as the batch holds, with more,
    a ubatch each), and a prompt's sequence moves to the model's context (its KV cells copied)
    once its first token is sampled. A step's first ubatch of each context goes through the
    model with the decoding sequences' ubatch, each on a thread of its own, one fill of each
    layer's prompt bank serving them all (the cache's prompt banks, which it needs); further
    ubatches follow the same way.
    In MoBiLE decoding (``llm.mobile``) the sequences' next tokens first run a little pass of
    their own; those it is unsure of are recomputed with the prompts, by the full model. With a
    self draft (``llm.speculator``) every decoding sequence drafts up to k tokens with little
    passes taken together, and one batch verifies them all, with the prompts.
    Once no request waits (with micro-batches, always: in the decoding context), a sequence
    that finishes hands its id to the sequence with the highest id (``compact``: its KV stream
    is copied down), so that the decoding sequences' ids stay one run and a step stays one
    ubatch as the job drains.
    ``on_done`` gets each record as it finishes (``batched``: a pass also held another request's
    rows, so its logits, though never its draws, depend on which); ``stop`` ends the loop at the
    next step."""
    from llama_cpp import llama_cpp as low

    from forecache.micro import Sibling

    n_batch = llm.n_batch
    n_vocab = llm.n_vocab()
    per_seq = llm.n_ctx() // max(llm.n_seq_max, 1)
    cache = llm.expert_cache
    mobile = llm.mobile if cache is not None else None
    spec = llm.speculator
    if not 1 <= micro <= MICRO_MAX:
        raise ValueError(f"micro={micro}: a step is one micro-batch, or up to {MICRO_MAX} "
                         "(the decoding sequences' and the prompts')")
    if spec is not None and spec.acceptance is not None:
        raise ValueError("an acceptance replay is for single-request benchmarks (forecache "
                         "bench): a batch job verifies its sequences' drafts itself")
    if micro > 1 and (mobile is not None or spec is not None):
        raise ValueError("micro-batches decode exactly: no MoBiLE little passes or drafts")
    if micro > 1 and (cache is None or cache.bank_tokens <= 0):
        raise ValueError("micro-batches share the expert cache's prompt banks, and this "
                         "placement has none (every expert fits, or they are off): drop "
                         "micro from the plan")
    if micro > llm.load_plan.options.micro:
        raise ValueError(f"micro={micro} decodes in {micro} contexts, and the model was loaded "
                         f"for {llm.load_plan.options.micro}: open it with micro={micro}, so "
                         "that its budget pays for the prompts' contexts")
    if n_parallel > llm.n_seq_max:
        raise ValueError(f"{setting('n_parallel', n_parallel)} needs a model loaded with "
                         f"n_seq_max >= {n_parallel}")
    # llama.cpp computes a batch in ubatches of n_ubatch tokens, each pass copying the missing
    # experts it routes; with a KV stream per sequence each prompt's rows make ubatches of
    # their own, so a prompt is fed whole ubatches at a time, not a partial one (prompt_take)
    n_ubatch = max(min(int(low.llama_n_ubatch(llm.ctx)), n_batch), 1)
    # every prompt up front: the admission order depends on their lengths
    prompts = [llm.tokenize((llm.format_chat(req.messages) if req.messages is not None
                             else req.prompt).encode("utf-8"), add_bos=True, special=True)
               for req in requests]
    pending = deque((requests[i], prompts[i]) for i in admission_order(requests, prompts, packing))
    siblings: list[Sibling] = []
    lanes: list[_Lane] = []
    worker = cache.worker if cache is not None else None
    try:
        lanes.append(_Lane(llm.ctx, llm.replay, list(range(n_parallel)),
                           low.llama_batch_init(n_batch, 0, 1)))
        n_prefill = prefill_seqs(n_parallel, micro)
        for _ in range(micro - 1):
            siblings.append(Sibling(llm, n_seq_max=n_prefill))
            lanes.append(_Lane(siblings[-1].ctx, siblings[-1].replay, list(range(n_prefill)),
                               low.llama_batch_init(n_batch, 0, 1)))
        if worker is not None:
            worker.begin_request()
        _decode_lanes(llm, lanes, requests, pending, on_done, stop, on_token, compact,
                      n_parallel, n_ubatch, n_vocab, per_seq)
    finally:
        for lane in lanes:
            low.llama_batch_free(lane.batch)
        for sib in siblings:
            sib.close()
        if worker is not None:
            worker.end_request()


def _decode_lanes(llm: Llama, lanes: list[_Lane], requests: list[Request],
                  pending: deque[tuple[Request, list[int]]], on_done: Callable[[dict], None],
                  stop: StopFlag | None, on_token: Callable[[int], None] | None, compact: bool,
                  n_parallel: int, n_ubatch: int, n_vocab: int, per_seq: int) -> None:
    """decode_many's loop over its lanes (one: the model's own context)."""
    from llama_cpp import llama_cpp as low

    from forecache.micro import run_round

    n_batch = llm.n_batch
    cache = llm.expert_cache
    mobile = llm.mobile if cache is not None else None
    spec = llm.speculator
    main = lanes[0]
    active: list[_Sequence] = []

    def mem(lane: _Lane) -> int:
        return low.llama_get_memory(lane.ctx)

    def finish(s: _Sequence, reason: str) -> None:
        lane = s.lane
        active.remove(s)
        low.llama_memory_seq_rm(mem(lane), s.seq, -1, -1)
        lane.free.append(s.seq)
        text = s.text + s.decoder.decode(b"", final=True)
        if reason == "stop" and s.req.stop:
            cut = [text.find(x) for x in s.req.stop if x in text]
            text = text[:min(cut)] if cut else text
        t_end = time.perf_counter()
        decode_s = t_end - s.t_first
        on_done({"id": s.req.id, "text": text, "tokens": len(s.out),
                 "prompt_tokens": len(s.prompt), "finish_reason": reason, "batched": s.batched,
                 "timings": {"ttft_s": round(s.t_first - s.t0, 6),
                             "total_s": round(t_end - s.t0, 6),
                             "tokens_per_s": round((len(s.out) - 1) / decode_s, 3)
                             if len(s.out) > 1 and decode_s > 0 else None}})

    if spec is not None and not isinstance(spec.draft, SelfDraft):
        raise ValueError(f"{setting('draft')} {spec.draft.kind}: a batch job drafts with the "
                         "model's own little pass only (self-little or self-cached)")

    def move_down(lane: _Lane) -> None:
        """Move the lane's highest sequences into its lowest free ids below them (exact: the KV
        stream's bytes are copied by llama.cpp before the next pass)."""
        mine = [s for s in active if s.lane is lane]
        while lane.free and mine:
            low_id = min(lane.free)
            top = max(mine, key=lambda x: x.seq)
            if low_id > top.seq:
                return
            low.llama_memory_seq_cp(mem(lane), top.seq, low_id, -1, -1)
            low.llama_memory_seq_rm(mem(lane), top.seq, -1, -1)
            lane.free.remove(low_id)
            lane.free.append(top.seq)
            top.seq = low_id

    def migrate(s: _Sequence) -> None:
        """Move a sequence whose prompt is in from the prefill lane to the decoding lane: its KV
        cells copied (exact), its id the decoding lane's lowest free one."""
        from forecache.native import api

        src = s.lane
        seq = main.free.pop(main.free.index(min(main.free)))
        err = ctypes.create_string_buffer(256)
        if api().seq_move(src.ctx, s.seq, main.ctx, seq, err, len(err)) != 0:
            raise RuntimeError(f"cannot move request {s.req.id}'s KV cells to the decoding "
                               f"context: {err.value.decode()}; run the job without micro")
        low.llama_memory_seq_rm(mem(src), s.seq, -1, -1)
        src.free.append(s.seq)
        s.seq = seq
        s.lane = main

    def row_logits(lane: _Lane, row: int) -> np.ndarray:
        if row in lane.kept:
            return lane.kept[row]
        return np.ctypeslib.as_array(low.llama_get_logits_ith(lane.ctx, lane.where[row]),
                                     shape=(n_vocab,))

    def pass_of(lane: _Lane, rows: Sequence[int]) -> int:
        """Decode ``rows`` of the lane's batch (in sequence-id order) as one llama batch."""
        batch = lane.batch
        for i, r in enumerate(rows):
            pos, seq, logits = lane.entries[r]
            lane.where[r] = i
            batch.token[i] = lane.tokens[r]  # type: ignore[attr-defined]
            batch.pos[i] = pos  # type: ignore[attr-defined]
            batch.n_seq_id[i] = 1  # type: ignore[attr-defined]
            batch.seq_id[i][0] = seq  # type: ignore[attr-defined]
            batch.logits[i] = logits  # type: ignore[attr-defined]
        batch.n_tokens = len(rows)  # type: ignore[attr-defined]
        if cache is not None and lane is main:
            cache.begin_ubatch(np.asarray([lane.tokens[r] for r in rows], dtype=np.int32))
        if lane.replay is not None:
            by_seq = {s.seq: s for s in active if s.lane is lane}
            picks, seqs, poss = [], [], []
            for r in rows:
                pos, seq, _ = lane.entries[r]
                s = by_seq[seq]
                decoding = pos >= len(s.prompt)
                picks.append(lane.replay.pick(s.admitted, decoding,
                                              pos - len(s.prompt) if decoding else pos))
                seqs.append(seq)
                poss.append(pos)
            lane.replay.before_rows(seqs, poss, picks)
        return int(low.llama_decode(lane.ctx, batch))

    def mark_batched(lane: _Lane) -> None:
        seqs = {seq for _, seq, _ in lane.entries}
        if len(seqs) > 1:
            for s in active:
                if s.lane is lane:
                    s.batched = s.batched or s.seq in seqs

    def decode() -> None:
        """Decode the lanes' batches: one llama batch where one lane has rows; where both do,
        their ubatches in rounds (the k-th of each lane together, each on a thread of its own),
        each logits row read at once."""
        busy = [lane for lane in lanes if lane.tokens]
        for lane in busy:
            mark_batched(lane)
            lane.where[:] = [0] * len(lane.tokens)
        if len(busy) == 1:  # one llama batch, which llama.cpp splits into ubatches itself
            try:
                rc = pass_of(busy[0], busy[0].order())
            finally:
                if len(lanes) > 1 and cache is not None:
                    cache.end_pass(busy[0].ctx)  # the other lane's passes may go on
            if rc != 0:
                raise RuntimeError(decode_failure(rc, len(active)))
        else:
            parts = {id(lane): _ubatches(lane, n_ubatch) for lane in busy}
            for k in range(max(len(p) for p in parts.values())):
                jobs = []
                for lane in busy:
                    if k < len(parts[id(lane)]):
                        rows = parts[id(lane)][k]
                        jobs.append((lane.ctx, _keep_job(lane, rows, pass_of, row_logits)))
                for rc in run_round(cache, jobs):
                    if rc != 0:
                        raise RuntimeError(decode_failure(rc, len(active)))
        for lane in busy:
            if lane.replay is not None:
                lane.replay.check()

    def little_pass(rows: list[tuple[_Sequence, int]], sampled: list[tuple[_Sequence, int]]
                    ) -> list[tuple[_Sequence, int]]:
        """Decode the batch's next tokens (``rows``, the whole batch so far) with the little
        pass; sample those it is sure of into ``sampled``, drop the others' KV cells and put
        them back into the batch for the full model, their experts prefetched. Returns their
        rows."""
        assert mobile is not None and cache is not None
        m, gamma, resident = mobile
        cache.set_little(m, resident)
        try:
            decode()
        finally:
            cache.set_little(0)
        unsure = []
        for s, row in rows:
            logits = row_logits(main, row)
            if top_probability(logits) >= gamma:
                sampled.append((s, sample(logits, s.req.sampling, s.rng)))
            else:
                unsure.append((s, row))
        llm.mobile_passes[0] += len(rows)
        llm.mobile_passes[1] += len(unsure)
        if unsure:
            llm.mobile_passes[2] += cache.prefetch_little(llm.model_file.n_expert_used)
        main.clear()
        again = []
        for s, _ in unsure:
            pos = len(s.prompt) + len(s.out) - 1
            low.llama_memory_seq_rm(mem(main), s.seq, pos, -1)  # the full model's KV replaces it
            again.append((s, main.add(s.out[-1], pos, s.seq, True)))
        return again

    def speculate(rows: list[tuple[_Sequence, int]]) -> list[tuple[_Sequence, int, list, list]]:
        """Draft for the decoding sequences (``rows``, the whole batch so far) with little passes
        taken together, drop the drafts' KV cells and put each sequence's token and drafts back
        into the batch for verification: per sequence, its first row, drafts and their
        distributions (none when no sequence has room to draft: the batch is left as it was)."""
        assert spec is not None and cache is not None
        draft = spec.draft
        assert isinstance(draft, SelfDraft)
        k = min(spec.length.k, n_batch // len(rows) - 1)
        # per sequence: position of its next token, drafts it may make, drafts, distributions
        plan = []
        for s, _ in rows:
            pos = len(s.prompt) + len(s.out) - 1
            plan.append((s, pos, max(min(k, s.req.max_tokens - len(s.out), per_seq - pos - 1), 0),
                         [], []))
        most = max(p[2] for p in plan)
        if most < 1:
            return []
        cache.set_little(draft.m, draft.resident)
        try:
            for r in range(most):
                main.clear()
                round_rows = []
                for s, pos, n, drafts, qs in plan:
                    if n > r:
                        round_rows.append((s, main.add(drafts[-1] if drafts else s.out[-1],
                                                       pos + r, s.seq, True), drafts, qs))
                decode()
                for s, row, drafts, qs in round_rows:
                    t, q = sampler(s.req.sampling).pick(row_logits(main, row), s.rng,
                                                        s.out + drafts)
                    drafts.append(t)
                    qs.append(q)
        finally:
            cache.set_little(0)
        for s, pos, *_ in plan:
            low.llama_memory_seq_rm(mem(main), s.seq, pos, -1)
        cache.prefetch_little(llm.model_file.n_expert_used)
        main.clear()
        checks = []
        for s, pos, _, drafts, qs in plan:
            checks.append((s, len(main.tokens), drafts, qs))
            for i, t in enumerate([s.out[-1], *drafts]):
                main.add(t, pos + i, s.seq, True)
        return checks

    def check(s: _Sequence, row: int, drafts: list[int], qs: list,
              sampled: list[tuple[_Sequence, int]]) -> int:
        """Verify one sequence's drafts: its accepted tokens and the model's next one go to
        ``sampled``; the rejected drafts' KV cells are dropped. Returns the drafts accepted."""
        assert spec is not None
        logits = np.stack([row_logits(main, row + i) for i in range(len(drafts) + 1)])
        accepted, new = verify(logits, drafts, qs, sampler(s.req.sampling), s.rng, s.out)
        low.llama_memory_seq_rm(mem(main), s.seq, len(s.prompt) + len(s.out) + len(accepted), -1)
        spec.stats.add(len(drafts), len(accepted))
        sampled.extend((s, t) for t in [*accepted, new])
        return len(accepted)

    admitted = 0  # requests admitted so far
    try:
        while (pending or active) and not stop:
            # admit the next requests: into a prefill lane when there are some, as many as
            # the decoding lane can take once their prompts are in
            prefills = lanes[1:] or lanes
            while pending and len(active) < n_parallel and any(x.free for x in prefills):
                req, prompt = pending.popleft()
                if len(prompt) + req.max_tokens > per_seq:
                    on_done({"id": req.id, "line": req.line,
                             "error": f"prompt ({len(prompt)} tokens) + max_tokens "
                                      f"({req.max_tokens}) exceed the context of {per_seq} per "
                                      f"sequence; raise {_ctx_per_seq()} or lower "
                                      "max_tokens"})
                    continue
                # the lowest free id: the decoding sequences' ids stay close together
                lane = lanes[admit_lane([len(x.free) for x in lanes], len(lanes))]
                seq = lane.free.pop(lane.free.index(min(lane.free)))
                active.append(_Sequence(req, seq, prompt, np.random.default_rng(req.seed),
                                        admitted=admitted, lane=lane))
                admitted += 1
            if not active:
                continue
            for lane in lanes:
                lane.clear()
            rows: list[tuple[_Sequence, _Lane, int]] = []  # sampled from this batch's rows
            sampled: list[tuple[_Sequence, int]] = []  # and the tokens sampled for them
            for s in active:  # each decoding sequence's last sampled token first
                if s.out:
                    lane = s.lane
                    rows.append((s, lane, lane.add(s.out[-1], len(s.prompt) + len(s.out) - 1,
                                                   s.seq, True)))
            checks: list[tuple[_Sequence, int, list, list]] = []
            if mobile is not None and rows:
                rows = [(s, main, r) for s, r in little_pass([(s, r) for s, _, r in rows],
                                                              sampled)]
            elif spec is not None and rows:
                checks = speculate([(s, r) for s, _, r in rows])
                if checks:
                    rows = []
            # then prompt chunks, while the batch (a prefill lane's, where there are some) has
            # room: with several prefill lanes a ubatch each, one round's worth
            room = n_batch if len(lanes) <= 2 else n_ubatch
            for s in active:
                lane = s.lane
                if s.fed < len(s.prompt) and len(lane.tokens) < room:
                    take = prompt_take(len(s.prompt) - s.fed, room - len(lane.tokens),
                                       n_ubatch)
                    for j in range(s.fed, s.fed + take):
                        last = j == len(s.prompt) - 1
                        row = lane.add(s.prompt[j], j, s.seq, last)
                        if last:
                            rows.append((s, lane, row))
                    s.fed += take
            if any(lane.tokens for lane in lanes):
                decode()
                for s, lane, row in rows:
                    sampled.append((s, sample(row_logits(lane, row), s.req.sampling, s.rng)))
                taken = sum(check(s, row, drafts, qs, sampled) for s, row, drafts, qs in checks)
                if checks and spec is not None:
                    spec.length.update(taken, sum(len(c[2]) for c in checks))
            if on_token is not None:
                on_token(len(sampled))
            for s, tok in sampled:
                if s not in active:  # finished by an earlier token of this step
                    continue
                if not s.out:
                    s.t_first = time.perf_counter()
                if llm.is_eog(tok):
                    finish(s, "stop")
                    continue
                s.out.append(tok)
                s.text += s.decoder.decode(llm.detokenize([tok],
                                                          prev_tokens=s.prompt + s.out[:-1]))
                if s.req.stop and any(x in s.text for x in s.req.stop):
                    finish(s, "stop")
                elif len(s.out) >= s.req.max_tokens:
                    finish(s, "length")
                elif s.lane is not main:
                    migrate(s)
            if compact and not pending:
                for lane in lanes:
                    move_down(lane)
            elif compact and len(lanes) > 1:
                # micro-batches: a sequence that finished leaves a hole in the decoding ids
                # until a prompt's sequence moves in, and a hole splits the step into ubatches,
                # each a pass (and a bank fill); a KV stream copied costs far less
                move_down(main)
    finally:
        for s in list(active):  # interrupted: free their cells; nothing is written for them
            low.llama_memory_seq_rm(mem(s.lane), s.seq, -1, -1)


def _ubatches(lane: _Lane, n_ubatch: int) -> list[list[int]]:
    """The ubatches llama.cpp makes of the lane's batch (``split_batch``, a KV stream per
    sequence): row indices of the lane's batch, each one llama batch of its own."""
    order = lane.order()
    seqs = [lane.entries[r][1] for r in order]
    return [[order[i] for i in part] for part in split_batch(seqs, n_ubatch, "equal")]


def _keep_job(lane: _Lane, rows: list[int], pass_of: Callable[[_Lane, Sequence[int]], int],
              row_logits: Callable[[_Lane, int], np.ndarray]) -> Callable[[], int]:
    """A round's job: decode ``rows`` of the lane as one pass, then keep their logits rows (the
    lane's next pass overwrites llama.cpp's)."""

    def job() -> int:
        rc = pass_of(lane, rows)
        if rc == 0:
            for r in rows:
                if lane.entries[r][2]:
                    lane.kept[r] = row_logits(lane, r).copy()
        return rc

    return job

"""Recording routing traces: run prompts through a model and keep what every MoE layer routed.

The experts stay in host memory and every layer is computed there (the host-only policy), so the
gate hook sees each layer's routed ids, router weights and, when asked, its router input; the
tokens generated are the same as without the hook.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from forecache.cache.choice import locality
from forecache.cache.measured import add_localities
from forecache.generate import SamplingParams, context_advice, generate, text_tokens
from forecache.gguf.header import ModelFile
from forecache.gguf.identity import identity
from forecache.interrupt import Terminated, deferred_signals
from forecache.jobs.requests import Request, read_requests
from forecache.placement.build import attach_observer
from forecache.placement.options import CacheConfig
from forecache.trace.format import TraceError, TraceFile, TraceWriter
from forecache.trace.stats import lru_hit_curves

if TYPE_CHECKING:
    from forecache.llama import Llama

BUILTIN_PROMPTS = ("default",)


def builtin_prompts_path(name: str) -> Path:
    """The JSONL file of a builtin prompt set."""
    if name not in BUILTIN_PROMPTS:
        raise ValueError(f"unknown builtin prompt set {name!r}; choose one of "
                         f"{', '.join(BUILTIN_PROMPTS)}")
    return Path(str(resources.files("forecache") / "data" / "prompts" / f"{name}.jsonl"))


def load_prompts(path: str | os.PathLike[str]) -> list[Request]:
    """Read a prompts JSONL file with the rules of ``forecache batch`` input
    (``forecache.jobs.requests``); its sampling fields are ignored, tracing is greedy. Every line is
    checked before any work starts: the first bad line refuses the file, with its number."""
    p = Path(path)
    items, errors = read_requests(p)
    if errors:
        raise ValueError(f"{p}:{errors[0]['line']}: {errors[0]['error']}")
    if not items:
        raise ValueError(f"{p}: no prompts in the file")
    return items


@dataclass
class TraceSummary:
    """What a trace run recorded."""

    path: Path
    requests: int
    tokens: int
    prefill_tokens: int
    decode_tokens: int
    seconds: float
    interrupted: bool
    outputs: list[list[int]]
    signum: int | None = None  # the signal that interrupted it


class RouteRecorder:
    """Collects one request's hook calls, per MoE layer in call order."""

    def __init__(self, layer_index: dict[int, int], gate_input: bool) -> None:
        self.layer_index = layer_index
        self.gate_input = gate_input
        self.reset()

    def reset(self) -> None:
        n = len(self.layer_index)
        self.ids: list[list[np.ndarray]] = [[] for _ in range(n)]
        self.weights: list[list[np.ndarray]] = [[] for _ in range(n)]
        self.x: list[list[np.ndarray]] = [[] for _ in range(n)]

    def __call__(self, layer: int, ids: np.ndarray, w: np.ndarray | None,
                 x: np.ndarray | None) -> None:
        li = self.layer_index[layer]
        self.ids[li].append(ids.astype(np.int16))
        self.weights[li].append(w.astype(np.float16) if w is not None
                                else np.zeros(ids.shape, np.float16))
        if self.gate_input:
            if x is None:
                raise RuntimeError("the gate hook gave no gate input")
            self.x[li].append(x.astype(np.float16))

    def request_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """experts [T, L, k], weights [T, L, k], gate_input [T, L, d] of the finished request."""
        rows = {sum(len(a) for a in per) for per in self.ids}
        if len(rows) != 1:
            raise RuntimeError(f"MoE layers saw different token counts {sorted(rows)}")
        experts = np.stack([np.concatenate(per) for per in self.ids], axis=1)
        weights = np.stack([np.concatenate(per) for per in self.weights], axis=1)
        x = np.stack([np.concatenate(per) for per in self.x], axis=1) if self.gate_input else None
        return experts, weights, x


def record_trace(model_path: str | os.PathLike[str], prompts: list[Request],
                 out: str | os.PathLike[str], *, n_gen: int = 64, gate_input: bool = False,
                 chat: bool = True, n_ctx: int = 4096, n_batch: int = 512,
                 source: str = "", progress: Callable[[int, int, int], None] | None = None,
                 ) -> TraceSummary:
    """Run every prompt (prefill, then up to ``n_gen`` greedy tokens) and write the trace.

    ``chat`` wraps plain prompts as a user message in the model's chat template (when it has
    one). Ctrl-C keeps the requests finished so far as a valid, shorter trace.
    """
    from forecache.llama import Llama

    t0 = time.perf_counter()
    llm = Llama.open(model_path, cache=CacheConfig(policy="offload"), n_ctx=n_ctx,
                     n_batch=n_batch)
    try:
        model = llm.model_file
        layers = model.moe_layers()
        rec = RouteRecorder({il: i for i, il in enumerate(layers)}, gate_input)
        assert llm.placement is not None
        hook = attach_observer(llm.ctx, model, llm.placement.device.index, rec,
                               gate_input=gate_input)
        has_template = bool(llm.metadata.get("tokenizer.chat_template"))
        n_ctx_loaded = llm.n_ctx()
        n_embd = int(model.arch_kv("embedding_length", 0))
        meta: dict[str, Any] = {**identity(model), "source": source, "n_gen": n_gen,
                                "chat_template": chat and has_template}
        writer = TraceWriter(out, n_layers=len(layers), top_k=model.n_expert_used,
                             n_embd=n_embd if gate_input else None, meta=meta)
        writer.keep_partial = True
        outputs: list[list[int]] = []
        prefill = decode = 0
        interrupted = False
        signum: int | None = None
        try:
            # Ctrl-C/SIGTERM set a flag checked between tokens: raised inside the gate hook they
            # would be lost in the C frame
            with writer, deferred_signals() as stop:
                for i, item in enumerate(prompts):
                    text = _render(llm, item, chat and has_template)
                    tokens = text_tokens(llm, text)
                    if len(tokens) >= n_ctx_loaded:
                        raise ValueError(f"prompt {item.id} has {len(tokens)} tokens, too many "
                                         f"for the context of {n_ctx_loaded}; "
                                         f"{context_advice(llm, len(tokens), 1)}")
                    budget = min(n_gen, n_ctx_loaded - len(tokens))
                    rec.reset()
                    llm.reset()  # no KV prefix reuse: every prompt token is routed
                    with all_rows_computed(llm):
                        res = generate(llm, tokens, budget, SamplingParams(greedy=True),
                                       stop=stop)
                    if stop:  # the request cut short is not recorded
                        interrupted, signum = True, stop.signum
                        break
                    experts, weights, x = rec.request_arrays()
                    fed = (tokens + res.tokens)[:experts.shape[0]]
                    if experts.shape[0] not in (len(tokens) + len(res.tokens) - 1,
                                                len(tokens) + len(res.tokens)):
                        raise RuntimeError(f"request {item.id}: {experts.shape[0]} routed rows "
                                           f"for {len(tokens)} prompt and {len(res.tokens)} "
                                           "generated tokens")
                    phase = (np.arange(len(fed)) >= len(tokens)).astype(np.int8)
                    writer.add_request(experts, token_ids=np.asarray(fed), phase=phase,
                                       weights=weights, gate_input=x)
                    outputs.append(res.tokens)
                    prefill += len(tokens)
                    decode += len(fed) - len(tokens)
                    if progress:
                        progress(i + 1, len(prompts), writer.n_rows)
                    hook.check_interrupt()
        except KeyboardInterrupt:
            interrupted = True
        finally:
            hook.close()
        if not interrupted and writer.n_requests == 0:
            raise TraceError("no request was recorded")
    finally:
        llm.close()
    if interrupted and not outputs:
        raise Terminated if signum == signal.SIGTERM else KeyboardInterrupt
    keep_routing(out, model)
    return TraceSummary(Path(out), len(outputs), prefill + decode, prefill, decode,
                        time.perf_counter() - t0, interrupted, outputs,
                        signum or (signal.SIGINT if interrupted else None))


@contextlib.contextmanager
def all_rows_computed(llm: Llama) -> Iterator[None]:
    """While active, llama.cpp computes an output at every token of a batch: otherwise the last
    layer computes only the rows whose logits are used and routes no other token. No extra
    logits are kept, and sampling still reads the last row."""
    llm.output_all_rows = True
    try:
        yield
    finally:
        llm.output_all_rows = False


def _render(llm: Llama, item: Request, chat: bool) -> str:
    if item.messages is not None:
        return llm.format_chat(item.messages)
    assert item.prompt is not None
    if chat:
        return llm.format_chat([{"role": "user", "content": item.prompt}])
    return item.prompt


def keep_routing(trace_path: str | os.PathLike[str], model: ModelFile) -> None:
    """Keep the decode routing locality of a trace of ``model`` for its default placement
    (``cache.measured``): an LRU replay at every tenth of the experts."""
    with TraceFile(trace_path) as tf:
        reqs = list(tf.requests())
    decode = [None if r.phase is None else r.phase == 1 for r in reqs]
    known = sum(int(((r.experts if d is None else r.experts[d]) >= 0).sum())
                for r, d in zip(reqs, decode, strict=True))  # decode lookups
    if not known:
        return
    curves = lru_hit_curves([r.experts for r in reqs], model.n_expert, decode)
    points = []
    for tenth in range(1, 10):
        n = max(1, round(model.n_expert * tenth / 10))
        share = n / model.n_expert
        points.append((share, locality(float(curves[:, n].sum()) / known, share), known))
    add_localities(model, points, "trace")

"""Micro-batches over one expert cache (MoE-Lightning's CGOPipe): more llama.cpp contexts over the
loaded model, each with its own KV cache and threads, whose long ubatches read the cache's prompt
banks. A round (``run_round``) decodes one batch in each context, each on a thread of its own, and
the passes go through each bank layer together: one fill of a layer's bank serves them all, and one
context's attention and host work run while another's experts compute. A batch job
(``batch.decode_many``'s ``micro``) feeds its prompts in contexts of their own and decodes in
the model's."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from forecache.cache.runtime import ExpertCache
from forecache.llama import Llama


class Sibling:
    """Another context over ``llm``'s model, with the same parameters (its own KV cache and
    threads; ``n_seq_max``: room for that many sequences of ``llm``'s context each), attached to
    ``llm``'s expert cache; with ``llm``'s routing replay, its own replay of the same routing.
    ``close`` frees it (before ``llm``)."""

    def __init__(self, llm: Llama, n_seq_max: int | None = None) -> None:
        from llama_cpp import llama_cpp as low

        cache = llm.expert_cache
        if cache is None or cache.bank_tokens <= 0:
            raise ValueError("micro-batches read the expert cache's prompt banks: load the model "
                             "with a cache whose prompt banks are on (prompt_bank=True)")
        self._low = low
        self.cache: ExpertCache | None = cache
        params = type(llm.context_params).from_buffer_copy(llm.context_params)
        if n_seq_max is not None:  # as many sequences of the same context each
            params.n_ctx = llm.n_ctx() // max(llm.n_seq_max, 1) * n_seq_max
            params.n_seq_max = n_seq_max
        self.ctx: int | None = low.llama_init_from_model(llm.model, params)
        if not self.ctx:
            self.ctx = None
            raise MemoryError("cannot create another llama.cpp context for a micro-batch: lower "
                              "the context size or the number of micro-batches")
        self.replay = None
        try:
            cache.attach(self.ctx)
            if llm.replay is not None:
                self.replay = llm.replay.sibling(self.ctx)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Close its replay, take the cache off it and free it."""
        if self.replay is not None:
            self.replay.close()
            self.replay = None
        if self.ctx is not None:
            if self.cache is not None:
                self.cache.detach(self.ctx)
                self.cache = None
            self._low.llama_free(self.ctx)
            self.ctx = None

    def __enter__(self) -> Sibling:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def run_round(cache: ExpertCache, jobs: Sequence[tuple[int, Callable[[], int]]]) -> list[int]:
    """Run ``jobs`` (a context, and a function that decodes one batch in it and returns
    llama_decode's status) as one round: each on a thread of its own (the first on the calling
    thread), their passes sharing each bank fill. Returns the statuses in order; an exception in
    a job is raised once every job has ended."""
    if len(jobs) == 1:
        ctx, job = jobs[0]
        try:
            return [job()]
        finally:
            cache.end_pass(ctx)
    cache.begin_round(len(jobs))
    rcs: list[int] = [0] * len(jobs)
    errors: list[BaseException] = []

    def one(i: int) -> None:
        ctx, job = jobs[i]
        try:
            rcs[i] = job()
        except BaseException as e:  # noqa: BLE001 - raised on the calling thread
            errors.append(e)
        finally:
            cache.end_pass(ctx)  # also when it failed: the round's other passes go on

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(1, len(jobs))]
    for t in threads:
        t.start()
    one(0)
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return rcs

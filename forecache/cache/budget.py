"""Device memory budgets: parsing sizes and turning a budget into expert slots or ncmoe layers."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from forecache.errors import setting
from forecache.gguf.base import is_expert_tensor
from forecache.gguf.header import ModelFile

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40,
          "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40,
          "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
# Compute buffers beyond the logits and expert activations (attention scratch, graph bookkeeping).
COMPUTE_RESERVE = 256 << 20
# a draft model's context's largest ubatch (``draft_ubatch``), and a dense draft's compute
# buffers beyond its rows (``dense_compute_bytes``)
DRAFT_UBATCH = 64
DRAFT_RESERVE = 4 << 20


class BudgetError(ValueError):
    """A budget that cannot run the model; the message states what is needed."""


def parse_size(text: str) -> int:
    """Bytes in a size such as ``24GiB``, ``24G`` (binary), ``24GB`` (decimal) or ``1e9``."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", text)
    unit = m.group(2).upper() if m else None
    if m is None or unit not in _UNITS:
        raise ValueError(f"cannot read size {text!r}: use a number with an optional unit, "
                         "e.g. 24GiB, 512MiB or 24GB")
    return int(float(m.group(1)) * _UNITS[unit])


def format_size(n: float) -> str:
    """Bytes as GiB or MiB with one decimal."""
    return f"{n / (1 << 30):.1f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"


# a device's prompt banks (forecache_cache_set_bank): two regions of a layer's experts
BANK_REGIONS = 2
# the most of the expert budget the prompt banks may take by default (their memory is the slots')
BANK_SHARE_MAX = 0.25


def bank_size(n_expert: int, slots: Iterable[int]) -> int:
    """The experts' worth of device memory prompt banks take beside ``slots`` (each cached
    layer's): two regions of as many experts as the layer with the fewest slots lacks."""
    cached = [n for n in slots if n > 0]
    return BANK_REGIONS * max(n_expert - min(cached), 0) if cached else 0


def settle_bank(n_expert: int, slots_after: Callable[[int], Iterable[int]]) -> int:
    """The experts' worth held back for prompt banks when holding ``h`` leaves the cached
    layers ``slots_after(h)``: their size depends on the slots they leave (more held, fewer
    slots, larger banks), so hold until the banks fit."""
    held = 0
    for _ in range(16):
        need = bank_size(n_expert, slots_after(held))
        if need <= held:
            break
        held = need
    return held


# prompts a batch job's prefill contexts hold at once (micro-batches: decode_many's micro):
# two with one prompt context, one each with more. Each prompt in a context is a ubatch of its
# own (a KV stream each), and every ubatch past a context's first in a step leads a round of
# its own, paying a bank fill; a job admits about a prompt a step as its sequences finish, so
# more room only splits steps (the replay at the target, BENCHMARKS.md: 2 against 3 and 8)
PREFILL_SEQS = 2
# contexts a batch job's step may take: the decoding one and up to MICRO_MAX - 1 for prompts
MICRO_MAX = 4


def prefill_seqs(n_seq: int, micro: int) -> int:
    """Sequences each of a job's ``micro - 1`` prefill contexts holds."""
    return max(1, min(n_seq, PREFILL_SEQS) // max(micro - 1, 1))


@dataclass(frozen=True)
class BudgetSplit:
    """Where a budget goes: fixed needs, then expert slots (or whole expert layers for ncmoe)."""

    budget: int
    non_expert_bytes: int
    kv_bytes: int
    compute_bytes: int
    layer_bytes: tuple[int, ...]  # one expert of each MoE layer, all projections
    n_expert: int
    moe_layers: list[int]
    draft_bytes: int = 0  # a draft model's context on the same device (``draft_device_bytes``)

    @property
    def fixed_bytes(self) -> int:
        return self.non_expert_bytes + self.kv_bytes + self.compute_bytes + self.draft_bytes

    @property
    def expert_budget(self) -> int:
        return self.budget - self.fixed_bytes

    @property
    def largest_expert_bytes(self) -> int:
        """The largest expert of any MoE layer (a stage slot holds any layer's)."""
        return max(self.layer_bytes)

    def slots_per_layer(self, held: int = 0) -> list[int]:
        """Slots for each layer (indexed by layer), the expert budget less ``held`` of the largest
        experts (stage slots): the same count in every MoE layer, then one more in the first
        layers while it fits (layers whose experts have more bits take more of the budget)."""
        left = max(self.expert_budget - held * self.largest_expert_bytes, 0)
        base = min(self.n_expert, left // sum(self.layer_bytes))
        left -= base * sum(self.layer_bytes)
        out = [0] * (max(self.moe_layers) + 1)
        for il, nbytes in zip(self.moe_layers, self.layer_bytes, strict=True):
            extra = base < self.n_expert and left >= nbytes
            left -= nbytes if extra else 0
            out[il] = base + extra
        return out

    def bank_held(self) -> int:
        """The experts' worth (counted as the largest) prompt banks hold back (``settle_bank``)."""
        return settle_bank(self.n_expert, lambda h: [self.slots_per_layer(held=h)[il]
                                                     for il in self.moe_layers])

    def ncmoe_budget(self, host_layers: int) -> int:
        """The budget whose ``--n-cpu-moe`` placement keeps the first ``host_layers`` MoE layers'
        experts on the host and the others' on the device."""
        return self.fixed_bytes + self.n_expert * sum(self.layer_bytes[host_layers:])

    def ncmoe_cpu_layers(self) -> int:
        """``--n-cpu-moe`` N: the first N MoE layers keep their experts on the host, the fewest
        that leave the other layers' experts within the budget."""
        for n in range(len(self.moe_layers) + 1):
            if self.ncmoe_budget(n) <= self.budget:
                return n
        return len(self.moe_layers)


def kv_cache_bytes(model: ModelFile, n_ctx: int) -> int:
    """f16 K and V for every layer with attention (llama.cpp's default cache type). Latent
    attention (deepseek2) caches one compressed K row a token and reads V out of it."""
    n_embd = int(model.arch_kv("embedding_length", 0))
    n_head = model.arch_kv("attention.head_count", 1)
    n_head = max(n_head) if isinstance(n_head, list) else int(n_head)
    n_head_kv = model.arch_kv("attention.head_count_kv", n_head)
    # per layer: layers without attention (recurrent ones) have none
    heads = n_head_kv if isinstance(n_head_kv, list) else [int(n_head_kv or n_head)] * \
        model.n_layer
    k = int(model.arch_kv("attention.key_length", n_embd // max(n_head, 1)))
    v = 0 if model.arch_kv("attention.kv_lora_rank") else int(
        model.arch_kv("attention.value_length", k))
    return sum(heads) * n_ctx * (k + v) * 2


def compute_buffer_bytes(n_ubatch: int, n_used: int, n_ff_exp: int, n_embd: int,
                         n_vocab: int) -> int:
    """Device compute buffers a ubatch of ``n_ubatch`` tokens needs: llama.cpp reserves every
    row's logits and the experts' intermediate rows, plus the expert groups' scratch."""
    pairs = n_ubatch * n_used
    return (n_ubatch * n_vocab * 4 + pairs * n_ff_exp * 4 * 3
            + n_ubatch * n_embd * 4 * 8 + COMPUTE_RESERVE
            # expert groups computed from slots: gathered inputs, outputs and row indices
            + pairs * (max(n_embd, n_ff_exp) * 4 * 2 + 16))


def draft_ubatch(n_batch: int) -> int:
    """A draft context's ubatch: it decodes a token at a time but for its prompt, and its
    compute buffers hold a ubatch's logits (a Qwen2 vocabulary's take 0.3 GB at 512 rows)."""
    return min(n_batch, DRAFT_UBATCH)


def dense_compute_bytes(n_ubatch: int, n_ff: int, n_embd: int, n_vocab: int) -> int:
    """A dense model's compute buffers for a ubatch of ``n_ubatch``: every row's logits, and
    its widest activation rows twice over (llama.cpp's allocator reuses the rest; Qwen2-0.5B's
    measured on the CPU build: 37.5 MiB at 64 rows and 300 MiB at 512, against 43.5 and 320
    MiB by this count)."""
    return n_ubatch * (n_vocab * 4 + max(n_ff, n_embd) * 8) + DRAFT_RESERVE


def draft_device_bytes(draft: ModelFile, n_ctx: int, n_ubatch: int) -> int:
    """What a draft model's context holds on the device: every weight (it runs all its layers
    there), its KV cache of ``n_ctx`` cells and its compute buffers for a ubatch of
    ``n_ubatch`` (a MoE draft's as the model's own are counted)."""
    n_embd = int(draft.arch_kv("embedding_length", 0))
    n_ff = int(draft.arch_kv("feed_forward_length", 0) or 0)
    compute = model_compute_bytes(draft, n_ubatch) if draft.is_moe else \
        dense_compute_bytes(n_ubatch, n_ff, n_embd, draft.n_vocab)
    return draft.total_bytes() + kv_cache_bytes(draft, n_ctx) + compute


def split_budget(model: ModelFile, budget: int, *, n_ctx: int, n_ubatch: int,
                device_name: str, device_total: int, kv_on_device: bool = True,
                contexts: Sequence[int] = (), draft_bytes: int = 0) -> BudgetSplit:
    """Split ``budget`` bytes of device memory; refuses budgets the device or model cannot meet.
    ``kv_on_device``: the KV cache is on the device (llama.cpp's ``offload_kqv``), else in
    host memory; ``contexts``: the context sizes of further contexts over the model (a batch
    job's micro-batches), each with compute buffers and a KV cache of its own;
    ``draft_bytes``: a draft model's context beside it (``draft_device_bytes``)."""
    if budget > device_total:
        raise BudgetError(f"budget {format_size(budget)} is larger than {device_name}'s "
                          f"{format_size(device_total)}; lower {setting('gpu_budget')}")
    layers = model.moe_layers()
    compute = model_compute_bytes(model, n_ubatch) * (1 + len(contexts))
    kv = sum(kv_cache_bytes(model, c) for c in (n_ctx, *contexts)) if kv_on_device else 0
    plan = BudgetSplit(budget=budget, non_expert_bytes=model.non_expert_bytes(),
                      kv_bytes=kv, compute_bytes=compute,
                      layer_bytes=tuple(model.layer_expert_bytes()), n_expert=model.n_expert,
                      moe_layers=layers, draft_bytes=draft_bytes)
    if plan.expert_budget < 0:
        draft = f" + the draft model {format_size(draft_bytes)}" if draft_bytes else ""
        raise BudgetError(
            f"budget {format_size(budget)} is too small for {model.path.name}: non-expert weights "
            f"{format_size(plan.non_expert_bytes)} + KV cache {format_size(plan.kv_bytes)} + "
            f"compute buffers {format_size(plan.compute_bytes)}{draft} need at least "
            f"{format_size(plan.fixed_bytes)}; raise {setting('gpu_budget')} or lower "
            f"{setting('n_ctx')}" + (f" or the micro-batches ({len(contexts) + 1})" if contexts
                                     else ""))
    return plan


def model_compute_bytes(model: ModelFile, n_ubatch: int) -> int:
    """``compute_buffer_bytes`` for ``model``'s shape."""
    return compute_buffer_bytes(n_ubatch, model.n_expert_used, model.expert_ff(),
                                int(model.arch_kv("embedding_length", 0)), model.n_vocab)


def fraction_slots(n_expert: int, fraction: float) -> int:
    """Slots of a layer caching ``fraction`` of its ``n_expert`` experts (at least one)."""
    if not 0 < fraction <= 1:
        raise ValueError(f"{setting('cache_fraction')} must be in (0, 1], not {fraction}")
    return max(1, math.ceil(fraction * n_expert - 1e-9))


def slots_for_fraction(model: ModelFile, fraction: float) -> list[int]:
    """Slots per layer caching ``fraction`` of each MoE layer's experts (at least one)."""
    n = fraction_slots(model.n_expert, fraction)
    layers = set(model.moe_layers())
    return [n if il in layers else 0 for il in range(model.n_layer)]


def parse_budgets(text: str) -> tuple[int, ...]:
    """``SIZE[,SIZE...]``: one budget, or one per device holding layers."""
    return tuple(parse_size(part) for part in text.split(","))


def _device_loads(model: ModelFile, budgets: tuple[int, ...], layer_dev: Sequence[int],
                  names: dict[int, str], *, n_ctx: int, n_ubatch: int, held: int = 0
                  ) -> list[tuple[int, int, list[int], int]]:
    """Per device holding MoE layers (``layer_dev[il]``, in device order; -1, a layer left on
    the CPU, is none): its budget, its layers, and the bytes they need beside routed experts:
    their non-expert weights (the output head's with the last layer's), KV cache, a ubatch's
    compute buffers and ``held`` bytes. ``budgets`` has one size per device, or one for all the
    devices together: each device then gets what it needs beside experts and a share of the
    rest in proportion to its layers' expert bytes, so that every MoE layer gets the same
    slots. A count of budgets that fits no device count is one line."""
    moe = set(model.moe_layers())
    devs = sorted({layer_dev[il] for il in moe if layer_dev[il] >= 0})
    if len(budgets) not in (1, len(devs)):
        raise BudgetError(
            f"{setting('gpu_budget')} gives {len(budgets)} sizes, and llama.cpp put the model's "
            f"layers on {len(devs)} devices ({', '.join(names.get(d, str(d)) for d in devs)}): "
            "give one size per device, or one size for them all")
    blk: dict[int, int] = {}
    head = 0  # output weights, on the last layer's device; token embeddings stay on the host
    for t in model.tensors:
        if t.name.startswith("blk.") and not is_expert_tensor(t.name):
            il = int(t.name.split(".")[1])
            blk[il] = blk.get(il, 0) + t.nbytes
        elif t.name.startswith("output"):
            head += t.nbytes
    kv_layer = kv_cache_bytes(model, n_ctx) / max(model.n_layer, 1)
    compute = model_compute_bytes(model, n_ubatch)
    layer_bytes = dict(zip(model.moe_layers(), model.layer_expert_bytes(), strict=True))
    loads = []
    for d in devs:
        on = [il for il in range(model.n_layer) if layer_dev[il] == d]
        fixed = int(sum(blk.get(il, 0) + kv_layer for il in on)) + compute + held + \
            (head if layer_dev[model.n_layer - 1] == d else 0)
        loads.append((d, on, fixed, sum(layer_bytes[il] for il in on if il in moe)))
    if len(budgets) == len(devs):
        return [(d, b, on, fixed) for (d, on, fixed, _), b in zip(loads, budgets, strict=True)]
    rest = budgets[0] - sum(fixed for _, _, fixed, _ in loads)
    experts = sum(e for *_, e in loads)
    return [(d, fixed + (rest * e // experts if rest > 0 else rest // len(loads)), on, fixed)
            for d, on, fixed, e in loads]


def device_host_layers(model: ModelFile, budgets: tuple[int, ...], layer_dev: Sequence[int],
                       names: dict[int, str], *, n_ctx: int, n_ubatch: int) -> list[int]:
    """``--n-cpu-moe`` over several devices: the fewest MoE layers whose routed experts stay in
    host memory so that each device's other weights, KV cache and compute buffers and the
    experts of its other MoE layers fit its budget (``_device_loads``), each device's first
    layers going to the host first, as ``-ot`` places them. A budget too small for a device's
    layers with every expert on the host is one line naming the device."""
    moe = set(model.moe_layers())
    layer_bytes = dict(zip(model.moe_layers(), model.layer_expert_bytes(), strict=True))
    host: list[int] = []
    for d, budget, on, fixed in _device_loads(model, budgets, layer_dev, names, n_ctx=n_ctx,
                                              n_ubatch=n_ubatch):
        if fixed > budget:
            raise BudgetError(
                f"budget {format_size(budget)} on {names.get(d, str(d))} is too small: its "
                f"{len(on)} layers' weights, KV cache and compute buffers need "
                f"{format_size(fixed)} with every routed expert in host memory; raise "
                f"{setting('gpu_budget')}")
        moe_on = [il for il in on if il in moe]
        left = fixed + sum(layer_bytes[il] for il in moe_on)
        for il in moe_on:
            if left <= budget:
                break
            host.append(il)
            left -= layer_bytes[il]
    return sorted(host)


def device_slots(model: ModelFile, budgets: tuple[int, ...], layer_dev: list[int],
                 names: dict[int, str], *, n_ctx: int, n_ubatch: int,
                 held: int = 0) -> list[int]:
    """Slots for each layer when llama.cpp put layer ``il`` on device ``layer_dev[il]`` and
    ``budgets`` gives each device's memory (one per device, in device order; a single one is
    their total, shared by ``_device_loads``): on each device, its layers' non-expert weights
    (the output head's with the last layer's), their KV cache and a ubatch's compute buffers
    come first, and the rest is slots, the same count in each of its MoE layers, less ``held``
    of the largest experts (each device's stage slots). A budget that cannot hold one slot a
    layer is refused in one line naming the device."""
    moe = set(model.moe_layers())
    layer_bytes = dict(zip(model.moe_layers(), model.layer_expert_bytes(), strict=True))
    out = [0] * model.n_layer
    for d, budget, on, fixed in _device_loads(model, budgets, layer_dev, names, n_ctx=n_ctx,
                                              n_ubatch=n_ubatch,
                                              held=held * max(layer_bytes.values())):
        moe_on = [il for il in on if il in moe]
        n = min(model.n_expert, max(budget - fixed, 0) // sum(layer_bytes[il] for il in moe_on))
        if n < 1:
            raise BudgetError(
                f"budget {format_size(budget)} on {names.get(d, str(d))} is too small: its "
                f"{len(on)} layers' weights, KV cache and compute buffers"
                f"{f' and {held} stage slots' if held else ''} need "
                f"{format_size(fixed)}, and one expert slot a layer "
                f"{format_size(sum(layer_bytes[il] for il in moe_on))} more; raise "
                f"{setting('gpu_budget')}")
        for il in moe_on:
            out[il] = n
    return out

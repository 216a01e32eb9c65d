"""Model shapes at a quantization, as the timing models see them: the cost model's batch plans
(``roofline.batch``) and the simulator."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml
from gguf import GGML_QUANT_SIZES

from forecache.cache.budget import BudgetSplit, compute_buffer_bytes, kv_cache_bytes
from forecache.cache.cost import ExpertShape
from forecache.gguf.header import ModelFile, expert_proj_bytes, is_expert_tensor, tensor_nbytes
from forecache.gguf.qtypes import parse_qtype, tensor_type
from forecache.gguf.specs import ModelSpec, TensorPlan, get_spec, models_yaml, tensor_plan


@dataclass(frozen=True)
class ModelShape:
    """What the timing model needs of a model: expert and per-layer sizes at a quantization."""

    name: str
    layers: int
    experts: int
    top_k: int
    d_model: int
    expert_ff: int
    proj_bytes: tuple[int, ...]  # one expert's gate, up, down (gate_up, down where fused)
    layer_bytes: int  # non-expert weights of one layer (attention, router, shared experts)
    head_bytes: int  # output norm + lm head
    qtype: str
    kv_bytes: int = 0  # f16 K and V of one token at one layer (llama.cpp's default cache type)
    lead_bytes: int = 0  # leading dense layers (deepseek2), run on the device for every row
    n_vocab: int = 0  # tokens of the vocabulary (0: as the head's bytes imply)

    @property
    def expert(self) -> ExpertShape:
        return ExpertShape(self.d_model, self.expert_ff, self.proj_bytes)

    @property
    def expert_bytes(self) -> int:
        """Bytes of one routed expert (all its projections) of one layer."""
        return self.expert.nbytes

    @property
    def proj_flops(self) -> float:
        """Multiply-adds x2 of one projection for one token."""
        return self.expert.proj_flops

    @property
    def layer_flops(self) -> float:
        return 2.0 * self.layer_bytes / self.bytes_per_weight

    @property
    def dense_bytes(self) -> int:
        """Weights read once a forward pass on the device: every layer's non-expert weights and
        the head."""
        return self.layers * self.layer_bytes + self.lead_bytes + self.head_bytes

    @property
    def vocab(self) -> int:
        """The vocabulary (the logits' share of the compute buffers)."""
        return self.n_vocab or max(
            1, int(self.head_bytes / max(self.bytes_per_weight, 1e-9) / self.d_model))

    def kv_cache_bytes(self, n_ctx: int, n_seq: int = 1) -> int:
        """The KV cache of ``n_seq`` sequences of ``n_ctx`` tokens each."""
        return n_seq * n_ctx * self.layers * self.kv_bytes

    def compute_bytes(self, n_ubatch: int, n_seq: int = 1) -> int:
        """``budget.compute_buffer_bytes`` for a ubatch of ``n_ubatch`` tokens, or of one token
        of each of ``n_seq`` sequences where that is more."""
        return compute_buffer_bytes(max(n_ubatch, n_seq), self.top_k, self.expert_ff,
                                    self.d_model, self.vocab)

    def memory(self, budget: int, *, n_ctx: int, n_ubatch: int, n_seq: int = 1,
               kv_on_device: bool = True, non_expert_bytes: int | None = None,
               layers: int | None = None) -> BudgetSplit:
        """Where ``budget`` goes for this shape, by the runtime's rule (``budget.BudgetSplit``:
        the non-expert weights, the KV cache when on the device and the compute buffers first,
        the rest expert slots or ncmoe layers), over ``layers`` MoE layers (default all)."""
        n = self.layers if layers is None else layers
        return BudgetSplit(budget=budget,
                          non_expert_bytes=self.dense_bytes if non_expert_bytes is None
                          else non_expert_bytes,
                          kv_bytes=self.kv_cache_bytes(n_ctx, n_seq) if kv_on_device else 0,
                          compute_bytes=self.compute_bytes(n_ubatch, n_seq),
                          layer_bytes=(self.expert_bytes,) * n, n_expert=self.experts,
                          moe_layers=list(range(n)))

    @property
    def bytes_per_weight(self) -> float:
        bs, ts = GGML_QUANT_SIZES[parse_qtype(self.qtype)]
        return ts / bs


def _nbytes(n_elements: int, row: int, qtype: str) -> int:
    """Bytes of a matrix of ``row``-long rows written as ``qtype``, with the type llama.cpp's
    quantizer falls back to where a row does not fit the block (as ``make-model`` writes it)."""
    ne = (row, n_elements // row)
    return tensor_nbytes(ne, tensor_type("", ne, qtype))


def shape_of(name: str, qtype: str = "q4_k") -> ModelShape:
    """The shape of a models.yaml model (``models`` or ``trace_models``) at ``qtype``: a preset's
    sizes are its tensors as make-model writes them (the lm head at q8_0, as quantizers keep
    it); a shape-only trace model's are a qwen2moe-style layer of its dimensions. ValueError for
    a dense preset (a draft): it has no experts to time."""
    raw = yaml.safe_load(models_yaml(None).read_text())
    extra = (raw.get("trace_models") or {}).get(name)
    if extra is None or "preset" in extra:
        spec = get_spec(extra["preset"] if extra else name)
        if spec.is_dense:
            raise ValueError(f"{spec.name} is a dense draft, not a MoE model: the timing models "
                             "and the simulator take MoE shapes")
        return _preset_shape(name, spec, qtype)
    spec = dict(extra)
    d, ff, e = spec["d_model"], spec["expert_ff"], spec["experts"]
    head = spec.get("head_dim") or d // spec["heads"]
    q, kv = head * spec["heads"], head * spec["kv_heads"]
    sh = spec.get("shared_ff", 0)
    proj = (_nbytes(d * ff, d, qtype), _nbytes(d * ff, d, qtype), _nbytes(d * ff, ff, qtype))
    attn = _nbytes(d * q, d, qtype) + _nbytes(q * d, q, qtype) + 2 * _nbytes(d * kv, d, qtype)
    layer = attn + d * e * 4 + 3 * _nbytes(d * sh, d, qtype) if sh else attn + d * e * 4
    return ModelShape(name=name, layers=spec["layers"], experts=e, top_k=spec["top_k"],
                    d_model=d, expert_ff=ff, proj_bytes=proj, layer_bytes=layer,
                    head_bytes=_nbytes(d * spec["vocab"], d, "q8_0"), qtype=qtype.lower(),
                    kv_bytes=4 * kv, n_vocab=spec["vocab"])


def _preset_shape(name: str, spec: ModelSpec, qtype: str) -> ModelShape:
    """A preset's shape from its tensors as make-model writes them: the MoE layers' expert and
    other bytes averaged over them (q4_k_m gives some layers more bits, lfm2moe's convolution
    and attention layers differ), leading dense layers apart, KV of the layers with attention
    (latent attention caches one compressed row) spread over the MoE layers."""
    plans = tensor_plan(spec, qtype)

    def block(t: TensorPlan) -> int:
        return int(t.name.split(".")[1]) if t.name.startswith("blk.") else -1

    moe = [t for t in plans if block(t) >= spec.dense_layers]
    if spec.kv_lora_rank is not None:
        assert spec.rope_dim is not None
        kv = 2 * (spec.kv_lora_rank + spec.rope_dim)
    else:
        kv = 4 * spec.kv_dim
    n_attn = len(spec.attention_layers) if spec.attention_layers is not None else spec.layers
    return ModelShape(name=name, layers=spec.moe_layers, experts=spec.experts, top_k=spec.top_k,
                    d_model=spec.d_model, expert_ff=spec.expert_ff,
                    proj_bytes=expert_proj_bytes(plans, spec.experts),
                    layer_bytes=sum(t.nbytes for t in moe if t.kind != "expert") //
                    spec.moe_layers,
                    head_bytes=_nbytes(spec.d_model * spec.vocab, spec.d_model, "q8_0"),
                    qtype=qtype.lower(), kv_bytes=kv * n_attn // spec.moe_layers,
                    lead_bytes=sum(t.nbytes for t in plans if 0 <= block(t) < spec.dense_layers),
                    n_vocab=spec.vocab)


def model_shape(model: ModelFile) -> ModelShape:
    """The simulator's view of a GGUF file: its own sizes, tensor by tensor. Its layers are the
    MoE layers (a trace's), dense leading layers go into ``lead_bytes``."""
    moe = model.moe_layers()
    blk = [t for t in model.tensors if t.name.startswith(f"blk.{moe[0]}.")]
    ex = ExpertShape.of(model)
    qtype = next(t for t in blk if is_expert_tensor(t.name)).type.name.lower()
    head = sum(t.nbytes for t in model.tensors if t.name.startswith("output"))
    lead = sum(t.nbytes for t in model.tensors if t.name.startswith("blk.") and
               int(t.name.split(".")[1]) not in moe)
    return ModelShape(name=Path(model.name).stem, layers=len(moe), experts=model.n_expert,
                    top_k=model.n_expert_used, d_model=ex.d_model, expert_ff=ex.expert_ff,
                    proj_bytes=ex.proj_bytes,
                    layer_bytes=sum(t.nbytes for t in blk if not is_expert_tensor(t.name)),
                    head_bytes=head, qtype=qtype,
                    kv_bytes=kv_cache_bytes(model, 1) // max(model.n_layer, 1), lead_bytes=lead,
                    n_vocab=model.n_vocab)

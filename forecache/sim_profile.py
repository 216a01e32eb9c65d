"""Timing inputs of the simulator: a machine profile and a model shape at a quantization.

A profile is JSON (shipped ones in forecache/data/profiles/, or a file): host-to-device bandwidth,
device and host compute rates, and the fixed costs of the runtime's own steps. Compute time is a
roofline: the larger of bytes read at memory bandwidth and arithmetic at the compute rate.
"""

from __future__ import annotations

import json
from dataclasses import MISSING, dataclass, fields
from importlib import resources
from pathlib import Path

import yaml
from gguf import GGML_QUANT_SIZES

from forecache.model_specs import _find_yaml, get_spec, parse_qtype

PROFILE_DIR = "data/profiles"


@dataclass(frozen=True)
class Profile:
    """A machine, as the simulator's timing model sees it."""

    name: str
    device: str
    h2d_gbps: float  # achieved host-to-device copy bandwidth
    chunk_latency_s: float  # fixed cost per copy
    gpu_mem_gbps: float  # weight-streaming bandwidth of device matmuls
    gpu_tflops: float  # effective device matmul rate
    gpu_launch_s: float  # fixed cost of one device op group (kernel launches)
    cpu_mem_gbps: float  # host expert compute: weight-streaming bandwidth
    cpu_gflops: float  # host expert compute: effective rate
    cpu_launch_s: float  # fixed cost of one host expert matmul
    hook_s: float  # gate hook on the critical path
    predictor_s: float  # one prediction on the predictor thread
    token_s: float = 0.0  # per forward pass, outside the graph: sampling, the Python runtime
    prefetch_hook_s: float = 0.0  # promoe's gate hook, when it costs more than hook_s (0: same)
    group_s: float = 0.0  # an expert group computed as its own graph (gather, matmul, scatter)
    source: str = ""

    @classmethod
    def load(cls, name_or_path: str) -> Profile:
        """A shipped profile by name (``rtx4090``) or a JSON file."""
        path = Path(name_or_path)
        if path.suffix == ".json" or path.exists():
            if not path.is_file():
                raise ValueError(f"profile {path} does not exist; give a JSON file or one of "
                                 f"{', '.join(shipped_profiles())}")
            text = path.read_text()
        else:
            ref = resources.files("forecache").joinpath(f"{PROFILE_DIR}/{name_or_path}.json")
            if not ref.is_file():
                raise ValueError(f"unknown profile {name_or_path!r}; shipped: "
                                 f"{', '.join(shipped_profiles())}, or give a JSON file")
            text = ref.read_text()
        try:
            raw = json.loads(text)
        except ValueError as e:
            raise ValueError(f"profile {name_or_path}: not JSON ({e})") from e
        names = {f.name for f in fields(cls)}
        optional = {f.name for f in fields(cls) if f.default is not MISSING}
        missing = sorted(n for n in names - set(raw) - optional)
        if missing:
            raise ValueError(f"profile {name_or_path}: missing {', '.join(missing)}")
        return cls(**{k: v for k, v in raw.items() if k in names})


def shipped_profiles() -> list[str]:
    """Names of the profiles that come with forecache."""
    d = resources.files("forecache").joinpath(PROFILE_DIR)
    return sorted(p.name[:-5] for p in d.iterdir() if p.name.endswith(".json"))


@dataclass(frozen=True)
class ExpertShape:
    """One routed expert: model width, expert width, bytes of each projection."""

    d_model: int
    expert_ff: int
    proj_bytes: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return sum(self.proj_bytes)

    @property
    def proj_flops(self) -> float:
        """Multiply-adds x2 of one token through one projection."""
        return 2.0 * self.d_model * self.expert_ff


@dataclass(frozen=True)
class SimShape:
    """What the timing model needs of a model: expert and per-layer sizes at a quantization."""

    name: str
    layers: int
    experts: int
    top_k: int
    d_model: int
    expert_ff: int
    proj_bytes: tuple[int, int, int]  # one expert's gate, up, down
    layer_bytes: int  # non-expert weights of one layer (attention, router, shared experts)
    head_bytes: int  # output norm + lm head
    qtype: str

    @property
    def expert(self) -> ExpertShape:
        return ExpertShape(self.d_model, self.expert_ff, self.proj_bytes)

    @property
    def expert_bytes(self) -> int:
        return self.expert.nbytes

    @property
    def proj_flops(self) -> float:
        """Multiply-adds x2 of one projection for one token."""
        return self.expert.proj_flops

    @property
    def layer_flops(self) -> float:
        return 2.0 * self.layer_bytes / self.bytes_per_weight

    @property
    def bytes_per_weight(self) -> float:
        bs, ts = GGML_QUANT_SIZES[parse_qtype(self.qtype)]
        return ts / bs


def _nbytes(n_elements: int, row: int, qtype: str) -> int:
    t = parse_qtype(qtype)
    bs, ts = GGML_QUANT_SIZES[t]
    if row % bs:  # llama.cpp's quantizers fall back for rows that do not fit the block
        t = parse_qtype("q8_0") if row % 32 == 0 else parse_qtype("f16")
        bs, ts = GGML_QUANT_SIZES[t]
    return n_elements // bs * ts


def shape_of(name: str, qtype: str = "q4_k") -> SimShape:
    """The shape of a models.yaml model (``models`` or ``trace_models``) at ``qtype``."""
    raw = yaml.safe_load(_find_yaml(None).read_text())
    extra = (raw.get("trace_models") or {}).get(name)
    if extra is not None and "preset" not in extra:
        spec = dict(extra)
    else:
        s = get_spec(extra["preset"] if extra is not None else name)
        spec = {"layers": s.layers, "experts": s.experts, "top_k": s.top_k,
                "d_model": s.d_model, "expert_ff": s.expert_ff, "heads": s.heads,
                "kv_heads": s.kv_heads, "vocab": s.vocab,
                "shared_ff": s.shared_expert_ff * s.shared_experts}
    d, ff, e = spec["d_model"], spec["expert_ff"], spec["experts"]
    kv = d // spec["heads"] * spec["kv_heads"]
    sh = spec.get("shared_ff", 0)
    proj = (_nbytes(d * ff, d, qtype), _nbytes(d * ff, d, qtype), _nbytes(d * ff, ff, qtype))
    attn = 2 * _nbytes(d * d, d, qtype) + 2 * _nbytes(d * kv, d, qtype)
    layer = attn + d * e * 4 + 3 * _nbytes(d * sh, d, qtype) if sh else attn + d * e * 4
    return SimShape(name=name, layers=spec["layers"], experts=e, top_k=spec["top_k"],
                    d_model=d, expert_ff=ff, proj_bytes=proj, layer_bytes=layer,
                    head_bytes=_nbytes(d * spec["vocab"], d, "q8_0"), qtype=qtype.lower())


def trace_model_names() -> dict[str, str]:
    """Trace-file stems -> the models.yaml model they were recorded on."""
    raw = yaml.safe_load(_find_yaml(None).read_text())
    out = {}
    for name, spec in (raw.get("trace_models") or {}).items():
        for stem in spec.get("traces", []):
            out[stem] = name
    return out

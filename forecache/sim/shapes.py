"""Model shapes for the simulator: the timing models' shapes (``roofline.shape``), and the models
that recorded the shared traces."""

from __future__ import annotations

import yaml

from forecache.gguf.specs import models_yaml
from forecache.roofline.shape import ModelShape, model_shape, shape_of

__all__ = ["ModelShape", "model_shape", "shape_of", "trace_model_names"]


def trace_model_names() -> dict[str, str]:
    """Trace-file stems -> the models.yaml model they were recorded on."""
    raw = yaml.safe_load(models_yaml(None).read_text())
    out = {}
    for name, spec in (raw.get("trace_models") or {}).items():
        for stem in spec.get("traces", []):
            out[stem] = name
    return out

"""Where trained predictors live: a per-model directory keyed by the model's fingerprint.

``<cache>/predictors/<arch>-<fingerprint[:16]>/learned-k<K>/`` holds the ONNX files, learned.json
and model.json (the identity of the model they were trained for). Loading checks model.json
against the model at hand, so predictors of another model are refused.
"""

from __future__ import annotations

import json
from pathlib import Path

from forecache.atomic_file import write_atomic
from forecache.gguf.header import ModelFile
from forecache.gguf.identity import identity, require_same_model
from forecache.paths import cache_dir

MODEL_FILE = "model.json"


def model_dir(model: ModelFile) -> Path:
    """The per-model predictor directory."""
    ident = identity(model)
    return cache_dir() / "predictors" / f"{ident['arch']}-{ident['fingerprint'][:16]}"


def learned_dir(model: ModelFile, window: int) -> Path:
    """Default directory of the learned predictors of window ``window``."""
    return model_dir(model) / f"learned-k{window}"


def write_identity(directory: Path, model: ModelFile, extra: dict | None = None) -> None:
    """Record which model the predictors in ``directory`` belong to."""
    write_atomic(directory / MODEL_FILE,
                 json.dumps({**identity(model), **(extra or {})}, indent=1, sort_keys=True))


def load_learned(model: ModelFile, window: int | None = None, directory: Path | None = None,
                 threads: int = 1):  # type: ignore[no-untyped-def]
    """The learned predictors for ``model`` (from ``directory`` or the default one of
    ``window``), refused with a clear message when they belong to another model."""
    from forecache.predictor.learned import LearnedPredictor

    if directory is None:
        if window is None:
            raise ValueError("give the predictor directory or the window")
        directory = learned_dir(model, window)
    fix = (f"train predictors for it with `forecache train -m {model.path} --trace TRACE.npz "
           f"--window {window or 'K'}`")
    ident_path = directory / MODEL_FILE
    if not ident_path.is_file():
        raise ValueError(f"no trained predictors in {directory}; {fix}")
    try:
        recorded = json.loads(ident_path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{ident_path} is unreadable ({e}); {fix}") from e
    require_same_model(recorded, model, f"the predictors in {directory}", fix)
    return LearnedPredictor.load(directory, threads=threads)


def trained_windows(model: ModelFile) -> list[int]:
    """Windows with learned predictors stored for ``model`` (smallest first)."""
    base = model_dir(model)
    out = []
    for d in base.glob("learned-k*") if base.is_dir() else []:
        if d.name[len("learned-k"):].isdigit() and (d / MODEL_FILE).is_file():
            out.append(int(d.name[len("learned-k"):]))
    return sorted(out)

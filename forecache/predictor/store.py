"""Where trained predictors live: a per-model directory keyed by the model's fingerprint.

``<cache>/predictors/<arch>-<fingerprint[:16]>/learned-k<K>/`` holds the ONNX files, learned.json
and model.json (the identity of the model they were trained for); ``eam/`` holds the EAM
collection (``eam.npz``: the stored EAMs, the routing prior and the per-layer LRU hit curves
``infinity`` sizes its pools from) and its model.json. Loading checks model.json against the
model at hand, so predictors of another model are refused.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from forecache.gguf.header import ModelFile
from forecache.gguf.identity import identity, require_same_model
from forecache.paths import cache_dir, write_atomic

MODEL_FILE = "model.json"
EAM_FILE = "eam.npz"


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


def eam_dir(model: ModelFile) -> Path:
    """Directory of ``model``'s EAM collection."""
    return model_dir(model) / "eam"


@dataclass
class EAMCollection:
    """What ``forecache train --predictor eam`` keeps from a trace."""

    eams: np.ndarray  # [N, L, E] token counts of each stored request
    prior: np.ndarray  # [L, E] share of routed slots per layer and expert
    hit_curves: np.ndarray  # [L, E + 1] decode hits of a per-layer LRU cache of 0..E slots


def save_eam(model: ModelFile, collection: EAMCollection, trace: str) -> Path:
    """Store ``collection`` as ``model``'s EAM collection (recorded from ``trace``)."""
    directory = eam_dir(model)
    directory.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    np.savez_compressed(buf, eams=collection.eams.astype(np.float32),
                        prior=collection.prior.astype(np.float64),
                        hit_curves=collection.hit_curves.astype(np.int64))
    write_atomic(directory / EAM_FILE, buf.getvalue())
    write_identity(directory, model, {"trace": trace, "n_eams": int(len(collection.eams))})
    return directory


def has_eam(model: ModelFile) -> bool:
    """Whether an EAM collection is stored for ``model``."""
    d = eam_dir(model)
    return (d / EAM_FILE).is_file() and (d / MODEL_FILE).is_file()


def load_eam(model: ModelFile) -> EAMCollection:
    """``model``'s stored EAM collection; a missing one (or one of another model) is refused with
    the commands that make it."""
    directory = eam_dir(model)
    fix = (f"make one with `forecache trace -m {model.path} --builtin default --out TRACE.npz` "
           f"and `forecache train -m {model.path} --trace TRACE.npz --predictor eam`")
    ident_path = directory / MODEL_FILE
    if not has_eam(model):
        raise ValueError(f"no EAM collection for {model.path.name} in {directory}; {fix}")
    try:
        recorded = json.loads(ident_path.read_text())
        with np.load(directory / EAM_FILE) as z:
            out = EAMCollection(z["eams"], z["prior"], z["hit_curves"])
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"the EAM collection in {directory} is unreadable ({e}); {fix}") from e
    require_same_model(recorded, model, f"the EAM collection in {directory}", fix)
    return out

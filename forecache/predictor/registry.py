"""The predictors by name: what each needs from a trace, and how to build one for a trace."""

from __future__ import annotations

from collections.abc import Sequence

from forecache.errors import setting
from forecache.gguf.header import ModelFile
from forecache.predictor.base import Predictor
from forecache.trace.format import TraceInfo

# every predictor the evaluation compares; promoe prefetches with those it can run (the rest are
# baselines of the paper), and two are trained from a trace
PREDICTORS = ("learned", "skip", "token", "eam", "history")
RUNTIME_PREDICTORS = ("learned", "history", "eam")
TRAINED_PREDICTORS = ("learned", "eam")
# those that read a layer's router input, which a trace keeps only when asked to
GATE_INPUT_PREDICTORS = ("learned", "skip")
# what ``auto`` weighs, best first by top-k accuracy, where a trace has no gate inputs
AUTO_FALLBACKS = ("eam", "token", "history")


def parse_names(text: str) -> list[str]:
    """``"learned,eam"`` -> ["learned", "eam"]; ``all`` -> every predictor."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if names == ["all"]:
        return list(PREDICTORS)
    bad = [n for n in names if n not in PREDICTORS]
    if bad or not names:
        raise ValueError(f"unknown predictor {', '.join(bad) or '(none)'}; choose from "
                         f"{', '.join(PREDICTORS)} or all")
    return names


def unavailable(name: str, info: TraceInfo, model: ModelFile | None) -> str | None:
    """Why ``name`` cannot run on this trace, or None."""
    if name in GATE_INPUT_PREDICTORS and not info.has_gate_input:
        return f"the trace has no gate inputs (record it with {setting('gate_input', True)})"
    if name == "token" and "token_ids" not in info.arrays:
        return "the trace has no token ids"
    if name == "skip" and model is None:
        return "needs the model's routers: pass -m MODEL"
    return None


def make_predictor(name: str, info: TraceInfo, pairs: Sequence[tuple[int, int]], *,
                   model: ModelFile | None = None, learned_epochs: int | None = None,
                   ) -> Predictor:
    """A fresh, unfitted predictor of ``name`` for a trace of shape ``info``."""
    L, E, k = info.n_layers, info.n_expert, info.top_k
    if name == "history":
        from forecache.predictor.history import HistoryPredictor

        return HistoryPredictor(L, E, k)
    if name == "token":
        from forecache.predictor.token import TokenPredictor

        return TokenPredictor(L, E, k)
    if name == "eam":
        from forecache.predictor.eam import EAMPredictor

        return EAMPredictor(L, E, k)
    if name == "skip":
        from forecache.predictor.skip import SkipPredictor

        if model is None:
            raise ValueError("the skip predictor needs the model: pass -m MODEL")
        layers = info.meta.get("moe_layers") or list(range(L))
        return SkipPredictor.from_model(model, layers)
    if name == "learned":
        from forecache.predictor.learned import LearnedPredictor

        d = int(info.meta.get("n_embd") or 0)
        if not d:
            raise ValueError("the learned predictor needs gate inputs (n_embd unknown)")
        kw = {} if learned_epochs is None else {"epochs": learned_epochs}
        return LearnedPredictor(L, E, k, pairs=list(pairs), d_model=d, **kw)
    raise ValueError(f"unknown predictor {name!r}")

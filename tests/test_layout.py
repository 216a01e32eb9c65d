"""The tree's layering: the runtime never needs the simulator, lower layers never import upper
ones, and no module reaches for another's private names."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "forecache"

# standard-library-only modules every layer may use
BASE = {"forecache.paths", "forecache.atomic_file", "forecache.interrupt", "forecache.errors"}
# package (or module) -> the forecache packages and modules it may import besides BASE
ALLOWED = {
    **{m: set() for m in BASE},
    "forecache.build": set(),
    "forecache.gguf": {"forecache.gguf"},
    "forecache.trace.format": set(),
    "forecache.native": {"forecache.native", "forecache.build"},
    "forecache.predictor": {"forecache.predictor", "forecache.trace.format", "forecache.gguf"},
    "forecache.cache": {"forecache.cache", "forecache.native", "forecache.gguf",
                        "forecache.predictor", "forecache.trace.format"},
}


def _modules() -> list[tuple[str, Path]]:
    out = []
    for path in sorted(PKG.rglob("*.py")):
        parts = path.relative_to(PKG.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out.append((".".join(parts), path))
    return out


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    """(module, names) of every forecache import in ``path``, at any depth (lazy ones too)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                and node.module.startswith("forecache"):
            found.append((node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            found += [(a.name, []) for a in node.names if a.name.startswith("forecache")]
    return found


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


@pytest.mark.parametrize("module,path", _modules(), ids=[m for m, _ in _modules()])
def test_imports_follow_the_layers(module: str, path: Path) -> None:
    rule = next((k for k in sorted(ALLOWED, key=len, reverse=True) if _within(module, k)), None)
    for target, names in _imports(path):
        # a name imported from a package may be a submodule of it
        targets = [target] + [f"{target}.{n}" for n in names]
        if rule is not None:
            ok = any(_within(t, a) for t in targets for a in ALLOWED[rule] | BASE)
            assert ok, f"{module} ({rule} layer) imports {target}"
        if not _within(module, "forecache.sim") and not _within(module, "forecache.cli"):
            assert not _within(target, "forecache.sim"), f"{module} imports the simulator"
        private = [n for n in names if n.startswith("_") and not n.startswith("__")]
        assert not private, f"{module} imports private names {private} from {target}"

"""The tree's layering: the runtime never needs the simulator, lower layers never import upper
ones, and no module reaches for another's private names."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "forecache"

# standard-library-only modules every layer may use
BASE = {"forecache.paths", "forecache.interrupt", "forecache.errors", "forecache.diskprobe",
        "forecache.version"}
# package (or module) -> the forecache packages and modules it may import besides BASE; every
# module falls under one rule (``test_every_module_has_a_rule``), the longest that names it.
# From the bottom: files and builds, the C runtime, predictors, the expert cache, placement, the
# drop-in Llama, what drives it (generation, speculation, serving, batch jobs, benchmarks), then
# the simulator and the command line. A type named for annotations only counts too: generation
# and speculation drive the Llama that imports them.
ALLOWED = {
    **{m: set() for m in BASE},
    "forecache.build": {"forecache.build"},
    "forecache.gguf": {"forecache.gguf"},
    "forecache.models": {"forecache.models", "forecache.gguf"},
    "forecache.trace.format": set(),
    "forecache.trace.stats": {"forecache.trace.format"},
    "forecache.trace": {"forecache.trace", "forecache.gguf"},
    # the runtime reads a build's record, never the build machinery
    "forecache.native": {"forecache.native", "forecache.build.info"},
    "forecache.doctor": {"forecache.native"},
    "forecache.predictor": {"forecache.predictor", "forecache.trace.format", "forecache.gguf"},
    "forecache.cache": {"forecache.cache", "forecache.native", "forecache.gguf",
                        "forecache.predictor", "forecache.trace.format"},
    # options -> a plan before the load and after it -> an expert cache: nothing that drives a
    # loaded model
    "forecache.placement": {"forecache.placement", "forecache.cache", "forecache.native",
                            "forecache.gguf", "forecache.predictor", "forecache.trace.format",
                            "forecache.trace.replay"},
    "forecache.generate": {"forecache.native", "forecache.llama"},
    "forecache.speculative": {"forecache.speculative", "forecache.native", "forecache.gguf",
                              "forecache.generate", "forecache.llama"},
    "forecache.llama": {"forecache.placement", "forecache.cache", "forecache.native",
                        "forecache.gguf", "forecache.models", "forecache.generate",
                        "forecache.speculative", "forecache.trace.replay"},
    "forecache": {"forecache.llama"},  # the package's face
    "forecache.serve": {"forecache.llama"},
    "forecache.chat": {"forecache.llama", "forecache.generate", "forecache.cache"},
    "forecache.roofline": {"forecache.roofline", "forecache.cache", "forecache.gguf",
                           "forecache.native"},
    "forecache.jobs": {"forecache.jobs", "forecache.batch", "forecache.roofline",
                       "forecache.placement", "forecache.llama", "forecache.cache",
                       "forecache.native", "forecache.gguf", "forecache.generate",
                       "forecache.speculative", "forecache.models", "forecache.chat",
                       "forecache.doctor"},
    "forecache.batch": {"forecache.jobs", "forecache.llama", "forecache.generate",
                        "forecache.speculative", "forecache.placement", "forecache.cache",
                        "forecache.roofline", "forecache.native", "forecache.gguf",
                        "forecache.doctor", "forecache.micro"},
    "forecache.micro": {"forecache.llama", "forecache.cache"},
    "forecache.record": {"forecache.trace", "forecache.jobs", "forecache.llama",
                         "forecache.placement", "forecache.cache", "forecache.generate",
                         "forecache.gguf"},
    "forecache.bench": {"forecache.llama", "forecache.placement", "forecache.cache",
                        "forecache.generate", "forecache.gguf", "forecache.trace.replay",
                        "forecache.speculative"},
    # the simulator models the runtime and calibrates against it: everything but the CLI
    "forecache.sim": {m for m in ("forecache.sim", "forecache.bench", "forecache.jobs",
                                  "forecache.record", "forecache.trace", "forecache.roofline",
                                  "forecache.placement", "forecache.llama", "forecache.cache",
                                  "forecache.predictor", "forecache.native", "forecache.gguf",
                                  "forecache.generate", "forecache.doctor")},
    "forecache.cli": {"forecache"},  # the command line may use all of it
    "forecache.__main__": {"forecache.cli"},
}


def _rule(module: str) -> str | None:
    """The longest key of ``ALLOWED`` that ``module`` falls under."""
    return next((k for k in sorted(ALLOWED, key=len, reverse=True)
                 if module == k or module.startswith(k + ".") and k != "forecache"), None)


def _modules() -> list[tuple[str, Path]]:
    out = []
    for path in sorted(PKG.rglob("*.py")):
        parts = path.relative_to(PKG.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out.append((".".join(parts), path))
    return out


def _imports(path: Path, runtime: bool = False) -> list[tuple[str, list[str]]]:
    """(module, names) of every forecache import in ``path``, at any depth (lazy ones too);
    ``runtime``: less those under ``if TYPE_CHECKING:`` (names for annotations only)."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if runtime and isinstance(node, ast.If) and isinstance(node.test, ast.Name) and \
                node.test.id == "TYPE_CHECKING":
            node.body = []
    found = []
    for node in ast.walk(tree):
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
    rule = _rule(module)
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


def test_every_module_has_a_rule() -> None:
    """A module no rule covers would import what it liked, unchecked."""
    missing = [m for m, _ in _modules() if _rule(m) is None]
    assert not missing, f"no layer rule for {missing}: add one to ALLOWED"


def _graph() -> dict[str, set[str]]:
    """Module -> the forecache modules it imports when it runs (at any depth, lazy ones too); an
    import of a name from a package goes to the submodule of that name where there is one."""
    modules = dict(_modules())
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        for target, names in _imports(path, runtime=True):
            subs = [f"{target}.{n}" for n in names if f"{target}.{n}" in modules]
            for t in subs or ([target] if target in modules else []):
                if t != module:
                    graph[module].add(t)
    return graph


def test_no_import_circles() -> None:
    """No module reaches itself through the imports it runs: each circle is a room that cannot be
    read (or moved) on its own. A type named for annotations only (under TYPE_CHECKING: the
    speculator names the Llama it drives) is no dependency and is left out."""
    graph = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not circles, f"import circles: {circles}"

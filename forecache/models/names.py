"""What ``-m`` accepts: a GGUF path, a published model's name from models.yaml's ``catalog``
(found in the user's model directory, put there by hand or by ``forecache pull``), a hub repo
``OWNER/REPO[:QUANT]`` that ``forecache pull`` downloaded, ``default``, or a preset made with
random weights."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import yaml

from forecache.errors import setting
from forecache.gguf.specs import load_specs, models_yaml
from forecache.models.default import DEFAULT_PRESET, ensure_default_model, ensure_tiny_model
from forecache.models.pull import (
    PullError,
    PullResult,
    find_catalog_pulled,
    find_pulled,
    parse_spec,
    pull_repo,
)
from forecache.paths import model_dir


class ModelNotFoundError(FileNotFoundError):
    """A model name whose file is not where forecache looks; the message says where to put it."""


@dataclass(frozen=True)
class CatalogEntry:
    """A published GGUF that ``-m NAME`` finds in the model directory."""

    name: str
    file: str
    hf_repo: str | None
    preset: str | None
    description: str


@functools.lru_cache(maxsize=4)
def _catalog(path: Path) -> dict[str, CatalogEntry]:
    raw = yaml.safe_load(path.read_text()).get("catalog") or {}
    out = {}
    for name, entry in raw.items():
        fields = {"file", "hf_repo", "preset", "description"}
        if not isinstance(entry, dict) or set(entry) - fields or not entry.get("file"):
            raise ValueError(f"catalog entry {name!r} in {path}: needs `file` and may have "
                             f"{', '.join(sorted(fields - {'file'}))}")
        out[str(name)] = CatalogEntry(str(name), str(entry["file"]), entry.get("hf_repo"),
                                      entry.get("preset"), entry.get("description") or "")
    return out


def catalog(path: str | Path | None = None) -> dict[str, CatalogEntry]:
    """The named published models of models.yaml, in file order."""
    return dict(_catalog(models_yaml(path).resolve()))


def find_in_model_dir(entry: CatalogEntry, directory: Path | None = None) -> Path | None:
    """The file of ``entry`` in the model directory: its ``file``, else a ``<name>*.gguf``
    (another quantization, or a split file's first part), case-insensitively; else what
    ``forecache pull NAME`` downloaded (``OWNER/REPO/`` of its ``hf_repo`` there)."""
    directory = directory or model_dir()
    try:
        files = sorted(p for p in directory.iterdir() if p.is_file())
    except OSError:
        return None
    by_name = {p.name.lower(): p for p in files}
    if entry.file.lower() in by_name:
        return by_name[entry.file.lower()]
    prefix = entry.name.lower()
    for p in files:
        low = p.name.lower()
        if low.startswith(prefix) and low.endswith(".gguf") and \
                ("-of-" not in low or "-00001-of-" in low):
            return p
    if entry.hf_repo and parse_spec(entry.hf_repo) is not None:
        return find_catalog_pulled(entry.hf_repo, entry.file, directory)
    return None


def known_names() -> list[str]:
    """Every name ``-m`` accepts besides a path."""
    return ["default", *catalog(), *load_specs()]


def resolve_model_arg(arg: str | os.PathLike[str]) -> Path:
    """The GGUF file a model argument means, alike for the command line's ``-m`` and
    ``forecache.Llama(...)``: a path object is that file; a string is a path or a name
    (``resolve_model``)."""
    if isinstance(arg, os.PathLike):
        return Path(arg)
    return resolve_model(arg)


def resolve_model(arg: str | os.PathLike[str] | None) -> Path:
    """The GGUF file ``arg`` means. None or ``default``: the default model. An existing file,
    or a name ending in .gguf: itself. ``OWNER/REPO[:QUANT]``: the file ``forecache pull`` put
    in the model directory for it (a split model's first shard). Else anything with a separator:
    itself. A catalog name: its file in the model directory. ``tiny``: made on first use; the
    other presets say how to make one."""
    if arg is None or str(arg) == "default":
        return ensure_default_model()
    text = str(arg)
    path = Path(text).expanduser()
    if path.exists() or text.lower().endswith(".gguf"):
        return path
    spec = parse_spec(text)
    if spec is not None:
        try:
            found = find_pulled(spec)
        except PullError as e:
            raise ModelNotFoundError(str(e)) from e
        if found is not None:
            return found
        raise ModelNotFoundError(
            f"{spec} is not pulled yet (nor a file): `forecache pull {spec}` downloads it "
            f"from the Hugging Face hub into {model_dir()}")
    if os.sep in text:
        return path
    entries = catalog()
    entry = entries.get(text) or entries.get(text.lower())
    if entry is not None:
        found = find_in_model_dir(entry)
        if found is not None:
            return found
        if entry.hf_repo:
            raise ModelNotFoundError(
                f"model {entry.name!r} is not in {model_dir()}: `forecache pull {entry.name}` "
                f"downloads it ({entry.file} from huggingface.co/{entry.hf_repo}), or put that "
                f"file there (FORECACHE_MODEL_DIR sets the directory), or pass "
                f"{setting('model_path', 'PATH')}")
        raise ModelNotFoundError(
            f"model {entry.name!r} is not in {model_dir()}: put {entry.file} into that "
            "directory (or set FORECACHE_MODEL_DIR to where it is), or pass "
            f"{setting('model_path', 'PATH')}")
    specs = load_specs()
    if text in specs:
        if text == DEFAULT_PRESET:
            return ensure_tiny_model()
        if not specs[text].writable:
            raise ModelNotFoundError(
                f"{text!r} is a shape for the simulator, not a published model, and make-model "
                f"does not write its architecture ({specs[text].arch}): pass "
                f"{setting('model_path', 'PATH')} to a GGUF of it")
        dest = model_dir() / f"{text}-random-q4_k.gguf"
        if specs[text].is_dense:
            raise ModelNotFoundError(
                f"{text!r} is a dense draft's shape, not a MoE model: make one with "
                f"`forecache make-model {dest} --preset {text} --type q4_k` and pass "
                f"{setting('draft', str(dest))} beside a model with its vocabulary")
        raise ModelNotFoundError(
            f"{text!r} is a shape, not a published model: make a random-weight stand-in with "
            f"`forecache make-model {dest} --preset {text} --type q4_k` and pass "
            f"{setting('model_path', str(dest))}")
    raise ModelNotFoundError(f"no model file or name {text!r}; give a GGUF path or one of: "
                             f"{', '.join(known_names())} (`forecache models` lists them)")


def pull_model(text: str, *, directory: Path | None = None, progress: bool | None = None,
               report: Callable[[str], None] | None = None) -> PullResult:
    """Download what ``text`` names (a catalog name of models.yaml, or ``OWNER/REPO[:QUANT]``)
    into the model directory (``directory``: another one). ``progress``: progress bars on,
    off, or None for when stderr is a terminal; ``report``: told one line per file. Raises
    PullError (one line) when it cannot, GGUFError when a downloaded file is not a model."""
    spec = parse_spec(text)
    if spec is not None:
        return pull_repo(spec.repo, spec.quant, directory=directory, progress=progress,
                         report=report)
    entries = catalog()
    entry = entries.get(text) or entries.get(text.lower())
    if entry is None:
        raise PullError(f"{text!r} is neither a hub repo (OWNER/NAME[:QUANT], as on "
                        f"huggingface.co) nor a catalog name ({', '.join(entries)}; "
                        "`forecache models` lists them)")
    if not entry.hf_repo:
        raise PullError(f"catalog model {entry.name!r} names no hf_repo in models.yaml, so "
                        f"there is nothing to pull: put {entry.file} in {model_dir()}")
    return pull_repo(entry.hf_repo, file=entry.file, name=entry.name, directory=directory,
                     progress=progress, report=report)

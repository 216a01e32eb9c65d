"""Downloading published GGUF models from the Hugging Face hub (``forecache pull``), and finding
what was downloaded (``-m OWNER/REPO[:QUANT]``, a catalog name).

Where: a repo's files go to ``model_dir()/OWNER/REPO/``, at their paths in the repo, whether
they were asked for by repo or by catalog name (so the two share one download).

Which: for a catalog name, the catalog's ``file``, or every shard of it where the repo publishes
it split; for ``REPO:QUANT``, the GGUF model whose path contains QUANT, case-insensitively, as
llama.cpp's ``-hf`` picks (a whole word of the name where several contain it); for ``REPO``
alone, its Q4_K_M model, else its only one. A split model (llama.cpp's
``NAME-00001-of-0000N.gguf``) is every one of its shards; a shard missing from the repo is an
error. Vision projectors (``mmproj``) are never the model.

How: each file is downloaded to ``FILE.<sha256>.part`` beside its place, continued from where
it stopped (an HTTP Range request) when a pull was interrupted and is run again, checked
against the sha256 the hub gives for it, and renamed into place only when that matches: a file
under its own name is a complete, checked one. A file that does not match is deleted, so the
next pull downloads it again. huggingface_hub 2.x's own downloaders (``hf_hub_download``) throw
an interrupted download's bytes away (each writes a per-process temporary file and deletes it on
failure), so the transfer is its ``http_get``, which resumes at an offset, under the calls
``hf_hub_download`` makes (``model_info``, ``get_hf_file_metadata``); huggingface_hub reads
HF_ENDPOINT, HF_TOKEN (or a ``hf auth login``) and HF_HUB_OFFLINE. Plain HTTP is used, never the
Xet protocol (whose transfers do not resume).
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from forecache.gguf.header import SPLIT_NAME, split_name
from forecache.paths import model_dir, write_atomic

#: OWNER/NAME[:QUANT], the hub's repo names (as llama.cpp's -hf takes them)
REPO_SPEC = re.compile(r"^([A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95})"
                       r"(?::([A-Za-z0-9][A-Za-z0-9_.+-]{0,63}))?$")
#: a quantization's name within a file name (Q4_K_M, IQ2_XXS, Q8_0, BF16, ...)
QUANT = re.compile(r"(?<![A-Za-z0-9])(I?Q\d+(?:_[A-Za-z0-9]+)*|TQ\d_\d|B?F16|F32|MXFP4(?:_MOE)?)"
                   r"(?![A-Za-z0-9])", re.IGNORECASE)
DEFAULT_QUANT = "Q4_K_M"  # what llama.cpp's -hf takes when no quant is named
RECORD = ".forecache-pulled.json"  # in a repo's directory: the files checked, by sha256
_HASH_CHUNK = 8 << 20


class PullError(OSError):
    """A pull, or a pulled model, that cannot go on; the message is one line saying what to do."""


@dataclass(frozen=True)
class RepoSpec:
    """``OWNER/NAME[:QUANT]``: a hub repo, and which of its GGUF models."""

    repo: str
    quant: str | None = None

    def __str__(self) -> str:
        return f"{self.repo}:{self.quant}" if self.quant else self.repo


def parse_spec(text: str) -> RepoSpec | None:
    """``text`` as ``OWNER/NAME[:QUANT]``, or None when it is not one."""
    m = REPO_SPEC.match(text)
    if m is None or ".." in m.group(1) or "--" in m.group(1):
        return None
    return RepoSpec(m.group(1), m.group(2))


@dataclass(frozen=True)
class RepoModel:
    """One model among a repo's files: a GGUF file, or the shards of a split one."""

    name: str  # its path in the repo: the file's, or a split model's without -0000i-of-0000N
    files: tuple[str, ...]  # the files there are, in shard order
    count: int = 1  # the shards it has (1: one file)
    missing: tuple[str, ...] = ()  # shards that are not there

    @property
    def quant(self) -> str | None:
        """The quantization its name gives (the last one: names often start with a version)."""
        found = QUANT.findall(PurePosixPath(self.name).name)
        return found[-1].upper() if found else None

    @property
    def label(self) -> str:
        """How to name it after ``REPO:``: its quantization, else its file name."""
        return self.quant or PurePosixPath(self.name).name

    def describe(self) -> str:
        """Its label, with its shard count when split."""
        return self.label + (f" ({self.count} shards)" if self.count > 1 else "")


def group_models(paths: Iterable[str]) -> list[RepoModel]:
    """The GGUF models among a repo's file paths, split ones gathered, by name."""
    singles: list[RepoModel] = []
    splits: dict[tuple[str, str, int], dict[int, str]] = {}
    for p in paths:
        pp = PurePosixPath(p)
        if pp.suffix.lower() != ".gguf" or "mmproj" in pp.name.lower():
            continue
        m = SPLIT_NAME.match(pp.name)
        if m and 1 <= int(m.group(2)) <= int(m.group(3)):
            splits.setdefault((str(pp.parent), m.group(1), int(m.group(3))), {})[
                int(m.group(2))] = p
        else:
            singles.append(RepoModel(p, (p,)))
    models = singles
    for (parent, prefix, count), shards in splits.items():
        name = str(PurePosixPath(parent, f"{prefix}.gguf"))
        missing = tuple(str(PurePosixPath(parent, split_name(prefix, i - 1, count)))
                        for i in range(1, count + 1) if i not in shards)
        models.append(RepoModel(name, tuple(shards[i] for i in sorted(shards)), count, missing))
    return sorted(models, key=lambda m: m.name.lower())


def pick(models: list[RepoModel], quant: str | None) -> list[RepoModel]:
    """The models ``quant`` names, as llama.cpp's -hf picks: those whose path contains it,
    case-insensitively, narrowed to those holding it as a whole word where several do. No
    quant: the Q4_K_M model(s), else every model (one: the choice; more: ambiguous)."""
    if quant is None:
        return pick(models, DEFAULT_QUANT) or models
    q = quant.lower()
    found = [m for m in models if q in m.name.lower()]
    if len(found) > 1:
        word = re.compile(rf"(?<![a-z0-9]){re.escape(q)}(?![a-z0-9_])")
        found = [m for m in found if word.search(m.name.lower())] or found
    return found


def catalog_model(models: list[RepoModel], file: str) -> RepoModel | None:
    """A catalog entry's model: the file named ``file`` (in any folder of the repo, the
    shallowest first), else the split model whose shards are named after it."""
    low = file.lower()
    named = [m for m in models if PurePosixPath(m.name).name.lower() == low]
    named.sort(key=lambda m: (m.count > 1, m.name.count("/"), m.name))
    return named[0] if named else None


def describe_models(models: list[RepoModel]) -> str:
    """``Q4_K_M, Q8_0 (3 shards)``: for a message listing the choices."""
    return ", ".join(m.describe() for m in models) or "none"


def repo_dir(repo: str, directory: Path | None = None) -> Path:
    """Where ``forecache pull`` puts ``repo``'s files: ``model_dir()/OWNER/NAME``."""
    return (directory or model_dir()).joinpath(*repo.split("/"))


def local_files(folder: Path) -> list[str]:
    """The complete GGUF files under a pulled repo's folder, as paths in the repo."""
    out = []
    for root, dirs, files in os.walk(folder):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        out += [Path(root, f).relative_to(folder).as_posix() for f in files
                if f.lower().endswith(".gguf") and not f.startswith(".")]
    return sorted(out)


def find_pulled(spec: RepoSpec, directory: Path | None = None) -> Path | None:
    """The file to load for ``-m REPO[:QUANT]`` (the first shard of a split model) among what
    ``forecache pull`` downloaded; None when it has not been pulled. Raises PullError when it
    was pulled in part (a shard is missing) or the spec names several pulled models."""
    folder = repo_dir(spec.repo, directory)
    found = pick(group_models(local_files(folder)), spec.quant)
    if not found:
        return None
    if len(found) > 1:
        raise PullError(f"{len(found)} models of {spec} are pulled in {folder} "
                        f"({describe_models(found)}): name one, as in "
                        f"`-m {spec.repo}:{found[0].label}`")
    model = found[0]
    if model.missing:
        raise PullError(f"{spec} is pulled only in part ({model.missing[0]} is missing from "
                        f"{folder}): `forecache pull {spec}` finishes it")
    return folder / model.files[0]


def find_catalog_pulled(repo: str, file: str, directory: Path | None = None) -> Path | None:
    """The file to load for a catalog entry (repo ``repo``, file ``file``) that ``forecache
    pull`` downloaded: ``file``, or the first of its shards when all of them are there."""
    folder = repo_dir(repo, directory)
    model = catalog_model(group_models(local_files(folder)), file)
    if model is None or model.missing:
        return None
    return folder / model.files[0]


def pulled_models(directory: Path | None = None) -> list[tuple[str, Path]]:
    """Every complete model ``forecache pull`` downloaded: (what ``-m`` takes, its file)."""
    root = directory or model_dir()
    out = []
    for owner in sorted(_subdirs(root)):
        for repo in sorted(_subdirs(owner)):
            models = [m for m in group_models(local_files(repo)) if not m.missing]
            for m in models:
                spec = f"{owner.name}/{repo.name}"
                if len(models) > 1 or m.quant:
                    spec += f":{m.label}"
                out.append((spec, repo / m.files[0]))
    return out


def _subdirs(folder: Path) -> list[Path]:
    try:
        return [p for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".")]
    except OSError:
        return []


# --- downloading ---------------------------------------------------------------------------

@dataclass
class PullResult:
    """What a pull downloaded: the model's files in order, and what ``-m`` takes for it."""

    repo: str
    model_arg: str  # what -m takes: the catalog name, or REPO:QUANT
    files: list[Path]
    downloaded: int = 0  # bytes transferred by this pull
    fetched: list[Path] = field(default_factory=list)  # files this pull downloaded (whole or rest)

    @property
    def path(self) -> Path:
        """The file llama.cpp is given: the model, or its first shard."""
        return self.files[0]


def pull_repo(repo: str, quant: str | None = None, *, file: str | None = None,
              name: str | None = None, directory: Path | None = None,
              progress: bool | None = None,
              report: Callable[[str], None] | None = None) -> PullResult:
    """Download ``repo``'s model that ``quant`` names (or, for catalog entry ``name``, its
    ``file``) into ``repo_dir(repo, directory)``: every shard, resuming partial downloads, each
    file checked against the hub's sha256, then the model's GGUF header. See :func:`pull`."""
    from huggingface_hub import HfApi, constants

    from forecache.gguf.header import read_model_file

    say = report or (lambda line: None)
    asked = name or str(RepoSpec(repo, quant))
    if constants.HF_HUB_OFFLINE:
        raise PullError(f"HF_HUB_OFFLINE is set, so forecache pull cannot reach the hub: unset "
                        f"it to download {asked} (what is pulled already needs no network)")
    with _hub_errors(repo, None):
        info = HfApi().model_info(repo, files_metadata=True)
    siblings = {s.rfilename: s for s in info.siblings or []}
    models = group_models(siblings)
    model = _choose(repo, models, quant, file, name)
    folder = repo_dir(repo, directory)
    for f in model.files:
        parts = PurePosixPath(f).parts
        if PurePosixPath(f).is_absolute() or any(p.startswith(".") for p in parts):
            raise PullError(f"{repo} lists a file named {f!r}, which forecache will not write "
                            f"outside {folder}")
    folder.mkdir(parents=True, exist_ok=True)
    records = _read_records(folder)
    todo = []
    for f in model.files:
        s = siblings[f]
        sha = s.lfs.sha256 if s.lfs is not None else None
        size = s.lfs.size if s.lfs is not None else s.size
        if _already_pulled(folder, f, sha, size, records, progress, say):
            continue
        todo.append((f, sha, size))
    need = sum((size or 0) - _part_size(folder, f, sha) for f, sha, size in todo)
    free = shutil.disk_usage(folder).free
    if need > free:
        raise PullError(f"{asked} needs {human_size(need)} more in {folder}, which has "
                        f"{human_size(free)} free: make room, or set FORECACHE_MODEL_DIR to a "
                        "disk with room")
    result = PullResult(repo, name or f"{repo}:{quant or model.label}",
                        [folder / f for f in model.files])
    bad = []
    for f, sha, size in todo:
        got, sha, size = _download(repo, info.sha or "main", folder, f, sha, size, asked,
                                   progress, say)
        result.downloaded += got
        result.fetched.append(folder / f)
        if not _check(folder, f, sha, size, records, progress):
            bad.append(f)
            continue
        say(f"{f}: downloaded and checked")
    if bad:
        raise PullError(f"{bad[0]}{f' (and {len(bad) - 1} more)' if len(bad) > 1 else ''} of "
                        f"{repo} did not match the hub's sha256 (the download was damaged) and "
                        f"is removed; the other files are kept: re-run `forecache pull {asked}`")
    read_model_file(result.path)  # the whole model: every shard's header, as llama.cpp reads it
    return result


def _choose(repo: str, models: list[RepoModel], quant: str | None, file: str | None,
            name: str | None) -> RepoModel:
    """The model to pull, or a PullError saying what the repo has."""
    if not models:
        raise PullError(f"{repo} has no GGUF model files: forecache runs GGUF models "
                        "(llama.cpp's format); look for the model's -GGUF repo")
    if file is not None:
        chosen = catalog_model(models, file)
        if chosen is None:
            raise PullError(f"{repo} has no {file} (whole or split) for catalog model {name!r}; "
                            f"it has {describe_models(models)}: pull one as "
                            f"`forecache pull {repo}:QUANT`")
    else:
        found = pick(models, quant)
        if not found:
            raise PullError(f"{repo} has no GGUF model matching {quant!r}; it has "
                            f"{describe_models(models)}: `forecache pull {repo}:QUANT`")
        if len(found) > 1:
            which = f" matching {quant!r}" if quant else f" and no {DEFAULT_QUANT} to default to"
            raise PullError(f"{repo} has {len(found)} GGUF models{which} "
                            f"({describe_models(found)}): name one, as in "
                            f"`forecache pull {repo}:{found[0].label}`")
        chosen = found[0]
    if chosen.missing:
        raise PullError(f"{repo} lacks {chosen.missing[0]} ({len(chosen.missing)} of the "
                        f"{chosen.count} shards of {chosen.name} are missing), so the model "
                        "cannot be pulled whole")
    return chosen


def _part(folder: Path, f: str, sha: str | None) -> Path:
    """Where ``f`` downloads to until it is complete and checked (named by its sha256, so bytes
    of another version of the file are never continued)."""
    return folder / f"{f}.{(sha or 'unchecked')[:16]}.part"


def _part_size(folder: Path, f: str, sha: str | None) -> int:
    p = _part(folder, f, sha)
    return p.stat().st_size if p.is_file() else 0


def _read_records(folder: Path) -> dict[str, Any]:
    try:
        records = json.loads((folder / RECORD).read_text())
    except (OSError, ValueError):
        return {}
    return records if isinstance(records, dict) else {}


def _record(folder: Path, f: str, sha: str | None, records: dict[str, Any]) -> None:
    """Remember that ``f`` as it is now has sha256 ``sha`` (no need to read it again)."""
    st = (folder / f).stat()
    records[f] = {"sha256": sha, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    write_atomic(folder / RECORD, json.dumps(records, indent=1, sort_keys=True) + "\n")


def _already_pulled(folder: Path, f: str, sha: str | None, size: int | None,
                    records: dict[str, Any], progress: bool | None,
                    say: Callable[[str], None]) -> bool:
    """Whether ``f`` is in place and is the hub's file: recorded as checked, or read again."""
    path = folder / f
    if not path.is_file():
        return False
    st = path.stat()
    if size is not None and st.st_size != size:
        return False
    rec = records.get(f)
    if sha is not None and isinstance(rec, dict) and rec.get("sha256") == sha and \
            rec.get("size") == st.st_size and rec.get("mtime_ns") == st.st_mtime_ns:
        say(f"{f}: already pulled")
        return True
    if sha is not None and file_sha256(path, progress, f"checking {path.name}") != sha:
        return False  # another version of the file (or a damaged one): downloaded again
    _record(folder, f, sha, records)
    say(f"{f}: already pulled")
    return True


def _check(folder: Path, f: str, sha: str | None, size: int | None, records: dict[str, Any],
           progress: bool | None) -> bool:
    """Check ``f``'s downloaded bytes against the hub's sha256 and size: put it in place and
    record it when they match, delete it when not."""
    part = _part(folder, f, sha)
    ok = size is None or part.stat().st_size == size
    if ok and sha is not None:
        ok = file_sha256(part, progress, f"checking {PurePosixPath(f).name}") == sha
    if not ok:
        part.unlink(missing_ok=True)
        return False
    os.replace(part, folder / f)
    _record(folder, f, sha, records)
    return True


def _download(repo: str, revision: str, folder: Path, f: str, sha: str | None,
              size: int | None, asked: str, progress: bool | None,
              say: Callable[[str], None]) -> tuple[int, str | None, int | None]:
    """Download ``f`` of ``repo`` at ``revision`` to its part file, continuing what an earlier
    pull left there. Returns the bytes transferred, and the file's sha256 and size (the hub's
    file metadata fills in what its listing did not give). Interrupted, the part file keeps
    what arrived."""
    from huggingface_hub import __version__ as hub_version
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.file_download import http_get
    from huggingface_hub.utils import build_hf_headers

    from forecache.version import __version__

    url = hf_hub_url(repo, f, revision=revision)
    with _hub_errors(repo, f):
        meta = get_hf_file_metadata(url)  # a gated repo answers here
    size = size if size is not None else meta.size
    if sha is None and meta.etag and re.fullmatch(r"[0-9a-f]{64}", meta.etag):
        sha = meta.etag  # an LFS file's ETag is its sha256
    part = _part(folder, f, sha)
    part.parent.mkdir(parents=True, exist_ok=True)
    for stale in glob.glob(glob.escape(str(folder / f)) + ".*.part"):
        if Path(stale) != part:
            Path(stale).unlink(missing_ok=True)  # bytes of another version of the file
    done = part.stat().st_size if part.is_file() else 0
    if size is not None and done > size:
        done = 0
    total = human_size(size) if size is not None else "? bytes"
    say(f"{f}: resuming at {human_size(done)} of {total}" if done else
        f"{f}: downloading {total}")
    headers = build_hf_headers(library_name="forecache", library_version=__version__,
                               user_agent={"huggingface_hub": hub_version})
    with open(part, "r+b" if done else "wb") as fh:
        fh.truncate(done)
        fh.seek(done)
        with _hub_errors(repo, f, asked):
            # the resolve URL, not the signed address it redirects to: a retry after a long
            # transfer is redirected afresh
            http_get(url, fh, resume_size=done, headers=headers, expected_size=size,
                     displayed_filename=PurePosixPath(f).name, tqdm_class=_bar_class(progress))
        return fh.tell() - done, sha, size


def _bar_class(progress: bool | None) -> Any:
    """huggingface_hub's progress bar, forced on or off (None: its own choice, which is on
    when the output is a terminal)."""
    if progress is None:
        return None
    from huggingface_hub.utils import tqdm as hub_tqdm

    class Bar(hub_tqdm):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["disable"] = not progress
            super().__init__(*args, **kwargs)

    return Bar


def human_size(n: int) -> str:
    """``n`` bytes for a reader: 1.2 MB, 34.70 GB."""
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def file_sha256(path: Path, progress: bool | None = False, desc: str = "") -> str:
    """The sha256 of ``path``'s bytes, in hex (with a progress bar when ``progress``; None:
    when stderr is a terminal)."""
    from tqdm import tqdm

    h = hashlib.sha256()
    with open(path, "rb") as fh, tqdm(total=path.stat().st_size, unit="B", unit_scale=True,
                                      desc=desc, leave=False,
                                      disable=None if progress is None else not progress) as bar:
        while chunk := fh.read(_HASH_CHUNK):
            h.update(chunk)
            bar.update(len(chunk))
    return h.hexdigest()


@contextlib.contextmanager
def _hub_errors(repo: str, file: str | None, asked: str | None = None) -> Iterator[None]:
    """The hub's and the network's errors as one-line PullErrors saying what to do."""
    import httpx2
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        OfflineModeIsEnabled,
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    endpoint = constants.ENDPOINT
    what = f"{file} of {repo}" if file else repo
    again = f"; re-run `forecache pull {asked}` to continue where it stopped" if asked else ""
    try:
        yield
    except OfflineModeIsEnabled as e:
        raise PullError(f"HF_HUB_OFFLINE is set, so forecache pull cannot reach the hub: "
                        f"unset it to download {repo}") from e
    except GatedRepoError as e:
        raise PullError(f"{repo} is gated: accept its terms at {endpoint}/{repo} and log in "
                        "here with `hf auth login` (or set HF_TOKEN) as that account") from e
    except RepositoryNotFoundError as e:
        raise PullError(f"no model repo {repo} on {endpoint} (or it is private: log in with "
                        "`hf auth login`, or set HF_TOKEN)") from e
    except (RemoteEntryNotFoundError, RevisionNotFoundError) as e:
        raise PullError(f"{what} is no longer on {endpoint}: the repo changed while pulling; "
                        "run `forecache pull` again") from e
    except HfHubHTTPError as e:
        status = e.response.status_code if e.response is not None else "?"
        raise PullError(f"{endpoint} answered HTTP {status} for {what}: try again later"
                        f"{again}") from e
    except httpx2.HTTPError as e:
        detail = str(e).splitlines()[0] if str(e) else "no answer"
        raise PullError(f"cannot reach {endpoint} for {what} ({type(e).__name__}: {detail}): "
                        f"check the network (and HF_ENDPOINT){again}") from e
    except OSError as e:
        if type(e) is OSError and e.errno is None:  # huggingface_hub's size check
            raise PullError(f"the download of {what} ended early ({str(e).splitlines()[0]})"
                            f"{again}") from e
        raise

#!/usr/bin/env python3
"""Build the reproducible training corpus for the reference MoE language model.

The corpus mixes three permissively licensed / public-domain sources that Debian ships:

* ``bible``  -- King James Bible text from ``bible-kjv-text`` (public domain), one document
  per chapter;
* ``pydocs`` -- the Python HTML documentation from ``python3.X-doc`` (PSF License v2, code
  examples additionally 0BSD), converted to plain text, one document per page;
* ``stdlib`` -- the ``.py`` files of the Debian Python standard library packages
  (PSF License v2), one document per file.

Usage::

    python tools/reference_model/corpus.py --out DIR [--max-mb 40] [--seed 0] [--install]

Outputs ``DIR/train.txt``, ``DIR/valid.txt`` (documents separated by a line holding only
``<|endoftext|>``) and ``DIR/manifest.json`` (sources, licenses, package versions, counts,
sha256 of each output).  The same packages, arguments and seed give byte-identical files.
Only the standard library is used; it runs on Debian 12 (bookworm) or a derivative.
"""

from __future__ import annotations

import argparse
import hashlib
import html.parser
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import unicodedata
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

EOT = "<|endoftext|>"
# The tokenizer's special tokens; a document containing one would be mis-tokenized.
RESERVED = (EOT, "<|im_start|>", "<|im_end|>")
FORMAT_VERSION = 1
MIN_DOC_BYTES = 200
MAX_CODE_FILE_BYTES = 200 * 1024
VALID_FRACTION = 0.02
DEFAULT_PY_SERIES = "3.11"  # Debian 12's only CPython; the -doc package must match the stdlib

# Documentation sections taken from the HTML tree (others are changelogs, C API, indexes).
DOC_SECTIONS = ("library", "tutorial", "howto", "reference")

# Path components that exclude a stdlib file (test suites, IDLE, third-party trees, caches).
STDLIB_EXCLUDED_PARTS = frozenset(
    {"test", "tests", "idlelib", "site-packages", "dist-packages", "__pycache__"}
)

# Target share of --max-mb per source, by bytes.
WEIGHTS = {"bible": 0.35, "pydocs": 0.30, "stdlib": 0.35}

# Book abbreviations used in bible.data, in canonical order, with display names.
BIBLE_BOOKS = {
    "Ge": "Genesis", "Exo": "Exodus", "Lev": "Leviticus", "Num": "Numbers",
    "Deu": "Deuteronomy", "Josh": "Joshua", "Jdgs": "Judges", "Ruth": "Ruth",
    "1Sm": "1 Samuel", "2Sm": "2 Samuel", "1Ki": "1 Kings", "2Ki": "2 Kings",
    "1Chr": "1 Chronicles", "2Chr": "2 Chronicles", "Ezra": "Ezra", "Neh": "Nehemiah",
    "Est": "Esther", "Job": "Job", "Psa": "Psalms", "Prv": "Proverbs",
    "Eccl": "Ecclesiastes", "SSol": "Song of Solomon", "Isa": "Isaiah", "Jer": "Jeremiah",
    "Lam": "Lamentations", "Eze": "Ezekiel", "Dan": "Daniel", "Hos": "Hosea",
    "Joel": "Joel", "Amos": "Amos", "Obad": "Obadiah", "Jonah": "Jonah", "Mic": "Micah",
    "Nahum": "Nahum", "Hab": "Habakkuk", "Zep": "Zephaniah", "Hag": "Haggai",
    "Zec": "Zechariah", "Mal": "Malachi", "Mat": "Matthew", "Mark": "Mark", "Luke": "Luke",
    "John": "John", "Acts": "Acts", "Rom": "Romans", "1Cor": "1 Corinthians",
    "2Cor": "2 Corinthians", "Gal": "Galatians", "Eph": "Ephesians", "Phi": "Philippians",
    "Col": "Colossians", "1Th": "1 Thessalonians", "2Th": "2 Thessalonians",
    "1Tim": "1 Timothy", "2Tim": "2 Timothy", "Titus": "Titus", "Phmn": "Philemon",
    "Heb": "Hebrews", "Jas": "James", "1Pet": "1 Peter", "2Pet": "2 Peter",
    "1Jn": "1 John", "2Jn": "2 John", "3Jn": "3 John", "Jude": "Jude", "Rev": "Revelation",
}
_VERSE_RE = re.compile(r"^([1-3]?[A-Za-z]+)(\d+):(\d+) (.*)$")


class CorpusError(RuntimeError):
    """A problem the user must fix (missing package, unexpected file format, ...)."""


def log(msg: str) -> None:
    """Print a progress line to stderr (stdout stays free for piping)."""
    print(f"[corpus] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------
# Debian packages


@dataclass(frozen=True)
class SourceSpec:
    """Static description of one corpus source: packages, license and where it is stated."""

    name: str
    kind: str
    packages: tuple[str, ...]
    license: str
    copyright_files: tuple[str, ...]
    # Verbatim statements the builder checks are present (whitespace-normalised) in
    # statement_file, so a changed license in a new package version stops the build.
    statements: tuple[str, ...]
    statement_file: str
    notes: str = ""


def source_specs(py: str) -> list[SourceSpec]:
    """Return the three source descriptions for CPython series ``py`` (e.g. ``"3.11"``)."""
    psf_header = "PYTHON SOFTWARE FOUNDATION LICENSE VERSION 2"
    return [
        SourceSpec(
            name="bible",
            kind="English prose",
            packages=("bible-kjv-text",),
            license="Public domain (King James Version, 1611; copyright expired)",
            copyright_files=("/usr/share/doc/bible-kjv-text/copyright",),
            statements=(
                "The copyright for the King James Version text of the Bible is expired since "
                "the translation was done in 1611 under King James the first of Great Britain.",
            ),
            statement_file="/usr/share/doc/bible-kjv-text/copyright",
            notes=(
                "Only the Bible text (/usr/lib/bible.data) is used; the package's programs are "
                "GPL-2+ and are not used. The file is decoded by this script (block-wise "
                "LZW, compress(1) format), verse references are removed."
            ),
        ),
        SourceSpec(
            name="pydocs",
            kind="English technical prose with code examples",
            packages=(f"python{py}-doc",),
            license="PSF-2.0 (Python Software Foundation License Version 2); code examples "
            "in the documentation additionally 0BSD (Zero Clause BSD)",
            copyright_files=(f"/usr/share/doc/python{py}-doc/copyright",),
            statements=(
                "This page is licensed under the Python Software Foundation License Version 2.",
                "Examples, recipes, and other code in the documentation are additionally "
                "licensed under the Zero Clause BSD License.",
            ),
            statement_file=f"/usr/share/doc/python{py}/html/copyright.html",
            notes=(
                f"The Debian copyright file ({f'/usr/share/doc/python{py}-doc/copyright'}) "
                "reproduces the Python license (PSF License Agreement Version 2 and the "
                "historical BeOpen/CNRI/CWI licenses); every HTML page footer carries the "
                "statements recorded here. Sections used: " + ", ".join(DOC_SECTIONS) + "."
            ),
        ),
        SourceSpec(
            name="stdlib",
            kind="Python source code",
            packages=(
                f"libpython{py}-minimal",
                f"libpython{py}-stdlib",
                "python3-distutils",
                "python3-lib2to3",
            ),
            license="PSF-2.0 (Python Software Foundation License Version 2)",
            copyright_files=(
                f"/usr/share/doc/libpython{py}-minimal/copyright",
                "/usr/share/doc/python3-distutils/copyright",
                "/usr/share/doc/python3-lib2to3/copyright",
                f"/usr/lib/python{py}/LICENSE.txt",
            ),
            statements=(psf_header,),
            statement_file=f"/usr/lib/python{py}/LICENSE.txt",
            notes=(
                f"Files are the .py files under /usr/lib/python{py} owned by the listed "
                "packages (dpkg -L), so a locally installed interpreter does not change the "
                "corpus. Excluded: test/, tests/, idlelib/, site-packages, dist-packages, "
                f"__pycache__, files over {MAX_CODE_FILE_BYTES} bytes, files that are not "
                "valid UTF-8. A few modules carry additional permissive notices listed in "
                "the Debian copyright file."
            ),
        ),
    ]


def installed_version(package: str) -> str | None:
    """Return the installed Debian version of ``package``, or None when not installed."""
    try:
        res = subprocess.run(
            ["dpkg-query", "-W", "-f=${Status}\t${Version}", package],
            capture_output=True, text=True, check=False,
        )
    except FileNotFoundError as exc:
        raise CorpusError("dpkg-query not found: this builder needs Debian packages") from exc
    if res.returncode != 0:
        return None
    status, _, version = res.stdout.partition("\t")
    return version if status.endswith(" installed") else None


def ensure_packages(packages: Iterable[str], install: bool) -> dict[str, str]:
    """Return {package: version}; install missing ones with apt-get or stop with the command."""
    wanted = list(dict.fromkeys(packages))
    missing = [p for p in wanted if installed_version(p) is None]
    if missing:
        cmd = ["apt-get", "install", "-y", *missing]
        if not install:
            raise CorpusError(
                "missing Debian packages: " + " ".join(missing) + "\nrun:\n  " + " ".join(cmd)
                + "\n(or rerun this script as root with --install)"
            )
        if os.geteuid() != 0:
            raise CorpusError("--install needs root; run:\n  sudo " + " ".join(cmd))
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        log("installing: " + " ".join(missing))
        if subprocess.run(cmd, env=env, check=False).returncode != 0:
            # A stale package index is the usual cause; refresh once and retry.
            subprocess.run(["apt-get", "update"], env=env, check=False)
            if subprocess.run(cmd, env=env, check=False).returncode != 0:
                raise CorpusError("apt-get failed: " + " ".join(cmd))
        still = [p for p in wanted if installed_version(p) is None]
        if still:
            raise CorpusError("still not installed after apt-get: " + " ".join(still))
    return {p: str(installed_version(p)) for p in wanted}


def package_files(package: str) -> list[str]:
    """Return the paths ``dpkg -L`` lists for an installed package, sorted."""
    res = subprocess.run(["dpkg", "-L", package], capture_output=True, text=True, check=True)
    return sorted(line for line in res.stdout.splitlines() if line.startswith("/"))


def verify_statements(spec: SourceSpec) -> None:
    """Fail unless the license statements recorded for ``spec`` appear in its source files."""
    for path in (*spec.copyright_files, spec.statement_file):
        if not Path(path).is_file():
            raise CorpusError(f"{spec.name}: license file missing: {path}")
    text = " ".join(Path(spec.statement_file).read_text(encoding="utf-8").split())
    for statement in spec.statements:
        if " ".join(statement.split()) not in text:
            raise CorpusError(
                f"{spec.name}: license statement not found in {spec.statement_file} "
                f"(package changed? re-check the license): {statement!r}"
            )


# --------------------------------------------------------------------------------------------
# Text normalisation


_BLANKS_RE = re.compile(r"\n{4,}")  # 3+ blank lines


def normalise(text: str) -> str:
    """NFC, LF line ends, no trailing spaces, at most 2 blank lines in a row, one final LF."""
    text = unicodedata.normalize("NFC", text).replace("\r\n", "\n").replace("\r", "\n")
    text = "\n".join(line.rstrip() for line in text.split("\n"))
    text = _BLANKS_RE.sub("\n\n\n", text).strip("\n")
    return text + "\n" if text else ""


# --------------------------------------------------------------------------------------------
# Source 1: King James Bible (bible-kjv-text)


def unlzw(data: bytes, maxbits: int = 16) -> bytes:
    """Decode a headerless compress(1) LZW stream (block mode) like ncompress does.

    bible-kjv-text stores its text as independently compressed 64 KiB blocks; Python's
    standard library has no LZW decoder, hence this small one.
    """
    total_bits = len(data) * 8
    bits = int.from_bytes(data, "little")  # codes are packed LSB-first
    maxmaxcode = 1 << maxbits
    prefix = [0] * maxmaxcode
    suffix = list(range(256)) + [0] * (maxmaxcode - 256)
    n_bits, maxcode, free_ent = 9, 511, 257
    section_start = pos = 0
    oldcode, finchar = -1, 0
    out = bytearray()

    def align(p: int, start: int, width: int) -> int:
        # compress(1) writes codes in groups of `width` bytes; a width change or CLEAR skips
        # the rest of the current group.
        group = width * 8
        return start + -(-(p - start) // group) * group

    while pos + n_bits <= total_bits:
        if free_ent > maxcode:
            pos = section_start = align(pos, section_start, n_bits)
            n_bits += 1
            maxcode = maxmaxcode if n_bits == maxbits else (1 << n_bits) - 1
            continue
        code = (bits >> pos) & ((1 << n_bits) - 1)
        pos += n_bits
        if oldcode == -1:
            if code >= 256:
                raise CorpusError("bible.data: corrupt LZW stream (bad first code)")
            out.append(code)
            oldcode = finchar = code
            continue
        if code == 256:  # CLEAR
            free_ent = 256
            pos = section_start = align(pos, section_start, n_bits)
            n_bits, maxcode = 9, 511
            continue
        incode = code
        stack = bytearray()
        if code >= free_ent:  # the KwKwK case
            if code > free_ent:
                raise CorpusError("bible.data: corrupt LZW stream")
            stack.append(finchar)
            code = oldcode
        while code >= 256:
            stack.append(suffix[code])
            code = prefix[code]
        finchar = code
        stack.append(code)
        stack.reverse()
        out += stack
        if free_ent < maxmaxcode:
            prefix[free_ent] = oldcode
            suffix[free_ent] = finchar
            free_ent += 1
        oldcode = incode
    return bytes(out)


def read_bible_data(path: Path) -> str:
    """Decode ``bible.data`` (BRS "EC02" block-compressed format) to its plain text."""
    raw = path.read_bytes()
    if not raw.startswith(b"EC02"):
        raise CorpusError(f"{path}: unknown format (expected 'EC02' magic)")
    # Header: 4-byte magic, description, then at 84: block size and block count (big-endian),
    # followed by count+1 block offsets; the first offset skips the 3-byte compress header.
    block_size = int.from_bytes(raw[84:88], "big")
    count = int.from_bytes(raw[88:92], "big")
    offsets = [int.from_bytes(raw[92 + 4 * i:96 + 4 * i], "big") for i in range(count + 1)]
    if offsets[-1] != len(raw) or raw[offsets[0] - 3:offsets[0] - 1] != b"\x1f\x9d":
        raise CorpusError(f"{path}: unexpected block table")
    maxbits = raw[offsets[0] - 1] & 0x1F
    blocks = []
    for i in range(count):
        block = unlzw(raw[offsets[i]:offsets[i + 1]], maxbits)
        if i < count - 1 and len(block) != block_size:
            raise CorpusError(f"{path}: block {i} decoded to {len(block)} bytes")
        blocks.append(block)
    return b"".join(blocks).decode("ascii")


def bible_documents(data_file: Path) -> Iterator[tuple[str, str]]:
    """Yield (doc id, text) per chapter: a "Book N" heading, then one verse per line."""
    chapters: dict[tuple[str, int], list[str]] = {}
    lines = read_bible_data(data_file).splitlines()
    if not lines[0].startswith("Holy Bible"):
        raise CorpusError(f"{data_file}: unexpected first line {lines[0]!r}")
    for line in lines[1:]:
        m = _VERSE_RE.match(line)
        if not m or m.group(1) not in BIBLE_BOOKS:
            raise CorpusError(f"{data_file}: unexpected verse line {line[:60]!r}")
        # Drop the "Ge1:1" reference; the text itself carries no other markup.
        chapters.setdefault((m.group(1), int(m.group(2))), []).append(m.group(4).strip())
    order = {abbr: i for i, abbr in enumerate(BIBLE_BOOKS)}
    for (abbr, chap), verses in sorted(chapters.items(), key=lambda kv: (order[kv[0][0]],
                                                                        kv[0][1])):
        title = "Psalm" if abbr == "Psa" else BIBLE_BOOKS[abbr]
        yield f"{abbr}.{chap:03d}", f"{title} {chap}\n\n" + "\n".join(verses) + "\n"


# --------------------------------------------------------------------------------------------
# Source 2: Python documentation HTML (python3.X-doc)


_VOID_TAGS = frozenset(
    {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "param",
     "source", "track", "wbr"}
)
_SKIP_TAGS = frozenset(
    {"script", "style", "noscript", "template", "svg", "form", "button", "select", "textarea"}
)
# Sphinx classes of navigation inside the page body: pilcrow links, toctrees, local
# "Contents" boxes.  Sidebars, header and footer are outside the main body and never emitted.
_SKIP_CLASSES = frozenset(
    {"headerlink", "toctree-wrapper", "contents", "sphinxsidebar", "related", "footer",
     "linenos", "copybutton"}
)
_BLOCK_TAGS = frozenset(
    {"address", "article", "aside", "blockquote", "caption", "center", "dd", "details", "div",
     "dl", "dt", "figcaption", "figure", "footer", "h1", "h2", "h3", "h4", "h5", "h6",
     "header", "main", "nav", "p", "section", "summary", "table", "tbody", "tfoot", "thead"}
)


class _Element:
    """An open HTML element and what closing it must undo."""

    __slots__ = ("tag", "is_main", "is_skip")

    def __init__(self, tag: str, is_main: bool, is_skip: bool) -> None:
        self.tag, self.is_main, self.is_skip = tag, is_main, is_skip


class SphinxText(html.parser.HTMLParser):
    """Convert a Sphinx HTML page to plain text, keeping only the main body.

    Headings, paragraphs, definition terms and list items become paragraphs / lines,
    ``<pre>`` blocks keep their newlines, table rows become ``cell | cell`` lines.
    """

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self._stack: list[_Element] = []
        self._main = 0
        self._skip = 0
        self._out: list[str] = []
        self._inline: list[str] = []
        self._pre: list[str] = []
        self._pre_depth = 0
        self._lists: list[list[int]] = []  # [is_ordered, counter] per open list
        self._li_prefix: str | None = None
        self._row: list[str] | None = None
        self._in_cell = False

    # -- output helpers

    def _active(self) -> bool:
        """True inside the main body and outside any skipped subtree."""
        return self._main > 0 and self._skip == 0

    def _ensure_newlines(self, n: int) -> None:
        """Make the output end in at least ``n`` newlines (blank line = 2)."""
        if not self._out:
            return
        tail = "".join(self._out[-3:])
        have = len(tail) - len(tail.rstrip("\n"))
        if have < n:
            self._out.append("\n" * (n - have))

    def _emit(self, text: str, tight: bool) -> None:
        """Append a block: list items and table rows are tight, others get blank lines."""
        self._ensure_newlines(1 if tight else 2)
        self._out.append(text + "\n")
        if not tight:
            self._out.append("\n")

    def _flush(self) -> None:
        """Emit the pending inline text as one whitespace-collapsed paragraph or item."""
        if self._in_cell:  # cells gather all their text on one line
            self._inline.append(" ")
            return
        text = " ".join("".join(self._inline).split())
        self._inline.clear()
        if not text:
            return
        in_list = bool(self._lists)
        if self._li_prefix is not None:
            text, self._li_prefix = self._li_prefix + text, None
        elif in_list:
            text = "  " * len(self._lists) + text
        self._emit(text, tight=in_list)

    # -- parser callbacks

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        """Track nesting, detect the main body and skipped subtrees, open blocks."""
        a = dict(attrs)
        classes = set((a.get("class") or "").split())
        if tag in _VOID_TAGS:
            if self._active():
                if tag == "br":
                    if self._pre_depth:
                        self._pre.append("\n")
                    else:
                        self._flush()
                elif tag == "hr":
                    self._flush()
            return
        is_main = tag == "div" and "body" in classes and a.get("role") == "main"
        is_skip = tag in _SKIP_TAGS or bool(classes & _SKIP_CLASSES)
        self._stack.append(_Element(tag, is_main, is_skip))
        self._main += is_main
        self._skip += is_skip
        if self._active():
            self._open(tag)

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        """Treat ``<br/>`` like ``<br>``; other self-closed tags carry no text."""
        if tag in _VOID_TAGS:
            self.handle_starttag(tag, attrs)

    def handle_endtag(self, tag: str) -> None:
        """Close elements up to the matching open tag (tolerates unclosed children)."""
        if tag in _VOID_TAGS or all(el.tag != tag for el in self._stack):
            return
        while self._stack:
            el = self._stack.pop()
            if self._active():
                self._close(el.tag)
            self._skip -= el.is_skip
            if el.is_main:
                self._flush()
                self._main -= 1
            if el.tag == tag:
                break

    def handle_data(self, data: str) -> None:
        """Collect text of the main body (verbatim inside ``<pre>``)."""
        if not self._active():
            return
        (self._pre if self._pre_depth else self._inline).append(data)

    def _open(self, tag: str) -> None:
        """Start a block element of the main body."""
        if tag == "pre":
            self._flush()
            self._pre_depth += 1
        elif tag in ("ul", "ol"):
            self._flush()
            self._lists.append([tag == "ol", 0])
        elif tag == "li":
            self._flush()
            indent = "  " * max(len(self._lists) - 1, 0)
            if self._lists and self._lists[-1][0]:
                self._lists[-1][1] += 1
                self._li_prefix = f"{indent}{self._lists[-1][1]}. "
            else:
                self._li_prefix = f"{indent}- "
        elif tag == "tr":
            self._flush()
            self._row = []
        elif tag in ("td", "th"):
            self._inline.clear()
            self._in_cell = True
        elif tag in _BLOCK_TAGS:
            self._flush()

    def _close(self, tag: str) -> None:
        """End a block element of the main body."""
        if tag == "pre":
            self._pre_depth -= 1
            if self._pre_depth == 0:
                code = "".join(self._pre).strip("\n").rstrip()
                self._pre.clear()
                if code:
                    if self._in_cell:
                        self._inline.append(" " + " ".join(code.split()) + " ")
                    else:
                        self._emit(code, tight=False)
        elif tag in ("td", "th"):
            cell = " ".join("".join(self._inline).split())
            self._inline.clear()
            self._in_cell = False
            if self._row is not None:
                self._row.append(cell)
        elif tag == "tr":
            row, self._row = self._row or [], None
            if any(row):
                self._emit(" | ".join(row), tight=True)
        elif tag in ("ul", "ol"):
            self._flush()
            self._lists.pop()
            self._li_prefix = None
            if not self._lists:
                self._ensure_newlines(2)
        elif tag == "li":
            self._flush()
            self._li_prefix = None
        elif tag == "table":
            self._flush()
            self._ensure_newlines(2)
        elif tag in _BLOCK_TAGS:
            self._flush()

    def text(self) -> str:
        """Return the text gathered so far (call after :meth:`close`)."""
        self._flush()
        return "".join(self._out)


def html_to_text(markup: str) -> str:
    """Return the plain text of a Sphinx page's main body."""
    parser = SphinxText()
    parser.feed(markup)
    parser.close()
    return parser.text()


def doc_documents(html_root: Path) -> Iterator[tuple[str, str]]:
    """Yield (relative path, text) for each HTML page of the chosen documentation sections."""
    for section in DOC_SECTIONS:
        pages = sorted((html_root / section).rglob("*.html"))
        if not pages:
            raise CorpusError(f"no HTML pages under {html_root / section}")
        for page in pages:
            yield page.relative_to(html_root).as_posix(), html_to_text(
                page.read_text(encoding="utf-8")
            )


# --------------------------------------------------------------------------------------------
# Source 3: Python standard library source (libpython3.X-*, python3-distutils, -lib2to3)


@dataclass
class StdlibScan:
    """Which stdlib files were found, and why some were left out."""

    files: list[Path] = field(default_factory=list)
    per_package: dict[str, int] = field(default_factory=dict)
    excluded_dir: int = 0
    too_big: int = 0
    missing: int = 0


def scan_stdlib(py: str, packages: Iterable[str]) -> StdlibScan:
    """List the stdlib ``.py`` files the packages own, applying the exclusion rules."""
    root = f"/usr/lib/python{py}/"
    scan = StdlibScan()
    seen: set[str] = set()
    for pkg in packages:
        count = 0
        for path in package_files(pkg):
            if not path.startswith(root) or not path.endswith(".py") or path in seen:
                continue
            seen.add(path)
            rel_parts = path[len(root):].split("/")
            if STDLIB_EXCLUDED_PARTS.intersection(rel_parts[:-1]):
                scan.excluded_dir += 1
                continue
            p = Path(path)
            if not p.is_file():  # listed by dpkg but removed locally
                scan.missing += 1
                continue
            if p.stat().st_size > MAX_CODE_FILE_BYTES:
                scan.too_big += 1
                continue
            scan.files.append(p)
            count += 1
        scan.per_package[pkg] = count
    scan.files.sort()
    return scan


# --------------------------------------------------------------------------------------------
# Assembly


@dataclass
class Doc:
    """One normalised document."""

    source: str
    doc_id: str
    text: str
    nbytes: int


@dataclass
class SourceStats:
    """Counts reported in the manifest for one source."""

    candidates: int = 0
    dropped_short: int = 0
    dropped_duplicate: int = 0
    dropped_not_utf8: int = 0
    dropped_special_token: int = 0
    available_docs: int = 0
    available_bytes: int = 0
    budget_bytes: int = 0
    selected_docs: int = 0
    selected_bytes: int = 0
    split: dict[str, dict[str, int]] = field(default_factory=dict)


def collect(
    name: str,
    raw_docs: Iterable[tuple[str, str | None]],
    seen_hashes: set[str],
    stats: SourceStats,
) -> list[Doc]:
    """Normalise, filter and de-duplicate one source's documents (``None`` = not UTF-8)."""
    docs = []
    for doc_id, raw in raw_docs:
        stats.candidates += 1
        if raw is None:
            stats.dropped_not_utf8 += 1
            continue
        text = normalise(raw)
        data = text.encode("utf-8")
        if len(data) < MIN_DOC_BYTES:
            stats.dropped_short += 1
            continue
        if any(tok in text for tok in RESERVED):
            stats.dropped_special_token += 1
            continue
        digest = hashlib.sha256(data).hexdigest()
        if digest in seen_hashes:
            stats.dropped_duplicate += 1
            continue
        seen_hashes.add(digest)
        docs.append(Doc(name, doc_id, text, len(data)))
    stats.available_docs = len(docs)
    stats.available_bytes = sum(d.nbytes for d in docs)
    return docs


def budgets(available: dict[str, int], total: int, strict: bool = False) -> dict[str, int]:
    """Split ``total`` bytes by WEIGHTS.

    By default what a short source cannot use goes to the others (total stays near
    ``total``); with ``strict`` the total shrinks instead so that the shares hold.
    """
    if strict:
        total = min([total] + [int(available[s] / WEIGHTS[s]) for s in WEIGHTS if s in available])
    result: dict[str, int] = {}
    open_sources = [s for s in WEIGHTS if s in available]
    remaining = total
    while open_sources:
        weight = sum(WEIGHTS[s] for s in open_sources)
        shares = {s: int(remaining * WEIGHTS[s] / weight) for s in open_sources}
        short = [s for s in open_sources if available[s] <= shares[s]]
        if not short:
            result.update(shares)
            break
        for s in short:  # take all of it and re-share the rest
            result[s] = available[s]
            remaining -= available[s]
            open_sources.remove(s)
    return result


def shuffled(docs: list[Doc], seed: int, salt: str) -> list[Doc]:
    """Return docs in a seed-determined order independent of PYTHONHASHSEED."""
    out = sorted(docs, key=lambda d: d.doc_id)
    random.Random(f"{seed}:{salt}").shuffle(out)
    return out


def select(docs: list[Doc], budget: int, seed: int, name: str) -> list[Doc]:
    """Take whole documents in shuffled order until the next one would exceed ``budget``."""
    chosen, used = [], 0
    for doc in shuffled(docs, seed, f"select:{name}"):
        if used + doc.nbytes > budget:
            break
        chosen.append(doc)
        used += doc.nbytes
    return chosen


def split_valid(docs: list[Doc], seed: int) -> tuple[list[Doc], list[Doc]]:
    """Put the VALID_FRACTION of documents with the smallest seeded hash into valid."""
    def key(d: Doc) -> str:
        return hashlib.sha256(f"{seed}\0{d.text}".encode()).hexdigest()

    ranked = sorted(docs, key=key)
    n_valid = max(1, round(len(docs) * VALID_FRACTION)) if docs else 0
    return ranked[n_valid:], ranked[:n_valid]


def render(docs: list[Doc]) -> bytes:
    """Join documents with a line holding only the end-of-text token."""
    return f"{EOT}\n".join(d.text for d in docs).encode("utf-8")


def write_outputs(out_dir: Path, files: dict[str, bytes]) -> None:
    """Write every file to a temp name in ``out_dir`` first, then rename them all."""
    out_dir.mkdir(parents=True, exist_ok=True)
    temps: dict[str, str] = {}
    try:
        for name, data in files.items():
            fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=out_dir)
            temps[name] = tmp
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.chmod(tmp, 0o644)
        # An old manifest would vouch for a half-replaced set; the new one is renamed last,
        # so a manifest.json present always matches the files beside it.
        (out_dir / "manifest.json").unlink(missing_ok=True)
        for name, tmp in temps.items():
            os.replace(tmp, out_dir / name)
    finally:
        for tmp in temps.values():
            if os.path.exists(tmp):
                os.unlink(tmp)


def file_sha256(path: str) -> str:
    """Return the hex sha256 of a file."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def read_utf8(path: Path) -> str | None:
    """Return a file's text, or None when it is not valid UTF-8."""
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        return None


def build(
    out_dir: Path, max_mb: float, seed: int, py: str, install: bool, strict_mix: bool = False
) -> dict[str, object]:
    """Build the corpus into ``out_dir`` and return the manifest."""
    t0 = time.monotonic()
    specs = source_specs(py)
    versions = ensure_packages([p for s in specs for p in s.packages], install)
    for spec in specs:
        verify_statements(spec)
    log("packages: " + ", ".join(f"{p}={v}" for p, v in versions.items()))

    bible_files = [
        f for f in package_files("bible-kjv-text") if os.path.basename(f) == "bible.data"
    ]
    if len(bible_files) != 1:
        raise CorpusError(f"bible-kjv-text: expected one bible.data, found {bible_files}")
    html_root = Path(f"/usr/share/doc/python{py}/html")
    stdlib_spec = specs[2]
    scan = scan_stdlib(py, stdlib_spec.packages)

    loaders: dict[str, Callable[[], Iterable[tuple[str, str | None]]]] = {
        "bible": lambda: bible_documents(Path(bible_files[0])),
        "pydocs": lambda: doc_documents(html_root),
        "stdlib": lambda: (
            (p.relative_to(f"/usr/lib/python{py}").as_posix(), read_utf8(p)) for p in scan.files
        ),
    }
    inputs = {"bible": bible_files[0], "pydocs": str(html_root), "stdlib": f"/usr/lib/python{py}"}

    seen: set[str] = set()
    stats = {s.name: SourceStats() for s in specs}
    pools: dict[str, list[Doc]] = {}
    for spec in specs:  # fixed order, so cross-source duplicates resolve the same way
        t = time.monotonic()
        pools[spec.name] = collect(spec.name, loaders[spec.name](), seen, stats[spec.name])
        st = stats[spec.name]
        log(f"{spec.name}: {st.available_docs} docs, {st.available_bytes / 1e6:.2f} MB usable "
            f"of {st.candidates} candidates ({time.monotonic() - t:.1f}s)")

    total_budget = int(max_mb * 1_000_000)
    caps = budgets({n: stats[n].available_bytes for n in pools}, total_budget, strict_mix)
    train: list[Doc] = []
    valid: list[Doc] = []
    for name, docs in pools.items():
        st = stats[name]
        st.budget_bytes = caps[name]
        chosen = select(docs, caps[name], seed, name)
        st.selected_docs, st.selected_bytes = len(chosen), sum(d.nbytes for d in chosen)
        tr, va = split_valid(chosen, seed)
        train += tr
        valid += va
        st.split = {
            "train": {"docs": len(tr), "bytes": sum(d.nbytes for d in tr)},
            "valid": {"docs": len(va), "bytes": sum(d.nbytes for d in va)},
        }
        target = WEIGHTS[name] * total_budget
        if st.selected_bytes < 0.9 * target:
            log(f"WARNING {name}: {st.selected_bytes / 1e6:.2f} MB selected, below its "
                f"{WEIGHTS[name]:.0%} share of --max-mb ({target / 1e6:.2f} MB)")
    selected_total = sum(st.selected_bytes for st in stats.values())
    if selected_total < 0.9 * total_budget:
        log(f"WARNING total {selected_total / 1e6:.2f} MB < --max-mb {max_mb:g} MB: "
            + ("--strict-mix shrank it to keep the shares" if strict_mix
               else "every source is exhausted"))
    log("mix: " + ", ".join(
        f"{n} {stats[n].selected_bytes / max(selected_total, 1):.1%}" for n in pools))

    files = {
        "train.txt": render(shuffled(train, seed, "order:train")),
        "valid.txt": render(shuffled(valid, seed, "order:valid")),
    }
    manifest: dict[str, object] = {
        "format_version": FORMAT_VERSION,
        "builder": "tools/reference_model/corpus.py",
        "args": {"max_mb": max_mb, "seed": seed, "python_series": py, "strict_mix": strict_mix},
        "document_separator": f"a line containing only {EOT}",
        "normalisation": "NFC; CRLF/CR->LF; trailing whitespace stripped; 3+ blank lines -> 2; "
        f"documents under {MIN_DOC_BYTES} UTF-8 bytes dropped; exact duplicates dropped "
        "(sha256, first occurrence kept in source order bible, pydocs, stdlib)",
        "split": f"per source, the {VALID_FRACTION:.0%} of documents (at least 1) with the "
        "smallest sha256(seed NUL text) go to valid.txt",
        "mix": {"weights": WEIGHTS, "budget_bytes": total_budget,
                "policy": "whole documents in seeded shuffled order up to each source's "
                "budget; " + ("the total shrinks so that no source exceeds its share"
                              if strict_mix else "a source smaller than its share gives the "
                              "rest to the others"),
                "achieved_shares": {}},
        "debian_packages": versions,
        "sources": [],
        "files": {},
    }
    manifest["mix"]["achieved_shares"] = {  # type: ignore[index]
        n: round(stats[n].selected_bytes / max(selected_total, 1), 4) for n in pools
    }
    sources_out: list[dict[str, object]] = []
    for spec in specs:
        st = stats[spec.name]
        entry: dict[str, object] = {
            "name": spec.name,
            "kind": spec.kind,
            "input": inputs[spec.name],
            "debian_packages": {p: versions[p] for p in spec.packages},
            "license": spec.license,
            "license_statements": list(spec.statements),
            "license_statement_file": spec.statement_file,
            "copyright_files": {
                p: {"sha256": file_sha256(p)} for p in spec.copyright_files
            },
            "notes": spec.notes,
            "candidates": st.candidates,
            "dropped": {
                "under_min_bytes": st.dropped_short,
                "duplicate": st.dropped_duplicate,
                "not_utf8": st.dropped_not_utf8,
                "contains_special_token": st.dropped_special_token,
            },
            "available": {"docs": st.available_docs, "bytes": st.available_bytes},
            "budget_bytes": st.budget_bytes,
            "selected": {"docs": st.selected_docs, "bytes": st.selected_bytes},
            "train": st.split["train"],
            "valid": st.split["valid"],
        }
        if spec.name == "stdlib":
            entry["files_kept_per_package"] = scan.per_package
            entry["skipped_files"] = {
                "excluded_directory": scan.excluded_dir,
                f"over_{MAX_CODE_FILE_BYTES}_bytes": scan.too_big,
                "listed_but_missing": scan.missing,
            }
        sources_out.append(entry)
    manifest["sources"] = sources_out
    manifest["files"] = {
        name: {
            "sha256": hashlib.sha256(data).hexdigest(),
            "bytes": len(data),
            "docs": len(train if name == "train.txt" else valid),
        }
        for name, data in files.items()
    }
    files["manifest.json"] = (json.dumps(manifest, indent=2, sort_keys=False) + "\n").encode()
    write_outputs(out_dir, files)
    for name, info in manifest["files"].items():  # type: ignore[union-attr]
        log(f"wrote {out_dir / name}: {info['bytes'] / 1e6:.2f} MB, {info['docs']} docs, "
            f"sha256 {info['sha256'][:16]}...")
    log(f"done in {time.monotonic() - t0:.1f}s")
    return manifest


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path, help="output directory")
    ap.add_argument("--max-mb", type=float, default=40.0,
                    help="approximate corpus size in MB (10^6 bytes of document text)")
    ap.add_argument("--seed", type=int, default=0, help="seed for selection, split and order")
    ap.add_argument("--python-series", default=DEFAULT_PY_SERIES,
                    help="CPython X.Y whose Debian docs and stdlib are used (default %(default)s)")
    ap.add_argument("--strict-mix", action="store_true",
                    help="keep the 35/30/35 shares even if that makes the corpus smaller "
                    "than --max-mb (default: short sources give their share to the others)")
    ap.add_argument("--install", action="store_true",
                    help="install missing Debian packages with apt-get (needs root)")
    args = ap.parse_args(argv)
    if args.max_mb <= 0:
        ap.error("--max-mb must be positive")
    # Turn SIGTERM into SystemExit so write_outputs' cleanup of temp files runs.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    if shutil.which("dpkg-query") is None:
        print("error: dpkg-query not found; this builder needs a Debian system",
              file=sys.stderr)
        return 2
    try:
        build(args.out, args.max_mb, args.seed, args.python_series, args.install,
              args.strict_mix)
    except CorpusError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

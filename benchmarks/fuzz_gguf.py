"""Damaged GGUFs against forecache: every case must end in success or one clear line.

    python benchmarks/fuzz_gguf.py [--cases 1000] [--seed 0] [--api] [--json OUT.json]

Mutations of the reference model and the tiny model: a header value replaced (zero, huge,
negative, NaN, a string, an array, arrays nested thousands deep), a key dropped, the tokenizer
swapped or a token duplicated, a broken chat template, a byte of the header flipped, the file cut
short. Each case runs `forecache generate -m CASE -p hi -n 2` in a child process and is counted as
ok (exit 0), error (exit 1 with one `forecache: error:` line), traceback, signal, hang or other.
--api loads each case with forecache.Llama in a child process instead: the outcome must be a
model or a forecache exception with a one-line message, never a dead interpreter.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import struct
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

# GGUF value types
U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 = range(13)
_FMT = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f", BOOL: "<?",
        U64: "<Q", I64: "<q", F64: "<d"}


@dataclass
class Gguf:
    """A GGUF split into the parts a mutation changes: key-values (raw), tensor infos, data."""

    version: int
    n_tensors: int
    kvs: list[tuple[str, int, bytes]]  # key, value type, encoded value
    tensor_infos: bytes
    data: bytes


def _string(s: str | bytes) -> bytes:
    b = s.encode("utf-8", errors="surrogatepass") if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def encode(vtype: int, value: object) -> bytes:
    """The bytes of one GGUF value."""
    if vtype == STRING:
        return _string(value)  # type: ignore[arg-type]
    if vtype == ARRAY:
        etype, items = value  # type: ignore[misc]
        if etype == "deep":  # arrays of one array, ``items`` deep, around a uint32
            return struct.pack("<IQ", ARRAY, 1) * (items - 1) + struct.pack("<IQI", U32, 1, 1)
        return struct.pack("<IQ", etype, len(items)) + b"".join(encode(etype, v) for v in items)
    return struct.pack(_FMT[vtype], value)


def _skip(buf: bytes, pos: int, vtype: int) -> int:
    if vtype in _FMT:
        return pos + struct.calcsize(_FMT[vtype])
    if vtype == STRING:
        (n,) = struct.unpack_from("<Q", buf, pos)
        return pos + 8 + n
    etype, count = struct.unpack_from("<IQ", buf, pos)
    pos += 12
    if etype in _FMT:
        return pos + count * struct.calcsize(_FMT[etype])
    for _ in range(count):
        pos = _skip(buf, pos, etype)
    return pos


def split(buf: bytes) -> Gguf:
    """Parse a well-formed GGUF into its parts."""
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    pos = 24
    kvs = []
    align = 32
    for _ in range(n_kv):
        (n,) = struct.unpack_from("<Q", buf, pos)
        key = buf[pos + 8:pos + 8 + n].decode()
        pos += 8 + n
        (vtype,) = struct.unpack_from("<I", buf, pos)
        end = _skip(buf, pos + 4, vtype)
        kvs.append((key, vtype, buf[pos + 4:end]))
        if key == "general.alignment":
            (align,) = struct.unpack_from("<I", buf, pos + 4)
        pos = end
    start = pos
    for _ in range(n_tensors):
        (n,) = struct.unpack_from("<Q", buf, pos)
        pos += 8 + n
        (n_dims,) = struct.unpack_from("<I", buf, pos)
        pos += 4 + 8 * n_dims + 4 + 8
    infos = buf[start:pos]
    data_start = (pos + align - 1) // align * align
    return Gguf(version, n_tensors, kvs, infos, buf[data_start:])


def join(g: Gguf, align: int = 32) -> bytes:
    """A GGUF file from its parts (the data section padded to ``align``)."""
    head = b"GGUF" + struct.pack("<IQQ", g.version, g.n_tensors, len(g.kvs))
    head += b"".join(_string(k) + struct.pack("<I", t) + v for k, t, v in g.kvs)
    head += g.tensor_infos
    head += b"\0" * ((-len(head)) % align)
    return head + g.data


def _values(rng: random.Random) -> list[tuple[int, object]]:
    """Replacement values: wrong types, edge values, arrays, deep nesting."""
    deep = (ARRAY, ("deep", rng.choice([2, 3, 50, 3000])))
    return [(U32, 0), (U32, 1), (U32, 2**32 - 1), (I32, -1), (U64, 2**40), (F32, math.nan),
            (F32, math.inf), (F32, 0.5), (F32, -1.0), (STRING, "abc"), (BOOL, True),
            (ARRAY, (U32, [1, 2])), (ARRAY, (STRING, ["x"])), deep,
            (U32, rng.randrange(2, 70000))]


KEYS = ["block_count", "expert_count", "expert_used_count", "context_length",
        "embedding_length", "feed_forward_length", "expert_feed_forward_length",
        "expert_shared_feed_forward_length", "attention.head_count",
        "attention.head_count_kv", "attention.layer_norm_rms_epsilon", "rope.freq_base"]


def mutate(buf: bytes, rng: random.Random) -> tuple[str, bytes]:
    """One damaged copy of ``buf`` and a short name of the damage."""
    g = split(buf)
    arch = next(json.loads(json.dumps(v[8:].decode())) for k, _, v in g.kvs
                if k == "general.architecture")
    kind = rng.choice(["value", "value", "value", "drop", "tokenizer", "duplicate", "template",
                       "alignment", "flip", "flip", "truncate", "special"])
    if kind in ("value", "drop"):
        key = f"{arch}.{rng.choice(KEYS)}" if rng.random() < 0.8 else rng.choice(g.kvs)[0]
        if kind == "drop":
            g.kvs = [kv for kv in g.kvs if kv[0] != key]
            return f"drop {key}", join(g)
        vtype, value = rng.choice(_values(rng))
        new = (key, vtype, encode(vtype, value))
        g.kvs = [new if k == key else (k, t, v) for k, t, v in g.kvs]
        if key not in [k for k, _, _ in g.kvs]:
            g.kvs.append(new)
        return f"{key} = {vtype}:{str(value)[:30]}", join(g)
    if kind == "tokenizer":
        model = rng.choice(["llama", "bert", "t5", "rwkv", "none", "nonsense", ""])
        g.kvs = [(k, t, encode(STRING, model)) if k == "tokenizer.ggml.model" else (k, t, v)
                 for k, t, v in g.kvs]
        return f"tokenizer.ggml.model = {model!r}", join(g)
    if kind == "duplicate":
        for i, (k, t, v) in enumerate(g.kvs):
            if k == "tokenizer.ggml.tokens":
                toks = _strings(v)
                a, b = rng.sample(range(len(toks)), 2)
                toks[a] = toks[b]
                g.kvs[i] = (k, t, encode(ARRAY, (STRING, toks)))
                return f"token {a} = token {b}", join(g)
    if kind == "template":
        bad = rng.choice(["{% if %}", "{{ messages[0]['content'] ", "{% for x in %}{% endfor %}"])
        g.kvs = [kv for kv in g.kvs if kv[0] != "tokenizer.chat_template"]
        g.kvs.append(("tokenizer.chat_template", STRING, encode(STRING, bad)))
        return f"chat template {bad!r}", join(g)
    if kind == "alignment":
        vtype, value = rng.choice([(U32, 1), (U32, 0), (U32, 16), (U32, 48), (F32, 0.5),
                                   (U64, 32), (U32, 64)])
        g.kvs = [kv for kv in g.kvs if kv[0] != "general.alignment"]
        g.kvs.append(("general.alignment", vtype, encode(vtype, value)))
        ok = vtype == U32 and value > 0 and value & (value - 1) == 0
        return f"general.alignment = {vtype}:{value}", join(g, value if ok else 32)
    if kind == "special":
        key = f"tokenizer.ggml.{rng.choice(['bos', 'eos', 'padding'])}_token_id"
        vtype, value = rng.choice([(U32, 2**31), (I32, -5), (STRING, "x"), (U32, 10**6)])
        g.kvs = [(k, vtype, encode(vtype, value)) if k == key else (k, t, v)
                 for k, t, v in g.kvs]
        return f"{key} = {value}", join(g)
    out = bytearray(buf)
    if kind == "flip":
        head = len(join(g)) - len(g.data)
        i = rng.randrange(4, head)
        out[i] ^= 1 << rng.randrange(8)
        return f"flip byte {i}", bytes(out)
    cut = rng.randrange(0, len(buf))
    return f"truncate at {cut}", bytes(out[:cut])


def _strings(encoded: bytes) -> list[bytes]:
    _, count = struct.unpack_from("<IQ", encoded, 0)
    pos, out = 12, []
    for _ in range(count):
        (n,) = struct.unpack_from("<Q", encoded, pos)
        out.append(encoded[pos + 8:pos + 8 + n])
        pos += 8 + n
    return out


def classify(rc: int | None, err: str) -> str:
    """ok, error (one clear line), traceback, signal, hang or other."""
    if rc is None:
        return "hang"
    if rc == 0:
        return "ok"
    if "Traceback" in err:
        return "traceback"
    if rc < 0 or rc > 128:
        return "signal"
    lines = [line for line in err.strip().splitlines() if line.strip()]
    if rc == 1 and len(lines) == 1 and lines[0].startswith("forecache: error: "):
        return "error"
    return "other"


def run_cli(path: Path, timeout: float = 60) -> tuple[str, str]:
    """Run `forecache generate` on a case: (outcome, stderr)."""
    try:
        res = subprocess.run([sys.executable, "-m", "forecache", "generate", "-m", str(path),
                              "-p", "hi", "-n", "2", "--threads", "2"],
                             capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "hang", ""
    return classify(res.returncode, res.stderr), res.stderr


API_CHILD = """
import json, sys
from forecache import Llama
for line in sys.stdin:
    path = line.strip()
    try:
        Llama(path, n_ctx=256, n_threads=2, verbose=False).close()
        out = {"outcome": "ok"}
    except Exception as e:
        out = {"outcome": "error", "type": type(e).__module__ + "." + type(e).__name__,
               "message": str(e)}
    print(json.dumps(out), flush=True)
"""


def run_api(paths: list[Path], timeout: float = 60) -> list[dict]:
    """Load each case with forecache.Llama in a child process that survives from case to case;
    a case that kills the child is recorded as a signal and the next case gets a new child."""
    results: list[dict] = []
    i = 0
    while i < len(paths):
        proc = subprocess.Popen([sys.executable, "-c", API_CHILD], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        assert proc.stdin and proc.stdout
        try:
            while i < len(paths):
                proc.stdin.write(f"{paths[i]}\n")
                proc.stdin.flush()
                line = proc.stdout.readline()
                if not line:  # the interpreter died on this case
                    proc.wait(timeout)
                    results.append({"outcome": "signal", "returncode": proc.returncode})
                    i += 1
                    break
                results.append(json.loads(line))
                i += 1
        finally:
            proc.kill()
            proc.wait()
    return results


def api_outcome(r: dict) -> str:
    """ok, error (a forecache exception with a one-line message), or what went wrong."""
    if r["outcome"] != "error":
        return r["outcome"]
    clear = r["type"].startswith("forecache.") and "\n" not in r["message"]
    return "error" if clear else f"bad error ({r['type']})"


def sources() -> list[bytes]:
    """The files mutated: the reference model and the tiny model."""
    from forecache.models.default import REFERENCE_MODEL, ensure_tiny_model

    out = [ensure_tiny_model().read_bytes()]
    if REFERENCE_MODEL.is_file():
        out.append(REFERENCE_MODEL.read_bytes())
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--api", action="store_true", help="through forecache.Llama, not the CLI")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    rng = random.Random(a.seed)
    bases = sources()
    counts: Counter[str] = Counter()
    bad: list[dict] = []
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        done = 0
        while done < a.cases:  # in chunks, each deleted once run (the cases are large)
            chunk = []
            for i in range(done, min(done + 50, a.cases)):
                name, data = mutate(rng.choice(bases), rng)
                path = Path(tmp) / f"case{i}.gguf"
                path.write_bytes(data)
                chunk.append((name, path))
            if a.api:
                outcomes = [api_outcome(r) for r in run_api([p for _, p in chunk])]
                errs = [""] * len(chunk)
            else:
                runs = [run_cli(p) for _, p in chunk]
                outcomes, errs = [o for o, _ in runs], [e for _, e in runs]
            for (name, path), o, e in zip(chunk, outcomes, errs, strict=True):
                counts[o] += 1
                if o not in ("ok", "error"):
                    bad.append({"case": name, "outcome": o, "stderr": e[-500:]})
                path.unlink()
            done += len(chunk)
            print(f"{done}/{a.cases} cases, {time.time() - t0:.0f} s", file=sys.stderr)
    print(f"{a.cases} cases ({'forecache.Llama' if a.api else 'forecache generate'}), "
          f"{time.time() - t0:.0f} s")
    for k in sorted(counts):
        print(f"  {k:<24}{counts[k]:>6}")
    for b in bad[:20]:
        print(f"  {b['outcome']}: {b['case']}")
    if a.json:
        a.json.write_text(json.dumps({"cases": a.cases, "seed": a.seed, "api": a.api,
                                      "counts": counts, "bad": bad,
                                      "seconds": time.time() - t0}, indent=1))
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())

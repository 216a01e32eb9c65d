"""forecache pull: a model from the Hugging Face hub, every shard, resumed, checked, and then
found by -m. The hub is a loopback stand-in (127.0.0.1, stopped after each test and by a timer)
that answers the calls huggingface_hub makes as huggingface.co does: the model API, HEAD and GET
on resolve/ (302 to a CDN path, with X-Repo-Commit, X-Linked-Etag, X-Linked-Size), the CDN's
Range requests; no Xet headers. The pulls run as a user runs them, `python -m forecache` in a
child process (huggingface_hub reads HF_ENDPOINT and HF_HUB_OFFLINE when it is imported)."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

from forecache.gguf.header import read_model_file
from forecache.models.names import ModelNotFoundError, catalog, resolve_model
from forecache.models.pull import (
    RepoSpec,
    group_models,
    parse_spec,
    pick,
    pulled_models,
)

COMMIT = hashlib.sha1(b"forecache test hub").hexdigest()
REPO = "tester/Tiny-MoE-GGUF"
CHUNK = 10 * 1024 * 1024  # huggingface_hub writes what arrives in chunks of this size
SERVER_LIFETIME_S = 300  # the hub stops itself after this, whatever the test does


class Hub:
    """What the stand-in hub serves, the faults it injects once each, and what it was asked."""

    def __init__(self) -> None:
        self.repos: dict[str, dict[str, bytes]] = {}
        self.gated: set[str] = set()
        self.corrupt: set[str] = set()  # files served with one byte changed
        self.drop: dict[str, int] = {}  # file -> bytes sent before the connection is cut, once
        self.stall: dict[str, int] = {}  # file -> bytes sent before waiting for `release`, once
        self.stalled = threading.Event()
        self.release = threading.Event()
        self.log: list[dict] = []
        self.lock = threading.Lock()
        self.url = ""

    def add(self, repo: str, files: dict[str, bytes]) -> None:
        self.repos[repo] = dict(files)

    def downloads(self, name: str | None = None) -> list[dict]:
        """The CDN's GETs (of files named ``name``): the bytes that crossed."""
        return [e for e in self.log if e["method"] == "GET" and e["route"] == "cdn"
                and (name is None or e["file"].endswith(name))]


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: ThreadingHTTPServer

    def log_message(self, format: str, *args: object) -> None:  # quiet
        pass

    @property
    def hub(self) -> Hub:
        return self.server.hub  # type: ignore[attr-defined]

    def do_HEAD(self) -> None:
        self._route()

    def do_GET(self) -> None:
        self._route()

    def _note(self, **entry: object) -> dict:
        entry = {"method": self.command, "path": self.path, **entry}
        with self.hub.lock:
            self.hub.log.append(entry)
        return entry

    def _reply(self, status: int, headers: dict[str, str], body: bytes = b"") -> None:
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _error(self, status: int, code: str, message: str) -> None:
        self._reply(status, {"X-Error-Code": code, "X-Error-Message": message,
                             "Content-Type": "application/json"},
                    json.dumps({"error": message}).encode())

    def _route(self) -> None:
        parts = [unquote(p) for p in urlsplit(self.path).path.split("/")[1:]]
        if parts[:2] == ["api", "models"] and len(parts) >= 4:
            self._note(route="api")
            return self._model_info("/".join(parts[2:4]))
        if len(parts) >= 5 and parts[2] == "resolve":
            self._note(route="resolve", file="/".join(parts[4:]))
            return self._resolve("/".join(parts[:2]), "/".join(parts[4:]))
        if parts[:1] == ["cdn"] and len(parts) >= 4:
            return self._cdn("/".join(parts[1:3]), "/".join(parts[3:]))
        self._note(route="unknown")
        self._error(404, "NotFound", "no such route")

    def _model_info(self, repo: str) -> None:
        files = self.hub.repos.get(repo)
        if files is None:
            return self._error(401, "RepoNotFound", "Repository not found")
        siblings = [{"rfilename": name, "size": len(data),
                     "blobId": hashlib.sha1(data).hexdigest(),
                     "lfs": {"size": len(data), "sha256": hashlib.sha256(data).hexdigest(),
                             "pointerSize": 135}}
                    for name, data in files.items()]
        body = {"id": repo, "modelId": repo, "sha": COMMIT, "private": False,
                "gated": "manual" if repo in self.hub.gated else False, "siblings": siblings}
        self._reply(200, {"Content-Type": "application/json"}, json.dumps(body).encode())

    def _resolve(self, repo: str, name: str) -> None:
        if repo not in self.hub.repos:
            return self._error(401, "RepoNotFound", "Repository not found")
        if repo in self.hub.gated:
            return self._error(403, "GatedRepo", f"Access to model {repo} is restricted")
        data = self.hub.repos[repo].get(name)
        if data is None:
            return self._error(404, "EntryNotFound", "Entry not found")
        sha = hashlib.sha256(data).hexdigest()
        self._reply(302, {"Location": f"{self.hub.url}/cdn/{repo}/{name}",
                          "X-Repo-Commit": COMMIT, "ETag": f'"{sha}"',
                          "X-Linked-Etag": f'"{sha}"', "X-Linked-Size": str(len(data))})

    def _cdn(self, repo: str, name: str) -> None:
        data = self.hub.repos[repo][name]
        if name in self.hub.corrupt:
            data = data[:len(data) // 2] + bytes([data[len(data) // 2] ^ 1]) + \
                data[len(data) // 2 + 1:]
        start, status = 0, 200
        rng = self.headers.get("Range")
        if rng:
            start, status = int(rng.removeprefix("bytes=").split("-")[0]), 206
        entry = self._note(route="cdn", file=name, range=rng, status=status, sent=0)
        body = data[start:]
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Type", "application/octet-stream")
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.end_headers()
        if self.command == "HEAD":
            return
        with self.hub.lock:
            cut = self.hub.drop.pop(name, None)
            hold = self.hub.stall.pop(name, None)
        if cut is None and hold is None:
            self.wfile.write(body)
            entry["sent"] = len(body)
            return
        self.wfile.write(body[:cut or hold])
        self.wfile.flush()
        entry["sent"] = cut or hold
        if hold is not None:
            self.hub.stalled.set()
            self.hub.release.wait(60)
        self.close_connection = True
        self.connection.shutdown(socket.SHUT_RDWR)


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Hub]:
    """A stand-in hub on 127.0.0.1, and the environment pointing forecache and huggingface_hub
    at it (models into tmp_path/models; no token, config or cache of the user's)."""
    state = Hub()
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    server.hub = state  # type: ignore[attr-defined]
    state.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1},
                              daemon=True)
    thread.start()
    timer = threading.Timer(SERVER_LIFETIME_S, server.shutdown)
    timer.daemon = True
    timer.start()
    monkeypatch.setenv("HF_ENDPOINT", state.url)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("FORECACHE_MODEL_DIR", str(tmp_path / "models"))
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    for var in ("HF_TOKEN", "HF_HUB_OFFLINE", "HF_HUB_DISABLE_XET", "HUGGING_FACE_HUB_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    try:
        yield state
    finally:
        state.release.set()
        timer.cancel()
        server.shutdown()
        server.server_close()
        thread.join(10)


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A tiny model's bytes in one file, and the same model as split shards."""
    from forecache.gguf.maker import make_model

    root = tmp_path_factory.mktemp("made")
    one = make_model(root / "one" / "tiny.gguf", "tiny", "q8_0", seed=0, workers=1)
    split = make_model(root / "split" / "tiny.gguf", "tiny", "q8_0", seed=0, workers=1,
                       split_max_size=one.file_bytes // 3)
    assert len(split.shards) >= 3
    return {"one": one.path.read_bytes(), "shards": [p.read_bytes() for p in split.shards]}


def forecache(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "forecache", *args], capture_output=True,
                          text=True, timeout=timeout)


def error_line(res: subprocess.CompletedProcess) -> str:
    """The one line a failed command printed last, checked to be forecache's error line."""
    assert res.returncode == 1, (res.returncode, res.stderr)
    assert "Traceback" not in res.stderr, res.stderr
    line = res.stderr.strip().splitlines()[-1]
    assert line.startswith("forecache: error: "), res.stderr
    return line


def shard_names(stem: str, n: int) -> list[str]:
    return [f"{stem}-{i:05d}-of-{n:05d}.gguf" for i in range(1, n + 1)]


def models_dir() -> Path:
    return Path(os.environ["FORECACHE_MODEL_DIR"])


# --- which files: no hub needed --------------------------------------------------------------

def test_specs_and_the_choice_of_files() -> None:
    assert parse_spec("Qwen/Qwen2-57B-A14B-Instruct-GGUF:Q4_K_M") == \
        RepoSpec("Qwen/Qwen2-57B-A14B-Instruct-GGUF", "Q4_K_M")
    assert parse_spec("owner/repo") == RepoSpec("owner/repo")
    for not_repo in ("tiny", "/abs/path", "a/b/c", "./x", "a/b:", "-x/y"):
        assert parse_spec(not_repo) is None, not_repo

    files = ["README.md", "m-Q8_0.gguf", "m-Q4_K_S.gguf", "mmproj-m-f16.gguf",
             *shard_names("m-Q4_K_M", 3), "big/m-Q2_K-00001-of-00002.gguf"]
    models = group_models(files)
    names = {m.name: m for m in models}
    assert set(names) == {"m-Q8_0.gguf", "m-Q4_K_S.gguf", "m-Q4_K_M.gguf", "big/m-Q2_K.gguf"}
    assert names["m-Q4_K_M.gguf"].files == tuple(shard_names("m-Q4_K_M", 3))
    assert names["big/m-Q2_K.gguf"].missing == ("big/m-Q2_K-00002-of-00002.gguf",)
    # no quant: Q4_K_M (split or not); a quant: contained in the name, any case
    assert [m.name for m in pick(models, None)] == ["m-Q4_K_M.gguf"]
    assert [m.name for m in pick(models, "q8_0")] == ["m-Q8_0.gguf"]
    # Q4_K is in two names and a whole word of neither: both offered
    assert {m.label for m in pick(models, "Q4_K")} == {"Q4_K_M", "Q4_K_S"}
    assert pick(models, "Q5_K_M") == []
    # no Q4_K_M, one model: that one; several: all of them (the caller asks which)
    assert [m.name for m in pick(group_models(["x-Q8_0.gguf"]), None)] == ["x-Q8_0.gguf"]
    assert len(pick(group_models(["x-Q8_0.gguf", "x-Q6_K.gguf"]), None)) == 2


# --- pulling ---------------------------------------------------------------------------------

def test_pull_repo_quant_then_m_finds_it_and_runs(hub: Hub, made: dict) -> None:
    hub.add(REPO, {"README.md": b"# tiny\n", "tiny-moe-Q8_0.gguf": made["one"],
                   "tiny-moe-Q6_K.gguf": made["one"][::-1]})
    spec = f"{REPO}:q8_0"
    # before the pull: -m says how to get it, in one line
    res = forecache("generate", "-m", spec, "-p", "hi", "-n", "1")
    line = error_line(res)
    assert len(res.stderr.strip().splitlines()) == 1
    assert f"`forecache pull {spec}`" in line
    with pytest.raises(ModelNotFoundError, match="forecache pull"):
        resolve_model(spec)

    res = forecache("pull", spec)
    assert res.returncode == 0, res.stderr
    dest = models_dir() / "tester" / "Tiny-MoE-GGUF" / "tiny-moe-Q8_0.gguf"
    assert dest.read_bytes() == made["one"]
    assert str(dest) in res.stdout and f"-m {spec}" in res.stdout
    assert [e["file"] for e in hub.downloads()] == ["tiny-moe-Q8_0.gguf"]  # nothing else
    # no Xet or other calls (huggingface_hub fetches a registry of AI agents for its
    # user-agent header, at most daily, whatever the command: not a download)
    assert not [e for e in hub.log if e["route"] == "unknown"
                and not e["path"].startswith("/api/agent-harnesses")]
    assert not list(dest.parent.glob("*.part"))
    # -m takes the spec (and the repo alone, which has one pulled model)
    assert resolve_model(spec) == dest
    assert resolve_model(f"{REPO}:Q8_0") == dest and resolve_model(REPO) == dest
    res = forecache("generate", "-m", spec, "-p", "hi", "-n", "4", "--greedy")
    assert res.returncode == 0, res.stderr
    # pulled again: checked by its record, nothing downloaded
    res = forecache("pull", spec)
    assert res.returncode == 0 and "already pulled" in res.stderr, res.stderr
    assert len(hub.downloads()) == 1
    # `forecache models` lists it; --quiet prints the path alone
    doc = json.loads(forecache("models", "--json").stdout)
    pulled = [(r["name"], r["path"]) for r in doc["models"] if r["kind"] == "pulled"]
    assert pulled == [(f"{REPO}:Q8_0", str(dest))]
    res = forecache("pull", "-q", spec)
    assert res.returncode == 0 and res.stdout.strip() == str(dest) and res.stderr == ""


def test_pull_a_split_model_takes_every_shard(hub: Hub, made: dict) -> None:
    names = shard_names("Tiny-MoE-Q4_K_M", len(made["shards"]))
    hub.add(REPO, {**dict(zip(names, made["shards"], strict=True)),
                   "Tiny-MoE-Q8_0.gguf": made["one"]})
    res = forecache("pull", REPO)  # no quant: the Q4_K_M, all its shards
    assert res.returncode == 0, res.stderr
    folder = models_dir() / "tester" / "Tiny-MoE-GGUF"
    for name, data in zip(names, made["shards"], strict=True):
        assert (folder / name).read_bytes() == data
    assert sorted(e["file"] for e in hub.downloads()) == sorted(names)
    assert f"-m {REPO}:Q4_K_M" in res.stdout
    first = folder / names[0]
    assert resolve_model(f"{REPO}:Q4_K_M") == first
    mf = read_model_file(first)
    assert mf.files == [folder / n for n in names]
    # a shard that goes missing locally: -m says the pull is incomplete, in one line
    (folder / names[-1]).unlink()
    with pytest.raises(ModelNotFoundError, match="pulled only in part.*forecache pull"):
        resolve_model(f"{REPO}:Q4_K_M")
    assert pulled_models() == []


def test_a_shard_missing_from_the_repo_is_refused(hub: Hub, made: dict) -> None:
    names = shard_names("Tiny-MoE-Q4_K_M", len(made["shards"]))
    hub.add(REPO, {n: d for n, d in zip(names, made["shards"], strict=True) if n != names[1]})
    line = error_line(forecache("pull", f"{REPO}:Q4_K_M"))
    assert names[1] in line and "cannot be pulled whole" in line
    assert hub.downloads() == []


def test_an_interrupted_download_resumes_with_a_range_request(hub: Hub, made: dict) -> None:
    size = len(made["one"])
    assert size > CHUNK + 2 * 1024 * 1024
    hub.add(REPO, {"tiny-moe-Q8_0.gguf": made["one"]})
    folder = models_dir() / "tester" / "Tiny-MoE-GGUF"
    # the connection is cut part way: the same pull continues from what it kept
    hub.drop["tiny-moe-Q8_0.gguf"] = CHUNK + 2 * 1024 * 1024
    res = forecache("pull", f"{REPO}:Q8_0")
    assert res.returncode == 0, res.stderr
    assert (folder / "tiny-moe-Q8_0.gguf").read_bytes() == made["one"]
    first, second = hub.downloads()
    assert first["range"] is None and first["sent"] == CHUNK + 2 * 1024 * 1024
    assert second["status"] == 206 and second["range"] == f"bytes={CHUNK}-"
    assert second["sent"] == size - CHUNK  # what had arrived is not sent again

    # Ctrl-C part way: the bytes that arrived are kept, and the next pull continues them
    (folder / "tiny-moe-Q8_0.gguf").unlink()
    (folder / ".forecache-pulled.json").unlink()
    hub.log.clear()
    hub.stall["tiny-moe-Q8_0.gguf"] = CHUNK + 2 * 1024 * 1024
    child = subprocess.Popen([sys.executable, "-m", "forecache", "pull", f"{REPO}:Q8_0"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert hub.stalled.wait(60)
        deadline = time.monotonic() + 60
        while sum(p.stat().st_size for p in folder.glob("*.part")) < CHUNK:
            assert time.monotonic() < deadline and child.poll() is None
            time.sleep(0.05)
        child.send_signal(signal.SIGINT)
        _, err = child.communicate(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == 130, err
    assert err.strip().splitlines()[-1] == "forecache: interrupted" and "Traceback" not in err
    (part,) = folder.glob("tiny-moe-Q8_0.gguf.*.part")
    assert part.stat().st_size == CHUNK and not (folder / "tiny-moe-Q8_0.gguf").exists()
    hub.release.set()
    res = forecache("pull", f"{REPO}:Q8_0")
    assert res.returncode == 0, res.stderr
    assert "resuming at" in res.stderr
    assert (folder / "tiny-moe-Q8_0.gguf").read_bytes() == made["one"]
    assert not part.exists()
    resumed = hub.downloads()[-1]
    assert resumed["range"] == f"bytes={CHUNK}-" and resumed["sent"] == size - CHUNK


def test_a_corrupted_shard_is_refused_and_removed(hub: Hub, made: dict) -> None:
    names = shard_names("Tiny-MoE-Q8_0", len(made["shards"]))
    hub.add(REPO, dict(zip(names, made["shards"], strict=True)))
    hub.corrupt.add(names[1])
    res = forecache("pull", f"{REPO}:Q8_0")
    line = error_line(res)
    assert names[1] in line and "sha256" in line and f"re-run `forecache pull {REPO}:Q8_0`" in line
    folder = models_dir() / "tester" / "Tiny-MoE-GGUF"
    assert not (folder / names[1]).exists() and not list(folder.glob("*.part"))
    for name, data in zip(names, made["shards"], strict=True):
        if name != names[1]:
            assert (folder / name).read_bytes() == data  # the good shards are kept
    with pytest.raises(ModelNotFoundError, match="pulled only in part"):
        resolve_model(f"{REPO}:Q8_0")
    # the hub serves it right again: the re-run downloads that shard alone
    hub.corrupt.clear()
    hub.log.clear()
    res = forecache("pull", f"{REPO}:Q8_0")
    assert res.returncode == 0, res.stderr
    assert [e["file"] for e in hub.downloads()] == [names[1]]
    assert (folder / names[1]).read_bytes() == made["shards"][1]


def test_errors_are_one_line(hub: Hub, made: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    hub.add(REPO, {"tiny-moe-Q8_0.gguf": made["one"], "tiny-moe-Q6_K.gguf": made["one"]})
    hub.add("tester/Gated-GGUF", {"g-Q4_K_M.gguf": made["one"]})
    hub.gated.add("tester/Gated-GGUF")
    cases = {
        f"{REPO}:Q5_K_M": ["no GGUF model matching 'Q5_K_M'", "Q6_K, Q8_0"],
        REPO: ["2 GGUF models", "Q4_K_M", "Q6_K, Q8_0"],
        "tester/No-Such-GGUF": ["no model repo tester/No-Such-GGUF"],
        "tester/Gated-GGUF": ["gated", "hf auth login"],
        "no-such-model": ["neither a hub repo", "qwen2-57b-a14b-instruct"],
    }
    for spec, words in cases.items():
        res = forecache("pull", spec)
        line = error_line(res)
        assert len(res.stderr.strip().splitlines()) == 1, res.stderr
        for w in words:
            assert w in line, (spec, line)
    assert hub.downloads() == []

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    line = error_line(forecache("pull", f"{REPO}:Q8_0"))
    assert "HF_HUB_OFFLINE" in line
    monkeypatch.delenv("HF_HUB_OFFLINE")
    with socket.socket() as s:  # a port with nothing listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    res = forecache("pull", f"{REPO}:Q8_0")
    line = error_line(res)
    assert len(res.stderr.strip().splitlines()) == 1 and "cannot reach" in line


def test_pull_a_catalog_name_then_m_name_finds_it(hub: Hub, made: dict) -> None:
    entry = catalog()["qwen2-57b-a14b-instruct"]
    stem = entry.file.removesuffix(".gguf")
    names = shard_names(stem, len(made["shards"]))
    # the publisher splits its file; another quant beside it
    hub.add(entry.hf_repo, {**dict(zip(names, made["shards"], strict=True)),
                            stem.replace("q4_k_m", "q8_0") + ".gguf": made["one"]})
    with pytest.raises(ModelNotFoundError, match=f"forecache pull {entry.name}"):
        resolve_model(entry.name)
    res = forecache("pull", entry.name)
    assert res.returncode == 0, res.stderr
    folder = models_dir().joinpath(*entry.hf_repo.split("/"))
    assert sorted(e["file"] for e in hub.downloads()) == sorted(names)
    assert resolve_model(entry.name) == folder / names[0]
    doc = json.loads(forecache("models", "--json").stdout)
    row = next(r for r in doc["models"] if r["name"] == entry.name)
    assert row["found"] is True and row["path"] == str(folder / names[0])
    assert not [r for r in doc["models"] if r["kind"] == "pulled"]  # listed once, by name
    res = forecache("generate", "-m", entry.name, "-p", "hi", "-n", "4", "--greedy")
    assert res.returncode == 0, res.stderr
    # its repo spec names the same files
    assert resolve_model(f"{entry.hf_repo}:Q4_K_M") == folder / names[0]

"""forecache.Llama against llama_cpp.Llama: same signatures, same return shapes, same tokens."""

from __future__ import annotations

import contextlib
import inspect
import json
import re
import resource
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import llama_cpp
import pytest
from stock_runner import load

import forecache
from forecache.llama import Llama, ModelLoadError
from forecache.native.ggml_devices import devices

PROMPT = "And it came to pass"
CHAT = [{"role": "user", "content": "Who was the king?"}]
PUBLIC = ["create_completion", "create_chat_completion", "__call__", "tokenize", "detokenize",
          "generate", "eval", "reset", "n_ctx", "token_eos", "token_bos", "embed",
          "create_chat_completion_openai_v1", "save_state", "load_state", "set_cache"]


def _shape(obj: object) -> object:
    """The structure of a response with its values blanked (ids and timestamps differ)."""
    if isinstance(obj, dict):
        return {k: _shape(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_shape(v) for v in obj]
    return type(obj).__name__


def _strip_ids(obj: dict) -> dict:
    out = dict(obj)
    out.pop("id", None)
    out.pop("created", None)
    return out


@pytest.fixture(scope="module")
def pair(tiny_model) -> tuple[llama_cpp.Llama, Llama]:
    path = str(tiny_model("q8_0"))
    # the same build, loaded as forecache's policies load (no CPU weight repacking)
    stock = load(path, {"n_ctx": 512, "seed": 1}, repack=False)
    ours = Llama(path, n_ctx=512, seed=1, verbose=False, policy="lru", cache_fraction=0.5)
    yield stock, ours
    ours.close()
    stock.close()


def test_public_methods_keep_llama_cpp_signatures() -> None:
    assert issubclass(Llama, llama_cpp.Llama)
    assert forecache.Llama is Llama
    for name in PUBLIC:
        assert inspect.signature(getattr(Llama, name)) == \
            inspect.signature(getattr(llama_cpp.Llama, name)), name
    # every llama_cpp.Llama constructor argument is still accepted, by keyword
    ours = inspect.signature(Llama.__init__).parameters
    assert any(p.kind is inspect.Parameter.VAR_KEYWORD for p in ours.values())
    assert "model_path" in ours


def test_same_completions_and_shapes(pair) -> None:
    stock, ours = pair
    assert ours.n_ctx() == stock.n_ctx() == 512
    assert ours.tokenize(PROMPT.encode()) == stock.tokenize(PROMPT.encode())
    toks = stock.tokenize(PROMPT.encode())
    assert ours.detokenize(toks) == stock.detokenize(toks)

    a = stock.create_completion(PROMPT, max_tokens=12, temperature=0)
    b = ours.create_completion(PROMPT, max_tokens=12, temperature=0)
    assert _shape(a) == _shape(b)
    assert _strip_ids(b)["choices"] == _strip_ids(a)["choices"]
    assert b["usage"] == a["usage"]
    assert ours(PROMPT, max_tokens=12, temperature=0)["choices"][0]["text"] == \
        a["choices"][0]["text"]

    sa = list(stock.create_completion(PROMPT, max_tokens=12, temperature=0, stream=True))
    sb = list(ours.create_completion(PROMPT, max_tokens=12, temperature=0, stream=True))
    assert [_shape(c) for c in sa] == [_shape(c) for c in sb]
    assert "".join(c["choices"][0]["text"] for c in sb) == a["choices"][0]["text"]

    ca = stock.create_chat_completion(messages=CHAT, max_tokens=12, temperature=0)
    cb = ours.create_chat_completion(messages=CHAT, max_tokens=12, temperature=0)
    assert _shape(ca) == _shape(cb)
    assert cb["choices"] == ca["choices"]
    chunks = list(ours.create_chat_completion(messages=CHAT, max_tokens=12, temperature=0,
                                              stream=True))
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert text == ca["choices"][0]["message"]["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop")


def test_expert_stats_and_reset(pair) -> None:
    _, ours = pair
    ours.reset_stats()
    ours.create_completion(PROMPT, max_tokens=8, temperature=0)
    s = ours.expert_stats()
    assert s["policy"] == "lru"
    assert s["hits"] + s["misses"] > 0
    assert 0 <= s["hit_rate"] <= 1
    assert 0 < s["slots_filled"] <= s["cache_slots"]
    assert s["slot_bytes"] > 0
    ours.reset_stats()
    s = ours.expert_stats()
    assert s["hits"] == s["misses"] == 0 and s["hit_rate"] is None


SCRIPT = """
import json, sys
from {module} import Llama
llm = Llama(sys.argv[1], n_ctx=256, verbose=False{extra})
out = llm("In the beginning", max_tokens=10, temperature=0)
chat = llm.create_chat_completion(messages=[{{"role": "user", "content": "hi"}}],
                                  max_tokens=10, temperature=0)
print(json.dumps([out["choices"][0]["text"], chat["choices"][0]["message"]["content"],
                  llm.tokenize(b"hello world")]))
"""


def test_a_llama_cpp_script_switches_by_its_import(tiny_model, tmp_path: Path) -> None:
    model = str(tiny_model("q8_0"))
    outs = []
    for module, extra in (("llama_cpp", ""), ("forecache", ", cache_fraction=0.25")):
        script = tmp_path / f"script_{module}.py"
        script.write_text(SCRIPT.format(module=module, extra=extra))
        res = subprocess.run([sys.executable, str(script), model], capture_output=True,
                             text=True, timeout=120, check=True)
        outs.append(json.loads(res.stdout.strip().splitlines()[-1]))
    assert outs[0] == outs[1]


@contextlib.contextmanager
def _address_space_limit(extra: int) -> Iterator[None]:
    """Allow this process ``extra`` bytes of address space beyond what it maps now (RLIMIT_AS),
    restoring the limit after."""
    status = Path("/proc/self/status")
    if not status.exists():
        pytest.skip("needs Linux's /proc and RLIMIT_AS")
    vm = re.search(r"^VmSize:\s+(\d+) kB", status.read_text(), re.MULTILINE)
    assert vm, "no VmSize in /proc/self/status"
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (int(vm.group(1)) * 1024 + extra, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def test_out_of_memory_at_load_is_one_clear_error(tiny_model) -> None:
    # A KV cache llama.cpp cannot allocate: it fails and says why. The failure comes from an
    # address-space limit, not from the machine's RAM: llama.cpp fills its per-cell bookkeeping
    # (144 bytes a cell with patch 0004's 1024-sequence bitsets) before it allocates the KV
    # buffer, so the 2^27 cells this test once asked for held 18 GB resident on a 24 GB CI
    # machine, and whether the buffer then fails depends on RAM and overcommit. Here 2^21 cells
    # are 0.3 GB of bookkeeping and a 4 GiB KV buffer (the tiny preset's 2 KiB a cell) that a
    # 2 GiB allowance refuses on any machine.
    model = str(tiny_model("q8_0"))
    devices()  # backends (and a GPU build's CUDA context) start before the limit, not under it
    with _address_space_limit(2 << 30), \
            pytest.raises(ModelLoadError, match=r"out of memory while loading .*lower n_ctx="):
        Llama(model, n_ctx=1 << 21, verbose=False, cache=None)


def test_not_moe_and_missing_files_are_refused(tmp_path: Path) -> None:
    from forecache.gguf.header import GGUFError

    with pytest.raises(GGUFError, match="not found|does not exist|no such"):
        Llama(str(tmp_path / "missing.gguf"))


def test_promoe_is_the_default_policy(tiny_model) -> None:
    """Unnamed, the policy stays unnamed until the load chooses (promoe's placement weighed
    first); where there is nothing to choose (a fraction: ncmoe needs a budget) it is promoe."""
    from forecache.llama import Llama
    from forecache.native.ggml_devices import cache_device
    from forecache.placement.options import Options

    dev = cache_device()
    auto = Options().cache_config()
    if dev.type == "cpu":  # device and host are the same memory: llama.cpp's own placement
        assert auto is None
    else:  # the GPU's free memory, less a reserve
        assert auto is not None and auto.policy is None and auto.spec.name == "promoe"
        assert 0 < auto.gpu_budget < dev.memory_free
    by_share = Options(cache_fraction=0.5).cache_config()
    assert by_share.policy is None and by_share.spec.name == "promoe"
    sized = Options(gpu_budget="1GiB").cache_config()
    assert sized.policy is None and sized.gpu_budget == 1 << 30
    assert Options(policy="lru", cache_fraction=0.5).cache_config().policy == "lru"
    with Llama(tiny_model(), cache_fraction=0.5, n_ctx=64, verbose=False) as llm:
        assert llm.policy_choice is None and llm.cache_config.policy == "promoe"
        assert llm.expert_stats()["policy"] == "promoe"


def test_each_generation_frees_the_last_sampler(tiny_model) -> None:
    """llama-cpp-python drops one sampler chain (an n_vocab buffer) per generation into a
    reference cycle; forecache frees it at once, so native memory does not grow per request."""
    import gc

    from llama_cpp._internals import LlamaSampler

    def live() -> int:
        return sum(1 for o in gc.get_objects()
                   if isinstance(o, LlamaSampler) and o.sampler is not None)

    with Llama(str(tiny_model("q8_0")), n_ctx=256, verbose=False, policy="lru",
               cache_fraction=0.5) as llm:
        gc.collect()
        base = live()
        gc.disable()
        try:
            for i in range(12):
                llm.create_completion(f"request {i}", max_tokens=2, temperature=0)
            assert live() - base <= 1
        finally:
            gc.enable()


def test_model_names_are_taken_as_on_the_command_line(tmp_path: Path, tiny_model,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Llama(NAME) and Llama.open(NAME) load what `-m NAME` loads: the built-in default model,
    a catalog model's file in the model directory."""
    import shutil

    from forecache.models.names import catalog, resolve_model

    monkeypatch.setenv("FORECACHE_CACHE_DIR", str(tmp_path / "cache"))  # a tiny made, if need be
    monkeypatch.setenv("FORECACHE_MODEL_DIR", str(tmp_path))
    default = resolve_model("default")
    with Llama("default", n_ctx=256, cache=None, verbose=False) as llm:
        assert llm.model_file.path == default
        assert llm.create_completion(PROMPT, max_tokens=2, temperature=0)["choices"][0]["text"]
    entry = catalog()["qwen2-57b-a14b-instruct"]
    shutil.copy(tiny_model("q8_0"), tmp_path / entry.file)
    with Llama.open(entry.name, cache=None, n_ctx=256) as llm:
        assert llm.model_file.path == tmp_path / entry.file


def test_a_missing_model_is_never_offered_to_make_model(tmp_path: Path) -> None:
    """A path that is not there, or a mistyped name: the names there are and the built-in
    default model, never a make-model that would write a random-weight file of that name."""
    from forecache.gguf.header import GGUFError
    from forecache.models.names import ModelNotFoundError

    with pytest.raises(GGUFError, match="model file not found") as err:
        Llama(str(tmp_path / "defualt.gguf"))
    msg = str(err.value)
    assert "make-model" not in msg and "model_path='default'" in msg
    assert "forecache models" in msg
    for typo in ("defualt", "qwen2-57b-a14b-instruc"):
        with pytest.raises(ModelNotFoundError, match=f"no model file or name {typo!r}") as err:
            Llama(typo)
        assert "make-model" not in str(err.value) and "default" in str(err.value)

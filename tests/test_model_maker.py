"""Tests for the GGUF model maker: specs, tensor layout, random blocks, tokenizer, llama.cpp."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import jinja2
import llama_cpp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader
from gguf.quants import dequantize

from forecache.gguf import maker as model_maker
from forecache.gguf import qtypes
from forecache.gguf import specs as model_specs
from forecache.gguf.header import read_model_file
from forecache.gguf.maker import make_model, random_blocks
from forecache.gguf.qtypes import tensor_type
from forecache.gguf.specs import get_spec, size_report, tensor_plan
from forecache.gguf.vocab import CHATML_TEMPLATE, SPECIAL_TOKENS, decode_token, make_vocab

QTYPES = list(qtypes.QTYPES)


def _field(reader: GGUFReader, key: str):
    return reader.fields[key].contents()


# --- specs -----------------------------------------------------------------------------

def test_real_shapes_match_hf_configs() -> None:
    a27 = get_spec("qwen1.5-moe-a2.7b")
    assert (a27.layers, a27.d_model, a27.heads, a27.kv_heads) == (24, 2048, 16, 16)
    assert (a27.experts, a27.top_k, a27.expert_ff, a27.shared_expert_ff) == (60, 4, 1408, 5632)
    assert (a27.vocab, a27.context_length, a27.rope_theta, a27.rms_eps) == (
        151936, 8192, 1e6, 1e-6)
    q57 = get_spec("qwen2-57b-a14b")
    assert (q57.layers, q57.d_model, q57.heads, q57.kv_heads) == (28, 3584, 28, 4)
    assert (q57.experts, q57.top_k, q57.expert_ff, q57.shared_expert_ff) == (64, 8, 2560, 20480)
    assert (q57.vocab, q57.context_length, q57.rope_theta, q57.ff) == (151936, 32768, 1e6, 18944)
    tiny = get_spec("tiny")
    assert (tiny.layers, tiny.experts, tiny.top_k) == (4, 16, 4)
    assert (tiny.head_dim, tiny.kv_heads) == (64, 2)
    assert (tiny.expert_ff, tiny.shared_expert_ff, tiny.d_model) == (256, 512, 256)


def test_unknown_model_lists_known_names() -> None:
    with pytest.raises(ValueError) as err:
        get_spec("mixtral-9000")
    message = str(err.value)
    assert "\n" not in message
    assert all(name in message for name in model_specs.model_names())


def test_size_report_counts_parameters() -> None:
    a27 = size_report(get_spec("qwen1.5-moe-a2.7b"), "q4_k")
    assert a27.total_params == pytest.approx(14.3e9, rel=0.01)
    q57 = size_report(get_spec("qwen2-57b-a14b"), "q4_k")
    assert q57.total_params == pytest.approx(57.4e9, rel=0.01)
    assert q57.total_expert_bytes + q57.nonexpert_bytes == q57.total_bytes
    assert q57.expert_bytes * 64 * 28 == q57.total_expert_bytes
    assert q57.nonexpert_bytes < q57.active_bytes_per_token < q57.total_bytes
    f16 = size_report(get_spec("qwen2-57b-a14b"), "f16")
    assert f16.total_expert_bytes == f16.expert_params * 2


def test_tensor_type_choice() -> None:
    assert tensor_type("blk.0.ffn_down_exps.weight", (1408, 2048, 60), "q4_k") == Q.Q5_0
    assert tensor_type("blk.0.ffn_up_exps.weight", (2048, 1408, 60), "q4_k") == Q.Q4_K
    assert tensor_type("blk.0.ffn_gate_inp.weight", (2048, 60), "q8_0") == Q.F32
    assert tensor_type("blk.0.attn_q.bias", (2048,), "q4_0") == Q.F32
    assert tensor_type("blk.0.attn_q.weight", (2048, 2048), "f16") == Q.F16
    with pytest.raises(ValueError, match="q4_k"):
        tensor_type("blk.0.attn_q.weight", (2048, 2048), "q3_k")


# --- random blocks -----------------------------------------------------------------------

@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_0, Q.Q6_K, Q.Q8_0, Q.Q4_0, Q.MXFP4])
@pytest.mark.parametrize("fan_in", [256, 2560, 20480])
def test_random_blocks_dequantize_to_intended_spread(qtype: Q, fan_in: int) -> None:
    std = 1 / np.sqrt(fan_in)
    blocks = random_blocks(qtype, 256 * 2048, std, np.random.default_rng(3))
    values = dequantize(blocks.reshape(2048, -1), qtype)
    assert values.shape == (2048, 256)
    assert np.isfinite(values).all()
    assert values.std() == pytest.approx(std, rel=0.03)
    assert abs(values.mean()) < 0.02 * std


# --- writing -----------------------------------------------------------------------------

def test_bad_arguments_raise_one_line_value_errors(tmp_path: Path) -> None:
    out = tmp_path / "m.gguf"
    with pytest.raises(ValueError) as err:
        make_model(out, "nope", "q4_k")
    assert "tiny" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ValueError) as err:
        make_model(out, "tiny", "q5_k")
    assert all(q in str(err.value) for q in QTYPES) and "\n" not in str(err.value)
    assert list(tmp_path.iterdir()) == []


def test_interrupted_write_leaves_nothing(tmp_path: Path) -> None:
    def stop(done: int, total: int) -> None:
        if done > total // 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        make_model(tmp_path / "m.gguf", "tiny", "q4_k", progress=stop)
    assert list(tmp_path.iterdir()) == []


def test_tiny_reports_progress_and_its_time(tmp_path: Path) -> None:
    seen: list[tuple[int, int]] = []
    info = make_model(tmp_path / "m.gguf", "tiny", "q4_k",
                      progress=lambda done, total: seen.append((done, total)))
    assert info.seconds > 0  # (how fast is the machine's: benchmarks, not tests)
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)
    assert seen[-1][0] == seen[-1][1] == info.sizes.total_bytes
    assert info.file_bytes == os.path.getsize(tmp_path / "m.gguf")


def test_bytes_do_not_depend_on_worker_count(tmp_path: Path) -> None:
    one = make_model(tmp_path / "a.gguf", "tiny", "q4_k", seed=7, n_layers=2, workers=1)
    two = make_model(tmp_path / "b.gguf", "tiny", "q4_k", seed=7, n_layers=2, workers=2)
    other = make_model(tmp_path / "c.gguf", "tiny", "q4_k", seed=8, n_layers=2, workers=1)
    assert one.path.read_bytes() == two.path.read_bytes()
    assert one.path.read_bytes() != other.path.read_bytes()


@pytest.mark.parametrize("qtype", QTYPES)
def test_tensor_data_lands_at_the_offsets_gguf_reads(tmp_path: Path, qtype: str) -> None:
    info = make_model(tmp_path / "m.gguf", "tiny", qtype, seed=1, n_layers=1)
    reader = GGUFReader(info.path)
    plans = tensor_plan(get_spec("tiny").with_layers(1), qtype)
    by_name = {t.name: t for t in reader.tensors}
    assert [t.name for t in reader.tensors] == [p.name for p in plans]
    for plan in plans:
        tensor = by_name[plan.name]
        jobs = model_maker._jobs([plan], [(0, tensor.data_offset)], seed=1)
        expected = b"".join(model_maker._generate(j).tobytes() for j in jobs)
        assert tensor.tensor_type == plan.ggml_type
        assert bytes(tensor.data.reshape(-1).view(np.uint8)) == expected, plan.name


def test_qwen2_57b_two_layers_matches_models_yaml(tmp_path: Path) -> None:
    spec = get_spec("qwen2-57b-a14b")
    info = make_model(tmp_path / "q57.gguf", "qwen2-57b-a14b", "q4_k", n_layers=2, workers=2)
    reader = GGUFReader(info.path)
    arch = "qwen2moe"
    assert _field(reader, "general.architecture") == arch
    expected = {
        "block_count": 2,
        "context_length": spec.context_length,
        "embedding_length": spec.d_model,
        "feed_forward_length": spec.ff,
        "attention.head_count": spec.heads,
        "attention.head_count_kv": spec.kv_heads,
        "expert_count": spec.experts,
        "expert_used_count": spec.top_k,
        "expert_feed_forward_length": spec.expert_ff,
        "expert_shared_feed_forward_length": spec.shared_expert_ff,
    }
    for key, value in expected.items():
        assert _field(reader, f"{arch}.{key}") == value, key
    assert _field(reader, f"{arch}.rope.freq_base") == pytest.approx(spec.rope_theta)
    assert _field(reader, f"{arch}.attention.layer_norm_rms_epsilon") == pytest.approx(1e-6)
    assert _field(reader, "general.file_type") == 14
    tokens = _field(reader, "tokenizer.ggml.tokens")
    assert len(tokens) == spec.vocab
    assert tokens[151643:151646] == list(SPECIAL_TOKENS)
    assert _field(reader, "tokenizer.ggml.eos_token_id") == 151645

    shapes = {t.name: (tuple(int(x) for x in t.shape), t.tensor_type) for t in reader.tensors}
    d, fe, fs, e, kv = spec.d_model, spec.expert_ff, spec.shared_expert_ff, spec.experts, 512
    assert shapes["token_embd.weight"] == ((d, spec.vocab), Q.Q4_K)
    assert shapes["output.weight"] == ((d, spec.vocab), Q.Q4_K)
    assert shapes["blk.1.attn_k.weight"] == ((d, kv), Q.Q4_K)
    assert shapes["blk.1.attn_k.bias"] == ((kv,), Q.F32)
    assert shapes["blk.1.ffn_gate_inp.weight"] == ((d, e), Q.F32)
    assert shapes["blk.1.ffn_gate_exps.weight"] == ((d, fe, e), Q.Q4_K)
    assert shapes["blk.1.ffn_down_exps.weight"] == ((fe, d, e), Q.Q4_K)
    assert shapes["blk.1.ffn_gate_inp_shexp.weight"] == ((d,), Q.F32)
    assert shapes["blk.1.ffn_down_shexp.weight"] == ((fs, d), Q.Q4_K)
    assert len(shapes) == 3 + 2 * 17

    down = next(t for t in reader.tensors if t.name == "blk.1.ffn_down_exps.weight")
    one_expert = np.asarray(down.data[5])  # expert 5: rows of Q4_K blocks
    values = dequantize(one_expert, Q.Q4_K)
    assert values.shape == (d, fe)
    assert np.isfinite(values).all()
    assert values.std() == pytest.approx(1 / np.sqrt(fe), rel=0.03)


def test_qwen3_30b_two_layers_matches_its_config(tmp_path: Path) -> None:
    """qwen3moe as the HF converter writes it: heads of 128 (not d_model / heads), q and k
    norms of a head's width, no attention biases, no shared expert."""
    spec = get_spec("qwen3-30b-a3b")
    assert (spec.layers, spec.d_model, spec.heads, spec.kv_heads, spec.head_dim) == (
        48, 2048, 32, 4, 128)
    assert (spec.experts, spec.top_k, spec.expert_ff, spec.ff) == (128, 8, 768, 6144)
    info = make_model(tmp_path / "q3.gguf", "qwen3-30b-a3b", "q4_k", n_layers=2, workers=2)
    reader = GGUFReader(info.path)
    assert _field(reader, "general.architecture") == "qwen3moe"
    for key, value in {"attention.key_length": 128, "attention.value_length": 128,
                       "expert_count": 128, "expert_used_count": 8,
                       "expert_feed_forward_length": 768, "embedding_length": 2048}.items():
        assert _field(reader, f"qwen3moe.{key}") == value, key
    assert "qwen3moe.expert_shared_feed_forward_length" not in reader.fields
    shapes = {t.name: tuple(int(x) for x in t.shape) for t in reader.tensors}
    assert shapes["blk.1.attn_q.weight"] == (2048, 4096)
    assert shapes["blk.1.attn_output.weight"] == (4096, 2048)
    assert shapes["blk.1.attn_k.weight"] == (2048, 512)
    assert shapes["blk.1.attn_q_norm.weight"] == shapes["blk.1.attn_k_norm.weight"] == (128,)
    assert shapes["blk.1.ffn_up_exps.weight"] == (2048, 768, 128)
    assert not [n for n in shapes if "shexp" in n or n.endswith(".bias")]
    assert len(shapes) == 3 + 2 * 12


def test_mixtral_is_llama_with_experts(tmp_path: Path) -> None:
    """Mixtral as the HF converter writes it: architecture llama, experts as wide as
    feed_forward_length (no expert_feed_forward_length key), no biases, norms or shared
    expert beyond llama's."""
    big = get_spec("mixtral-8x7b")
    assert (big.layers, big.experts, big.top_k, big.d_model, big.ff) == (32, 8, 2, 4096, 14336)
    assert (big.heads, big.kv_heads, big.vocab, big.rms_eps) == (32, 8, 32000, 1e-5)
    info = make_model(tmp_path / "mx.gguf", "tiny-mixtral", "q8_0", workers=1)
    reader = GGUFReader(info.path)
    assert _field(reader, "general.architecture") == "llama"
    assert _field(reader, "llama.feed_forward_length") == 512
    assert _field(reader, "llama.expert_count") == 8
    assert "llama.expert_feed_forward_length" not in reader.fields
    shapes = {t.name: tuple(int(x) for x in t.shape) for t in reader.tensors}
    assert shapes["blk.3.ffn_down_exps.weight"] == (512, 256, 8)
    assert {n.split(".", 2)[2] for n in shapes if n.startswith("blk.0.")} == {
        f"{t}.weight" for t in ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
                                "ffn_norm", "ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps",
                                "ffn_down_exps")}
    assert len(shapes) == 3 + 4 * 10


def test_olmoe_norms_the_whole_of_q_and_k(tmp_path: Path) -> None:
    big = get_spec("olmoe-1b-7b")
    assert (big.layers, big.experts, big.top_k, big.d_model, big.ff) == (16, 64, 8, 2048, 1024)
    assert (big.heads, big.kv_heads, big.vocab, big.rope_theta) == (16, 16, 50304, 10000.0)
    info = make_model(tmp_path / "ol.gguf", "tiny-olmoe", "q8_0", workers=1)
    reader = GGUFReader(info.path)
    assert _field(reader, "general.architecture") == "olmoe"
    assert "olmoe.expert_feed_forward_length" not in reader.fields
    shapes = {t.name: tuple(int(x) for x in t.shape) for t in reader.tensors}
    assert shapes["blk.0.attn_q_norm.weight"] == shapes["blk.0.attn_k_norm.weight"] == (256,)
    assert len(shapes) == 3 + 4 * 12


def test_granite_moe_writes_its_multipliers(tmp_path: Path) -> None:
    big = get_spec("granite-3.0-1b-a400m")
    assert (big.layers, big.experts, big.top_k, big.d_model, big.ff) == (24, 32, 8, 1024, 512)
    info = make_model(tmp_path / "gr.gguf", "tiny-granitemoe", "q8_0", workers=1)
    reader = GGUFReader(info.path)
    assert _field(reader, "general.architecture") == "granitemoe"
    for key, value in {"embedding_scale": 12.0, "residual_scale": 0.22,
                       "attention.scale": 0.015625, "logit_scale": 6.0}.items():
        assert _field(reader, f"granitemoe.{key}") == pytest.approx(value), key
    assert len(reader.tensors) == 3 + 4 * 10


def test_deepseek2_has_dense_leading_layers_latent_attention_and_grouped_routing(
        tmp_path: Path) -> None:
    lite = size_report(get_spec("deepseek-v2-lite"), "q4_k")
    assert lite.total_params == pytest.approx(15.7e9, rel=0.01)  # DeepSeek-V2-Lite's count
    assert lite.expert_bytes * 64 * 26 == lite.total_expert_bytes  # 26 of 27 layers routed
    info = make_model(tmp_path / "ds.gguf", "tiny-deepseek2", "q8_0", workers=1)
    reader = GGUFReader(info.path)
    assert _field(reader, "general.architecture") == "deepseek2"
    for key, value in {"leading_dense_block_count": 1, "expert_shared_count": 2,
                       "attention.q_lora_rank": 128, "attention.kv_lora_rank": 128,
                       "attention.key_length": 160, "attention.value_length": 128,
                       "attention.key_length_mla": 96, "attention.value_length_mla": 64,
                       "attention.head_count_kv": 1, "rope.dimension_count": 32,
                       "expert_gating_func": 2, "expert_group_count": 4,
                       "expert_group_used_count": 2, "expert_weights_norm": True,
                       "expert_weights_scale": 2.5}.items():
        assert _field(reader, f"deepseek2.{key}") == pytest.approx(value), key
    names = {t.name for t in reader.tensors}
    assert {"blk.0.ffn_gate.weight", "blk.0.ffn_down.weight"} <= names
    assert not any(n.startswith("blk.0.ffn_") and "exps" in n for n in names)
    for il in (1, 2, 3):
        assert {f"blk.{il}.ffn_gate_exps.weight", f"blk.{il}.exp_probs_b.bias",
                f"blk.{il}.ffn_up_shexp.weight", f"blk.{il}.attn_k_b.weight"} <= names
    assert read_model_file(info.path).moe_layers() == [1, 2, 3]


# --- tokenizer ---------------------------------------------------------------------------

def test_vocab_structure() -> None:
    vocab = make_vocab(151936, 151643)
    assert len(vocab.tokens) == len(set(vocab.tokens)) == 151936
    assert len(vocab.merges) >= 151643 - 256
    token_set = set(vocab.tokens)
    for merge in vocab.merges:
        left, right = merge.split(" ")
        assert left in token_set and right in token_set and left + right in token_set
    for token in vocab.tokens[256:151643]:
        decode_token(token).decode("utf-8")  # every merged token is whole text
    assert vocab.tokens[151643:151646] == list(SPECIAL_TOKENS)
    assert set(vocab.token_types[151643:151646]) == {3}  # CONTROL
    assert set(vocab.token_types[151646:]) == {5}  # UNUSED padding
    assert (vocab.eos_id, vocab.eot_id, vocab.bos_id) == (151645, 151645, 151643)
    small = make_vocab(2048)
    assert small.tokens[:2045] == vocab.tokens[:2045]  # smaller vocabularies are prefixes


# --- llama.cpp ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_models(tiny_model: Callable[[str], Path]) -> dict[str, Path]:
    return {q: tiny_model(q) for q in QTYPES}


@pytest.mark.parametrize("qtype", QTYPES)
def test_llama_cpp_loads_and_runs(tiny_models: dict[str, Path], qtype: str) -> None:
    llm = llama_cpp.Llama(model_path=str(tiny_models[qtype]), n_ctx=256, logits_all=True,
                          verbose=False)
    text = "Hello world, 123!"
    tokens = llm.tokenize(text.encode(), add_bos=False)
    assert llm.detokenize(tokens).decode() == text
    assert len(tokens) < len(text.encode())  # merges apply

    llm.eval(tokens)
    logits = np.asarray(llm.scores[: llm.n_tokens])
    assert np.isfinite(logits).all()
    assert logits.std() > 0.1
    top2 = np.sort(logits[-1])[-2:]
    assert top2[1] - top2[0] > 1e-4  # greedy has a unique choice

    runs = []
    for _ in range(2):
        llm.reset()
        out = llm(text, max_tokens=12, temperature=0.0)
        runs.append(out["choices"][0]["text"])
    assert runs[0] == runs[1] and runs[0]


def test_llama_cpp_chat_template(tiny_models: dict[str, Path]) -> None:
    llm = llama_cpp.Llama(model_path=str(tiny_models["q4_k"]), n_ctx=256, verbose=False)
    assert llm.metadata["tokenizer.chat_template"] == CHATML_TEMPLATE
    prompt = jinja2.Template(CHATML_TEMPLATE).render(
        messages=[{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    assert prompt == ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
                      "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    ids = llm.tokenize(prompt.encode(), add_bos=False, special=True)
    assert ids[0] == 2046 and ids.count(2047) == 2  # <|im_start|>, <|im_end|>
    assert llm.token_eos() == 2047
    reply = llm.create_chat_completion([{"role": "user", "content": "Hi"}], max_tokens=4,
                                       temperature=0.0)
    assert reply["choices"][0]["message"]["role"] == "assistant"


@pytest.mark.parametrize("qtype", QTYPES)
def test_simulated_shapes_size_experts_as_the_written_file(qtype: str) -> None:
    # the simulator and make-model agree on every expert's bytes, fallback types included
    from forecache.sim.shapes import shape_of

    for name in model_specs.model_names():
        spec = model_specs.get_spec(name)
        if spec.is_dense:  # a draft: no experts for the simulator
            with pytest.raises(ValueError, match="dense draft"):
                shape_of(name, qtype)
            continue
        report = model_specs.size_report(spec, qtype)
        assert shape_of(name, qtype).expert_bytes == report.expert_bytes, name


# --- dense drafts --------------------------------------------------------------------------

#: Dense presets and the MoE preset each drafts for.
DRAFTS = {"tiny-draft": "tiny", "qwen2-0.5b": "qwen2-57b-a14b"}


@pytest.mark.parametrize("draft", DRAFTS)
def test_a_draft_preset_has_its_targets_tokenizer(draft: str) -> None:
    d, target = get_spec(draft), get_spec(DRAFTS[draft])
    assert d.is_dense and d.writable and not target.is_dense
    assert (d.moe_layers, d.experts, d.top_k) == (0, 0, 0)
    # make-model writes make_vocab(vocab, text_tokens): the same keys are the same tokens,
    # merges and special tokens
    assert (d.vocab, d.text_tokens) == (target.vocab, target.text_tokens)
    assert size_report(d, "q8_0").active_bytes_per_token == size_report(d, "q8_0").total_bytes


def test_qwen2_0_5b_is_qwen2_0_5b() -> None:
    spec = get_spec("qwen2-0.5b")
    assert (spec.arch, spec.layers, spec.d_model, spec.heads, spec.kv_heads, spec.head_dim,
            spec.ff) == ("qwen2", 24, 896, 14, 2, 64, 4864)
    assert (spec.vocab, spec.rope_theta, spec.rms_eps, spec.tied_embeddings) == (
        151936, 1e6, 1e-6, True)
    f16 = size_report(spec, "f16")
    assert f16.total_params == 494_032_768  # Qwen2-0.5B's count, its embeddings tied
    assert f16.expert_params == f16.total_expert_bytes == f16.expert_bytes == 0
    plan = {t.name: t.ggml_type for t in tensor_plan(spec, "q4_k_m")}
    assert "output.weight" not in plan
    # llama.cpp's Q4_K_M: the tied token_embd takes the output's Q6_K, Q8_0 where its rows (896)
    # are no whole number of Q6_K blocks; so do attn_v's; Q4_K falls back to Q5_0 there
    assert plan["token_embd.weight"] == Q.Q8_0
    assert plan["blk.0.attn_v.weight"] == Q.Q8_0
    assert plan["blk.4.attn_q.weight"] == plan["blk.4.ffn_up.weight"] == Q.Q5_0
    assert plan["blk.0.ffn_down.weight"] == Q.Q6_K  # a layer use_more_bits picks
    assert plan["blk.4.ffn_down.weight"] == Q.Q4_K
    tiny = {t.name: t.ggml_type for t in tensor_plan(get_spec("tiny-draft"), "q4_k_m")}
    assert tiny["token_embd.weight"] == Q.Q6_K


def test_qwen2_0_5b_two_layers_header(tmp_path: Path) -> None:
    info = make_model(tmp_path / "q05.gguf", "qwen2-0.5b", "q4_0", n_layers=2, workers=2)
    assert info.dense and info.layers == 2
    mf = read_model_file(info.path)
    assert (mf.arch, mf.n_layer, mf.n_vocab, mf.is_moe) == ("qwen2", 2, 151936, False)
    for key, value in {"embedding_length": 896, "feed_forward_length": 4864,
                       "attention.head_count": 14, "attention.head_count_kv": 2,
                       "context_length": 32768}.items():
        assert mf.arch_kv(key) == value, key
    assert mf.arch_kv("rope.freq_base") == pytest.approx(1e6)
    assert mf.arch_kv("attention.layer_norm_rms_epsilon") == pytest.approx(1e-6)
    assert mf.arch_kv("expert_count") is None
    shapes = {t.name: t.shape for t in mf.tensors}
    assert shapes["token_embd.weight"] == (896, 151936) and "output.weight" not in shapes
    assert shapes["blk.1.attn_q.weight"] == (896, 896)
    assert shapes["blk.1.attn_k.weight"] == (896, 128) and shapes["blk.1.attn_k.bias"] == (128,)
    assert shapes["blk.1.ffn_down.weight"] == (4864, 896)
    assert len(shapes) == 2 + 2 * 12
    # llama.cpp reads the tokens make-model writes for qwen2-57b-a14b
    target = get_spec("qwen2-57b-a14b")
    vocab = make_vocab(target.vocab, target.text_tokens)
    llm = llama_cpp.Llama(model_path=str(info.path), vocab_only=True, verbose=False)
    try:
        v = llama_cpp.llama_model_get_vocab(llm.model)
        assert [llama_cpp.llama_vocab_get_text(v, i).decode() for i in range(llm.n_vocab())] \
            == vocab.tokens
        assert llm.token_eos() == vocab.eos_id
    finally:
        llm.close()


@pytest.fixture(scope="module")
def tiny_draft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny-draft in q8_0: a dense draft for the tiny model (seed 0)."""
    path = tmp_path_factory.mktemp("draft") / "tiny-draft-q8_0.gguf"
    make_model(path, "tiny-draft", "q8_0", workers=1)
    return path


@pytest.mark.parametrize("qtype", QTYPES)
def test_tiny_draft_runs_in_llama_cpp(tmp_path: Path, qtype: str) -> None:
    info = make_model(tmp_path / "d.gguf", "tiny-draft", qtype, workers=1)
    names = {t.name for t in read_model_file(info.path).tensors}
    assert "output.weight" not in names and "blk.3.ffn_down.weight" in names
    llm = llama_cpp.Llama(model_path=str(info.path), n_ctx=128, logits_all=True, verbose=False)
    try:
        tokens = llm.tokenize(b"Hello world, 123!", add_bos=False)
        llm.eval(tokens)
        logits = np.asarray(llm.scores[: llm.n_tokens])
        assert np.isfinite(logits).all() and logits.std() > 0.1
        llm.reset()
        assert llm("Hello world", max_tokens=8, temperature=0.0)["choices"][0]["text"]
    finally:
        llm.close()


def test_tiny_draft_drafts_for_tiny_exactly(tiny_model: Callable[[str], Path],
                                            tiny_draft: Path) -> None:
    from forecache.generate import SamplingParams, generate, last_logits
    from forecache.llama import Llama
    from forecache.placement.options import CacheConfig
    from forecache.speculative.draft import DraftContext, vocab_mismatch
    from tests.conftest import assert_same_tokens

    model, prompt, n_gen = tiny_model("q8_0"), [7, 99, 23, 5], 24
    cfg = CacheConfig("promoe", cache_fraction=0.5, predictor="history")
    with Llama(model, cache=cfg, n_ctx=256, n_threads=2, verbose=False) as llm:
        ctx = DraftContext(tiny_draft, n_ctx=256, n_batch=64, n_threads=2, capture=True)
        try:
            assert vocab_mismatch(llm, ctx) is None
            assert (ctx.n_layer, ctx.n_embd) == (4, 256)
            ctx.sync(prompt)
            assert np.isfinite(ctx.logits()).all()
            assert ctx.state(3) is not None  # its FFN inputs, for the model's routers
        finally:
            ctx.close()
        # the model alone, one row at a time: its greedy tokens and each step's logits
        llm.eval(prompt)
        ref, rows = [], []
        for _ in range(n_gen):
            rows.append(last_logits(llm))
            ref.append(int(np.argmax(rows[-1])))
            llm.eval([ref[-1]])
    with Llama(model, cache=cfg, n_ctx=256, n_threads=2, verbose=False, draft=str(tiny_draft),
               draft_k=3) as llm:
        got = generate(llm, prompt, n_gen, SamplingParams(greedy=True), ignore_eos=True)
        stats = llm.expert_stats()
    # the verification's k+1 rows in one pass: the same tokens up to a near tie at most
    assert_same_tokens(got.tokens, ref, np.array(rows), "tiny-draft")
    assert stats["drafted"] > 0 and stats["spec_prefetch"] == "cross-model"


def test_cli_says_a_dense_preset_is_a_draft(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from forecache.cli import cli

    runner = CliRunner()
    res = runner.invoke(cli, ["make-model", str(tmp_path / "d.gguf"), "--preset", "tiny-draft",
                              "--type", "q4_k_m", "--layers", "1"])
    assert res.exit_code == 0, res.output
    assert "dense draft tiny-draft" in res.stdout and "--draft" in res.stdout
    assert read_model_file(tmp_path / "d.gguf").n_layer == 1
    res = runner.invoke(cli, ["models", "--json"])
    assert res.exit_code == 0, res.output
    kinds = {r["name"]: r["kind"] for r in json.loads(res.stdout)["models"]}
    assert kinds["tiny-draft"] == kinds["qwen2-0.5b"] == "random-weight draft"
    assert kinds["tiny"] == "random-weight shape"

"""The run's options: one copy of every default, one route from knobs to a configuration, and
each placement fact written in one place."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import click
import pytest

from forecache.cli.generate_cmd import cache_options
from forecache.placement.options import SWITCHES, CacheConfig, Options

PKG = Path(__file__).resolve().parents[1] / "forecache"


def _cli_params() -> dict[str, click.Parameter]:
    @click.command()
    @cache_options
    def cmd(**_: object) -> None:
        pass

    return {p.name: p for p in cmd.params if p.name is not None}


def test_the_command_line_takes_its_defaults_from_options() -> None:
    """Every cache option is a field of Options (or one of promoe's switches) and defaults to
    the field's default: the command line holds no default of its own."""
    params = _cli_params()
    defaults = Options()
    fields = {f.name for f in dataclasses.fields(Options)}
    for name, param in params.items():
        if name.startswith("no_") and name[3:] in SWITCHES:
            assert param.default is False and getattr(defaults.features, name[3:]) is True
            continue
        assert name in fields, f"--{name.replace('_', '-')} is no field of Options"
        assert param.default == getattr(defaults, name), name


def test_the_command_line_and_keywords_resolve_alike() -> None:
    """The CLI's options and Llama's keywords reach a CacheConfig by one route."""
    cli = {name: p.default for name, p in _cli_params().items()}
    cli.update(policy="lru", cache_fraction=0.25, mode="mobile", little_k=2, gamma=0.4,
               no_prefetch=True)
    kwargs = {"policy": "lru", "cache_fraction": 0.25, "mode": "mobile", "little_k": 2,
              "gamma": 0.4, "n_ctx": 64}
    from_kwargs = Options.take(kwargs)
    assert kwargs == {"n_ctx": 64}  # llama.cpp's keywords stay
    got_cli = Options.from_cli(**cli).cache_config()
    got_kw = dataclasses.replace(from_kwargs, features=Options.from_cli(
        **cli).features).cache_config()
    assert got_cli == got_kw
    assert isinstance(got_cli, CacheConfig)
    assert (got_cli.policy, got_cli.little_k, got_cli.gamma) == ("lru", 2, 0.4)
    assert not got_cli.features.prefetch


def test_unnamed_policy_is_none_until_the_load_names_it() -> None:
    cfg = Options(cache_fraction=0.5).cache_config()
    assert cfg is not None and cfg.policy is None and cfg.spec.name == "promoe"
    with pytest.raises(ValueError, match="mode"):
        Options(mode="fast")
    with pytest.raises(ValueError, match="choose one"):
        Options(mode="mobile", draft="self-little")


def _sources() -> dict[str, str]:
    return {str(p.relative_to(PKG)): p.read_text() for p in sorted(PKG.rglob("*.py"))}


def test_each_fact_is_written_once() -> None:
    """The facts the runtime, the batch planner and the simulator share have one home each:
    MoBiLE's gamma, the stage-slot rule, promoe's predictor names."""
    src = _sources()
    gamma = [f for f, text in src.items()
             for line in text.splitlines() if "gamma" in line and re.search(r"\b0\.7\b", line)]
    assert gamma == ["placement/options.py"], gamma
    stage = [f for f, text in src.items() if re.search(r"MAX_STAGE_SLOTS\b|sum\(cached\) // 64",
                                                       text)]
    assert stage == ["cache/prefetcher.py"], stage
    assert not [f for f, text in src.items() if "stage_slots_for" in text]
    names = re.compile(r"""[\[(]\s*(?:"(?:auto|learned|history|eam|skip|token)",?\s*){2,}""")
    lists = sorted({f for f, text in src.items() for m in names.finditer(text)})
    assert lists == ["predictor/registry.py"], lists


def test_plan_names_one_of_two_things() -> None:
    """A class or function named "plan" is a batch job's (``BatchPlan``: how many sequences, how
    large a ubatch, where the KV cache and experts go) or the load's (``LoadPlan``); the
    budget's split, a layer's host split and the disk tier's host slots have names of their
    own."""
    src = _sources()
    named = sorted({m.group(1) for f, text in src.items() if not f.startswith("gguf/")
                    for m in re.finditer(r"^\s*(?:class|def) (\w*[Pp]lan\w*)", text, re.M)})
    assert named == ["BatchPlan", "LoadPlan", "choose_plan", "plan", "plan_cache", "plan_load"], \
        named
    assert not [f for f, text in src.items()
                if re.search(r"\b(?:MemoryPlan|DiskPlan|plan_memory|plan_disk)\b", text)]


def test_one_budget_rule_for_the_runtime_the_planner_and_the_simulator(tiny_model) -> None:
    """A budget becomes slots by one rule (``budget.BudgetSplit``: non-expert weights, KV cache
    and compute buffers first): the runtime's split of a GGUF, the batch planner's and the
    simulator's of its shape agree, and no flat reserve of their own is left."""
    from forecache.cache.budget import split_budget
    from forecache.gguf.header import read_model_file
    from forecache.roofline.batch import BatchPlan, Workload, layout
    from forecache.roofline.shape import model_shape, shape_of
    from forecache.sim.run import SIM_CONTEXT, SIM_UBATCH, slots_for

    target = shape_of("qwen2-57b-a14b", "q4_k")
    budget = 24 << 30
    rule = target.memory(budget, n_ctx=SIM_CONTEXT, n_ubatch=SIM_UBATCH)
    assert rule.fixed_bytes == (target.dense_bytes + target.kv_cache_bytes(SIM_CONTEXT)
                                + target.compute_bytes(SIM_UBATCH))
    work = Workload(1, 64.0, 64.0, SIM_CONTEXT)
    planned = layout(target, budget, work, BatchPlan(1, SIM_UBATCH))
    assert planned is not None
    assert slots_for(target, target.layers, "24GiB", None) == planned.slots == \
        min(rule.slots_per_layer())
    # the runtime's split of a GGUF is the same rule over the file's own sizes
    mf = read_model_file(tiny_model())
    shape = model_shape(mf)
    room = 272 << 20  # the compute buffers' reserve and a few slots a layer
    got = split_budget(mf, room, n_ctx=256, n_ubatch=64, device_name="test",
                      device_total=1 << 40)
    same = shape.memory(room, n_ctx=256, n_ubatch=64,
                        non_expert_bytes=got.non_expert_bytes)
    assert (same.kv_bytes, same.compute_bytes) == (got.kv_bytes, got.compute_bytes)
    assert min(same.slots_per_layer()) == min(got.slots_per_layer()[il]
                                              for il in mf.moe_layers())
    src = _sources()
    assert not [f for f, text in src.items() if "BUDGET_RESERVE =" in text and
                "AUTO_BUDGET_RESERVE" not in text]


def test_the_planner_holds_the_prompt_banks_the_runtime_holds(tiny_model) -> None:
    """Where the runtime places prompt banks (a GPU, most experts in slots), the batch planner's
    layout holds the same: the same slots left and regions of what they lack; where they would
    take more than their share of the budget, neither holds any."""
    from forecache.cache.budget import BANK_REGIONS, split_budget
    from forecache.gguf.header import read_model_file
    from forecache.placement.before import banks_asked, held_back
    from forecache.placement.options import CacheConfig
    from forecache.roofline.batch import BatchPlan, Workload, layout
    from forecache.roofline.shape import model_shape

    mf = read_model_file(tiny_model())
    shape, layers = model_shape(mf), mf.moe_layers()
    expert = max(mf.layer_expert_bytes())
    base = split_budget(mf, 1 << 40, n_ctx=256, n_ubatch=64, device_name="gpu",
                        device_total=1 << 50)
    cfg = CacheConfig("promoe", cache_fraction=0.5)
    assert banks_asked(cfg, "cuda") and not banks_asked(cfg, "cpu")
    # infinity reads every routing, which a bank layer does not
    assert not banks_asked(CacheConfig("infinity", cache_fraction=0.5), "cuda")
    for share, placed in ((0.9, True), (0.3, False)):
        budget = base.fixed_bytes + int(share * len(layers) * mf.n_expert * expert)
        split = split_budget(mf, budget, n_ctx=256, n_ubatch=64, device_name="gpu",
                             device_total=1 << 50)
        _, held = held_back(mf, CacheConfig("promoe", gpu_budget=budget), split,
                            split.slots_per_layer(), "cuda", proactive=True)
        lay = layout(shape, budget, Workload(1, 64.0, 64.0, 256), BatchPlan(1, 64),
                     non_expert_bytes=split.non_expert_bytes, bank=True)
        assert lay is not None and (held > 0) == placed == (lay.bank > 0)
        left = min(split.slots_per_layer(held=held)[il] for il in layers)
        assert lay.slots == left
        assert held == BANK_REGIONS * lay.bank

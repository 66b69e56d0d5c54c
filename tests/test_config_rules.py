"""The rules across settings (``CROSS_FIELD_RULES``): each rule's CEL, evaluated with
``celpy``, agrees with its Python predicate on random values of its fields, and both
outcomes occur; the config classes, a live PUT's merge and the messages use the table."""

from __future__ import annotations

import functools
from typing import Any

import celpy
import pytest
from celpy import celtypes
from hypothesis import given, settings
from hypothesis import strategies as st

from iterserve.config import (
    CROSS_FIELD_RULES,
    ConfigError,
    EngineConfig,
    Rule,
    SchedulerConfig,
    Tier,
    fill,
)
from iterserve.server.live_config import LiveConfigError, VersionedSettings, merge

COUNT = st.integers(0, 64)
TIERS = st.lists(
    st.builds(Tier, name=st.sampled_from("abc"), priority=st.integers(0, 2)),
    min_size=1,
    max_size=4,
)
# Values of every field a rule reads: small ranges, so that the rules' boundaries are hit.
FIELD_VALUES: dict[str, st.SearchStrategy[Any]] = {
    "max_num_seqs": COUNT,
    "max_num_batched_tokens": COUNT,
    "long_prefill_token_threshold": COUNT,
    "max_waiting": COUNT,
    "max_waiting_per_tenant": st.none() | COUNT,
    "max_model_len": st.none() | COUNT,
    "enable_chunked_prefill": st.booleans(),
    "preemption_mode": st.sampled_from(["auto", "recompute", "swap"]),
    "swap_space": st.sampled_from([0.0, 0.5]) | st.floats(0, 8),
    "tiers": TIERS,
    "quantization": st.sampled_from(["none", "int8", "q4"]),
    "tensor_parallel_size": st.integers(1, 8),
    "dtype": st.sampled_from(["auto", "bfloat16", "float16", "float32"]),
}


def to_cel(value: Any) -> Any:
    """A setting's value as the API server hands it to CEL (floats as doubles)."""
    if isinstance(value, bool):
        return celtypes.BoolType(value)
    if isinstance(value, int):
        return celtypes.IntType(value)
    if isinstance(value, float):
        return celtypes.DoubleType(value)
    if isinstance(value, str):
        return celtypes.StringType(value)
    return celtypes.ListType(
        [
            celtypes.MapType(
                {
                    celtypes.StringType("name"): celtypes.StringType(t.name),
                    celtypes.StringType("priority"): celtypes.IntType(t.priority),
                }
            )
            for t in value
        ]
    )


@functools.cache
def program(rule: Rule) -> Any:
    env = celpy.Environment()
    return env.program(env.compile(fill(rule.cel, {f: f"self.{f}" for f in rule.fields})))


def cel_holds(rule: Rule, values: dict[str, Any]) -> bool:
    """``rule``'s CEL on ``self``: the values, None ones absent."""
    this = {celtypes.StringType(k): to_cel(v) for k, v in values.items() if v is not None}
    result = program(rule).evaluate({"self": celtypes.MapType(this)})
    assert isinstance(result, celtypes.BoolType), (rule.cel, result)  # no CEL error
    return bool(result)


@pytest.mark.parametrize("rule", CROSS_FIELD_RULES, ids=lambda rule: rule.message[:40])
def test_cel_and_python_agree(rule: Rule) -> None:
    outcomes = set()
    program(rule)  # compiled outside hypothesis (celpy's parser raises the recursion limit)

    @given(st.fixed_dictionaries({name: FIELD_VALUES[name] for name in rule.fields}))
    @settings(max_examples=100, deadline=None, derandomize=True, database=None)
    def agree(values: dict[str, Any]) -> None:
        holds = rule.holds(values)
        assert cel_holds(rule, values) == holds, values
        outcomes.add(holds)

    agree()
    assert outcomes == {True, False}  # the samples break the rule and keep it


def test_every_placeholder_is_a_field() -> None:
    for rule in CROSS_FIELD_RULES:
        names = {name: name for name in rule.fields}
        fill(rule.cel, names)  # KeyError on a placeholder that names no field
        assert rule.explain() == fill(rule.message, names)
        assert set(rule.fields) <= set(FIELD_VALUES)


def test_scheduler_config_checks_its_rules_with_values() -> None:
    with pytest.raises(ConfigError) as e:
        SchedulerConfig(max_waiting=8, max_waiting_per_tenant=9)
    assert str(e.value) == (
        "max_waiting_per_tenant must be <= max_waiting (got max_waiting_per_tenant=9, "
        "max_waiting=8)"
    )
    tiers = [{"name": "a", "priority": 0}, {"name": "a", "priority": 1}]
    with pytest.raises(ConfigError, match=r"names must be unique in tiers \(got tiers="):
        SchedulerConfig(tiers=tiers)


def test_engine_config_checks_the_rules_across_its_parts() -> None:
    with pytest.raises(ConfigError, match="preemption_mode swap needs swap space"):
        EngineConfig.from_kwargs(preemption_mode="swap")
    EngineConfig.from_kwargs(preemption_mode="swap", swap_space=0.5)
    # A rule reading fields of two parts: the scheduler's budget and the model's length.
    with pytest.raises(ConfigError, match="must be >= max_model_len"):
        EngineConfig.from_kwargs(
            enable_chunked_prefill=False, long_prefill_token_threshold=0, max_model_len=512
        )


def test_a_live_merge_checks_the_rules_with_the_start_up_settings() -> None:
    current = VersionedSettings(SchedulerConfig(), 1)
    with pytest.raises(LiveConfigError, match=r"swap_space=0\b"):
        merge(current, {"preemption_mode": "swap"}, swap_space=0, max_model_len=0)
    merged = merge(current, {"preemption_mode": "swap"}, swap_space=1.0, max_model_len=0)
    assert merged is not None and merged.config.preemption_mode == "swap"

"""The policy file: defaults, validation errors that name the key, byte sizes, run_dir templates."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import textwrap
import traceback
from pathlib import Path
from typing import Any, get_args, get_origin

import hypothesis.strategies as st
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from pydantic import BaseModel

from ckptpilot.errors import PolicyError
from ckptpilot.policy import (
    AsyncPolicy,
    Policy,
    RemoteTierPolicy,
    load_policy,
    parse_byte_size,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_YAML = REPO_ROOT / "configs" / "default.yaml"


def write_policy(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "policy.yaml"
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def load_text(tmp_path: Path, text: str) -> Policy:
    return load_policy(write_policy(tmp_path, text))


# --- defaults -------------------------------------------------------------------------------


def test_default_yaml_equals_builtin_defaults() -> None:
    assert load_policy(DEFAULT_YAML) == load_policy(None)


def test_default_yaml_sets_every_key_explicitly() -> None:
    """The reference file documents every key, so its keys are exactly the model's."""

    def keys(tree: dict, prefix: str = "") -> set[str]:
        found = set()
        for key, value in tree.items():
            path = f"{prefix}{key}"
            found.add(path)
            if isinstance(value, dict):
                found |= keys(value, f"{path}.")
        return found

    from_file = yaml.safe_load(DEFAULT_YAML.read_text(encoding="utf-8"))
    assert keys(from_file) == keys(Policy().model_dump(by_alias=True))


def test_reference_values() -> None:
    policy = Policy()
    assert policy.run_dir == "runs/default"
    assert policy.scheduler.base_interval == 100
    assert (policy.scheduler.min_interval, policy.scheduler.max_interval) == (10, 500)
    assert policy.scheduler.weights.grad == 0.35
    assert (policy.scheduler.grad.z_low, policy.scheduler.grad.z_high) == (5.0, 10.0)
    loss = policy.scheduler.loss
    assert (loss.level_span_steps, loss.center_span_steps, loss.spread_span_steps) == (14, 24, 32)
    assert policy.scheduler.grad.span_probes == 32
    assert policy.scheduler.system.hazard_window_steps == 100
    assert policy.scheduler.system.nvml == "auto"
    assert policy.levels.heartbeat.every == 1
    assert policy.codecs.weights == "xor_delta"
    assert policy.tiers.memory.max_bytes == 8 * 2**30
    assert policy.tiers.peer.endpoints == ()
    assert policy.tiers.remote.url == "{run_dir}/checkpoints"
    assert policy.validation.load_test == "subprocess"
    assert policy.retention.important_keep == 3
    assert policy.async_.max_pending == 2


def test_empty_file_gives_defaults(tmp_path: Path) -> None:
    assert load_text(tmp_path, "") == load_policy(None)
    assert load_text(tmp_path, "# only a comment\n") == load_policy(None)


def test_models_are_frozen() -> None:
    policy = Policy()
    with pytest.raises(ValueError, match="frozen"):
        policy.scheduler.base_interval = 5  # type: ignore[misc]


# --- errors name the key --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "key", "match"),
    [
        ("bogus: 1", "bogus", "unknown key"),
        ("scheduler:\n  min_intervall: 5", "scheduler.min_intervall", "mean 'min_interval'"),
        ("scheduler:\n  loss: {z_low: 5.0, windw: 3}", "scheduler.loss.windw", "unknown"),
        ("scheduler:\n  loss: {ewma_alpha: 0.2}", "scheduler.loss.ewma_alpha", "unknown"),
        ("scheduler:\n  grad: {k_sigma: 3.0}", "scheduler.grad.k_sigma", "unknown"),
        ("tiers:\n  memory: {max_bytes: 1GiB, cap: 2}", "tiers.memory.cap", "unknown"),
        ("async: {max_pending: 2, extra: 1}", "async.extra", "unknown key"),
    ],
)
def test_unknown_keys_are_rejected_with_full_path(
    tmp_path: Path, text: str, key: str, match: str
) -> None:
    with pytest.raises(PolicyError, match=match) as info:
        load_text(tmp_path, text)
    assert info.value.key == key


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("scheduler:\n  base_interval: '100'", "scheduler.base_interval"),
        ("scheduler:\n  min_interval: 10.5", "scheduler.min_interval"),
        ("scheduler:\n  young_daly: 1", "scheduler.young_daly"),
        ("scheduler:\n  system: {nvml: 1}", "scheduler.system.nvml"),
        ("scheduler:\n  system: {nvml: maybe}", "scheduler.system.nvml"),
        ("scheduler: 5", "scheduler"),
        ("codecs: {weights: gzip}", "codecs.weights"),
        ("validation: {load_test: off}", "validation.load_test"),
        ("tiers:\n  peer: {endpoints: 'a:1'}", "tiers.peer.endpoints"),
        ("run_dir: 3", "run_dir"),
        ("async: {max_pending: two}", "async.max_pending"),
        ("scheduler:\n  loss: {z_low: .nan}", "scheduler.loss.z_low"),
    ],
)
def test_wrong_types_name_the_key(tmp_path: Path, text: str, key: str) -> None:
    with pytest.raises(PolicyError) as info:
        load_text(tmp_path, text)
    assert info.value.key == key
    assert str(info.value).startswith(f"{key}: ")


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("scheduler:\n  min_interval: 0", "scheduler.min_interval"),
        ("scheduler:\n  max_interval: -5", "scheduler.max_interval"),
        ("scheduler:\n  organ_every: 0", "scheduler.organ_every"),
        ("scheduler:\n  trigger_threshold: 1.5", "scheduler.trigger_threshold"),
        ("scheduler:\n  trigger_refractory_fraction: 1.5",
         "scheduler.trigger_refractory_fraction"),
        ("scheduler:\n  system: {alarm_signal: 0}", "scheduler.system.alarm_signal"),
        ("scheduler:\n  system: {alarm_signal: 1.2}", "scheduler.system.alarm_signal"),
        ("scheduler:\n  loss: {z_high: 0}", "scheduler.loss.z_high"),
        ("scheduler:\n  loss: {spread_span_steps: 3}", "scheduler.loss.spread_span_steps"),
        ("scheduler:\n  loss: {slope_threshold: -0.1}", "scheduler.loss.slope_threshold"),
        ("scheduler:\n  grad: {span_probes: 3}", "scheduler.grad.span_probes"),
        ("scheduler:\n  grad: {growth_allowance: -1}", "scheduler.grad.growth_allowance"),
        ("scheduler:\n  system: {hazard_window_steps: -1}",
         "scheduler.system.hazard_window_steps"),
        ("scheduler:\n  loss: {level_span_steps: 1}", "scheduler.loss.level_span_steps"),
        ("scheduler:\n  grad: {probe_every: 0}", "scheduler.grad.probe_every"),
        ("scheduler:\n  system: {io_latency_ms: 0}", "scheduler.system.io_latency_ms"),
        ("levels:\n  heartbeat: {every: 0}", "levels.heartbeat.every"),
        ("codecs: {prefix_bits: 32}", "codecs.prefix_bits"),
        ("codecs: {zstd_level: 0}", "codecs.zstd_level"),
        ("codecs: {threads: -1}", "codecs.threads"),
        ("tiers:\n  memory: {max_bytes: 0}", "tiers.memory.max_bytes"),
        ("tiers:\n  peer: {data_shards: 0}", "tiers.peer.data_shards"),
        ("retention: {critical_score: 1.2}", "retention.critical_score"),
        ("retention: {routine_keep: 0}", "retention.routine_keep"),
        ("async: {max_pending: 0}", "async.max_pending"),
    ],
)
def test_out_of_range_values_name_the_key(tmp_path: Path, text: str, key: str) -> None:
    with pytest.raises(PolicyError) as info:
        load_text(tmp_path, text)
    assert info.value.key == key


def test_min_above_max_blames_min_interval(tmp_path: Path) -> None:
    text = "scheduler: {min_interval: 600, max_interval: 500, base_interval: 550}"
    with pytest.raises(PolicyError, match=r"min_interval \(600\) is above max_interval") as info:
        load_text(tmp_path, text)
    assert info.value.key == "scheduler.min_interval"


@pytest.mark.parametrize("base", [5, 501])
def test_base_outside_range_blames_base_interval(tmp_path: Path, base: int) -> None:
    with pytest.raises(PolicyError, match=r"within \[min_interval, max_interval\]") as info:
        load_text(tmp_path, f"scheduler: {{base_interval: {base}}}")
    assert info.value.key == "scheduler.base_interval"


def test_important_above_critical_blames_important_score(tmp_path: Path) -> None:
    with pytest.raises(PolicyError, match="above critical_score") as info:
        load_text(tmp_path, "retention: {critical_score: 0.4, important_score: 0.5}")
    assert info.value.key == "retention.important_score"


@pytest.mark.parametrize(
    ("weights", "match"),
    [
        ("{loss: 0.5, grad: 0.5, system: 0.5}", r"must sum to 1, got .* = 1\.5"),
        ("{loss: 0.5, grad: 0.5}", r"got 0\.5 \+ 0\.5 \+ 0\.25 = 1\.25 \(a weight left out"),
        ("{loss: 1.2, grad: -0.2, system: 0.0}", "must not be negative"),
    ],
)
def test_weights_must_be_non_negative_and_sum_to_one(
    tmp_path: Path, weights: str, match: str
) -> None:
    with pytest.raises(PolicyError, match=match) as info:
        load_text(tmp_path, f"scheduler:\n  weights: {weights}")
    assert info.value.key == "scheduler.weights"


def test_weights_sum_tolerates_rounding(tmp_path: Path) -> None:
    policy = load_text(tmp_path, "scheduler:\n  weights: {loss: 0.1, grad: 0.2, system: 0.7}")
    assert policy.scheduler.weights.system == 0.7


def test_error_message_names_the_file(tmp_path: Path) -> None:
    path = write_policy(tmp_path, "async: {max_pending: 0}")
    with pytest.raises(PolicyError, match=f"in {path}"):
        load_policy(path)


# --- file-level errors ----------------------------------------------------------------------


def test_yaml_syntax_error_names_file_and_line(tmp_path: Path) -> None:
    path = write_policy(tmp_path, "run_dir: x\nscheduler:\n  base_interval: [1, 2\n")
    with pytest.raises(PolicyError, match=rf"{path}:\d+: invalid YAML") as info:
        load_policy(path)
    assert info.value.key == ""


def test_duplicate_key_is_a_yaml_error(tmp_path: Path) -> None:
    path = write_policy(tmp_path, "run_dir: a\nrun_dir: b\n")
    with pytest.raises(PolicyError, match=rf"{path}:2: invalid YAML: duplicate key 'run_dir'"):
        load_policy(path)


@pytest.mark.parametrize("text", ["- a\n- b\n", "just a string\n", "42\n"])
def test_non_mapping_yaml_is_rejected(tmp_path: Path, text: str) -> None:
    path = write_policy(tmp_path, text)
    with pytest.raises(PolicyError, match=rf"{path}: the top level must be a mapping") as info:
        load_policy(path)
    assert info.value.key == ""


def test_missing_file_names_the_path(tmp_path: Path) -> None:
    path = tmp_path / "nope.yaml"
    with pytest.raises(PolicyError, match=f"policy file not found: {path}"):
        load_policy(path)


# --- byte sizes and endpoints ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("8GiB", 8 * 2**30),
        ("512MB", 512 * 10**6),
        ("512 MB", 512 * 10**6),
        ("1.5KiB", 1536),
        ("100B", 100),
        ("100", 100),
        ("2TiB", 2 * 2**40),
        (4096, 4096),
    ],
)
def test_parse_byte_size(value: int | str, expected: int) -> None:
    assert parse_byte_size(value) == expected


@pytest.mark.parametrize("value", ["8 gigs", "8GiBs", "1.5B", "-1KB", "", -1, 1.5, True])
def test_parse_byte_size_rejects(value: object) -> None:
    with pytest.raises(ValueError):
        parse_byte_size(value)  # type: ignore[arg-type]


def test_max_bytes_accepts_units_and_ints(tmp_path: Path) -> None:
    assert load_text(tmp_path, "tiers:\n  memory: {max_bytes: 512MB}").tiers.memory.max_bytes == (
        512 * 10**6
    )
    assert load_text(tmp_path, "tiers:\n  memory: {max_bytes: 1024}").tiers.memory.max_bytes == 1024


def test_bad_byte_size_names_the_key(tmp_path: Path) -> None:
    with pytest.raises(PolicyError, match="as a byte size") as info:
        load_text(tmp_path, "tiers:\n  memory: {max_bytes: 8 gigs}")
    assert info.value.key == "tiers.memory.max_bytes"


def test_endpoints_are_host_port(tmp_path: Path) -> None:
    policy = load_text(
        tmp_path, "tiers:\n  peer: {endpoints: ['10.0.0.1:7000', 'node-2:7001', '[::1]:7002']}"
    )
    assert policy.tiers.peer.endpoints == ("10.0.0.1:7000", "node-2:7001", "[::1]:7002")


@pytest.mark.parametrize("bad", ["node-2", "node-2:0", "node-2:70000", ":7000", "a b:1"])
def test_bad_endpoint_names_the_item(tmp_path: Path, bad: str) -> None:
    with pytest.raises(PolicyError, match="expected 'host:port'") as info:
        load_text(tmp_path, f"tiers:\n  peer: {{endpoints: ['h:1', '{bad}']}}")
    assert info.value.key == "tiers.peer.endpoints[1]"


# --- run_dir templates ----------------------------------------------------------------------


def test_run_dir_is_interpolated_from_the_file(tmp_path: Path) -> None:
    policy = load_text(tmp_path, "run_dir: /data/exp7")
    assert policy.tiers.remote.url == "/data/exp7/checkpoints"


def test_run_dir_override_wins_over_the_file(tmp_path: Path) -> None:
    path = write_policy(tmp_path, "run_dir: /data/exp7")
    policy = load_policy(path, run_dir=tmp_path / "exp8")
    assert policy.run_dir == str(tmp_path / "exp8")
    assert policy.tiers.remote.url == f"{tmp_path / 'exp8'}/checkpoints"


def test_interpolation_reaches_every_string(tmp_path: Path) -> None:
    policy = load_text(
        tmp_path, "run_dir: r1\ntiers:\n  remote: {url: 'file://{run_dir}/ck/{run_dir}'}"
    )
    assert policy.tiers.remote.url == "file://r1/ck/r1"


def test_literal_braces_are_escaped(tmp_path: Path) -> None:
    policy = load_text(tmp_path, "tiers:\n  remote: {url: 'memory://b/{{x}}/{run_dir}'}")
    assert policy.tiers.remote.url == "memory://b/{x}/runs/default"


@pytest.mark.parametrize("url", ["{rundir}/ck", "{run_dir!r}", "{run_dir:>9}", "{}", "a}b", "{a"])
def test_bad_placeholder_names_the_key(tmp_path: Path, url: str) -> None:
    with pytest.raises(PolicyError, match="placeholder") as info:
        load_text(tmp_path, f"tiers:\n  remote: {{url: '{url}'}}")
    assert info.value.key == "tiers.remote.url"


def test_run_dir_cannot_refer_to_itself(tmp_path: Path) -> None:
    with pytest.raises(PolicyError, match="itself") as info:
        load_text(tmp_path, "run_dir: '{run_dir}/x'")
    assert info.value.key == "run_dir"


def test_with_run_dir_twice_re_resolves_from_the_template() -> None:
    first = load_policy(None, run_dir="/a").with_run_dir("/b")
    second = first.with_run_dir("/c")
    assert first.tiers.remote.url == "/b/checkpoints"
    assert second.tiers.remote.url == "/c/checkpoints"
    assert second.run_dir == "/c"
    assert second == load_policy(None, run_dir="/c")


def test_with_run_dir_on_an_unresolved_policy() -> None:
    policy = Policy().with_run_dir(Path("/r"))
    assert policy.tiers.remote.url == "/r/checkpoints"


def test_with_run_dir_keeps_changes_made_after_loading() -> None:
    loaded = load_policy(None, run_dir="/a")
    changed = loaded.model_copy(update={"async_": AsyncPolicy(max_pending=7)})
    moved = changed.with_run_dir("/b")
    assert moved.async_.max_pending == 7
    assert moved.tiers.remote.url == "/b/checkpoints"


def test_with_run_dir_keeps_an_explicit_url() -> None:
    loaded = load_policy(None, run_dir="/a")
    remote = RemoteTierPolicy(url="memory://b")
    pinned = loaded.model_copy(update={"tiers": loaded.tiers.model_copy(update={"remote": remote})})
    assert pinned.with_run_dir("/b").tiers.remote.url == "memory://b"


def test_policies_compare_and_hash_by_value() -> None:
    assert Policy().with_run_dir("/a") == load_policy(None, run_dir="/a")
    assert hash(load_policy(None)) == hash(load_policy(None))
    assert Policy() != load_policy(None)


# --- async alias and YAML round trip --------------------------------------------------------


def test_async_alias_works_both_ways(tmp_path: Path) -> None:
    assert Policy(**{"async": {"max_pending": 4}}).async_.max_pending == 4
    assert Policy(async_=AsyncPolicy(max_pending=5)).async_.max_pending == 5
    assert load_text(tmp_path, "async: {max_pending: 3}").async_.max_pending == 3
    dumped = Policy().model_dump(by_alias=True)
    assert "async" in dumped
    assert "async_" not in dumped


@pytest.mark.parametrize("section", ["async", "async_"])
def test_error_paths_use_the_yaml_spelling_of_async(tmp_path: Path, section: str) -> None:
    with pytest.raises(PolicyError) as info:
        load_text(tmp_path, f"{section}: {{max_pending: 0}}")
    assert info.value.key == "async.max_pending"


def test_to_yaml_round_trips(tmp_path: Path) -> None:
    original = load_text(
        tmp_path,
        """\
        run_dir: /data/exp9
        scheduler: {base_interval: 50, weights: {loss: 0.5, grad: 0.5, system: 0.0}}
        tiers:
          memory: {max_bytes: 2GiB}
          peer: {enabled: true, endpoints: ['h1:7000', 'h2:7000', 'h3:7000', 'h4:7000']}
          remote: {url: 'memory://bucket/{run_dir}'}
        async: {max_pending: 3}
        """,
    )
    text = original.to_yaml()
    assert "async:" in text
    assert "async_" not in text
    path = tmp_path / "roundtrip.yaml"
    path.write_text(text, encoding="utf-8")
    again = load_policy(path)
    assert again == original
    changed = original.model_copy(update={"async_": AsyncPolicy(max_pending=1)})
    path.write_text(changed.to_yaml(), encoding="utf-8")
    assert load_policy(path) == changed
    assert again.tiers.remote.url == "memory://bucket//data/exp9"
    assert again.with_run_dir("/x").tiers.remote.url == "memory://bucket//x"


# --- every value is bounded -----------------------------------------------------------------


def section_of(annotation: Any) -> type[BaseModel] | None:
    for candidate in (annotation, *get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def leaf_fields(model: type[BaseModel] = Policy, prefix: str = "") -> dict[str, Any]:
    """Every leaf of the policy as its dotted YAML path and annotation, sections walked."""
    found: dict[str, Any] = {}
    for name, field in model.model_fields.items():
        key = prefix + (field.alias or name)
        if get_origin(field.annotation) is dict:
            continue  # a mapping of named entries (extra_signals): tested in its own file
        section = section_of(field.annotation)
        if section is None:
            found[key] = field.annotation
        else:
            found |= leaf_fields(section, f"{key}.")
    return found


LEAVES = leaf_fields()
NUMERIC = sorted(key for key, annotation in LEAVES.items() if annotation in (int, float))
FLOATS = sorted(key for key in NUMERIC if LEAVES[key] is float)
WEIGHTS = "scheduler.weights"  # bounded together: non-negative, summing to 1


def setting(key: str, value: object) -> dict[str, Any]:
    """A policy tree that sets ``key`` (a dotted path) to ``value`` and nothing else of note."""
    tree: dict[str, Any] = {}
    node = tree
    *sections, leaf = key.split(".")
    for section in sections:
        node = node.setdefault(section, {})
    node[leaf] = value
    if sections == ["retention", "best"] and leaf != "metric":
        node["metric"] = "val_loss"
    return tree


def load_tree(tmp_path: Path, tree: dict[str, Any]) -> Policy:
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump(tree), encoding="utf-8")
    return load_policy(path)


def blamed(key: str) -> str:
    return WEIGHTS if key.startswith(f"{WEIGHTS}.") else key


def test_the_walk_reaches_every_section() -> None:
    assert {
        "scheduler.grad.span_probes",
        "scheduler.weights.loss",
        "levels.heartbeat.every",
        "codecs.threads",
        "tiers.memory.max_bytes",
        "tiers.peer.timeout_seconds",
        "tiers.remote.bandwidth",
        "retention.best.keep",
        "async.max_pending",
    } <= set(NUMERIC)
    assert "tiers.peer.lease_seconds" in FLOATS


@pytest.mark.parametrize("key", NUMERIC)
def test_every_numeric_field_has_an_upper_bound(tmp_path: Path, key: str) -> None:
    """Consumers size buffers, pools and timeouts from these: none may be unbounded."""
    with pytest.raises(PolicyError, match=r"less than or equal to|must sum to 1") as info:
        load_tree(tmp_path, setting(key, 10**60))
    assert info.value.key == blamed(key)


@pytest.mark.parametrize("key", NUMERIC)
def test_every_numeric_field_refuses_negatives(tmp_path: Path, key: str) -> None:
    with pytest.raises(PolicyError) as info:
        load_tree(tmp_path, setting(key, -1))
    assert info.value.key == blamed(key)


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("key", FLOATS)
def test_every_float_field_refuses_non_finite_values(
    tmp_path: Path, key: str, value: float
) -> None:
    with pytest.raises(PolicyError) as info:
        load_tree(tmp_path, setting(key, value))
    assert info.value.key == key


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("run_dir", "r" * 5000),
        ("tiers.remote.url", "u" * 5000),
        ("retention.best.metric", "m" * 300),
        ("tiers.peer.endpoints", [f"h{i}:7000" for i in range(1025)]),
        ("tiers.peer.endpoints", ["h" * 300 + ":7000"]),
        ("tiers.peer.registry", "r" * 300 + ":7000"),
    ],
)
def test_strings_and_lists_are_bounded(tmp_path: Path, key: str, value: object) -> None:
    with pytest.raises(PolicyError) as info:
        load_tree(tmp_path, setting(key, value))
    assert info.value.key.startswith(key)


def test_the_bounds_admit_what_a_large_run_needs(tmp_path: Path) -> None:
    policy = load_text(
        tmp_path,
        """\
        scheduler:
          base_interval: 1000000
          max_interval: 1000000
          loss: {level_span_steps: 1000, center_span_steps: 1000, spread_span_steps: 1000,
                 slope_threshold: 1000.0}
          grad: {span_probes: 1000, probe_every: 1000}
          system: {sustained_seconds: 3600, hazard_window_steps: 1000000}
        codecs: {threads: 256}
        tiers:
          memory: {max_bytes: 2TiB}
          peer: {data_shards: 63, lease_seconds: 86400, timeout_seconds: 600,
                 probe_interval: 0.05}
          remote: {bandwidth: 100GB}
        retention: {routine_keep: 1000, best: {metric: val_loss, keep: 100}}
        async: {max_pending: 8}
        """,
    )
    assert policy.scheduler.grad.span_probes == 1000
    assert policy.tiers.memory.max_bytes == 2 * 2**40
    assert policy.tiers.peer.timeout_seconds == 600


@pytest.mark.parametrize(
    ("text", "key", "match"),
    [
        ("scheduler:\n  loss: {z_low: 6, z_high: 6}", "scheduler.loss.z_high",
         r"z_high \(6\) must be above z_low \(6\).*raise z_high"),
        ("scheduler:\n  grad: {z_low: 9, z_high: 4}", "scheduler.grad.z_high",
         r"z_high \(4\) must be above z_low \(9\)"),
        ("scheduler:\n  loss: {drift_low: 10}", "scheduler.loss.drift_high",
         r"drift_high \(10\) must be above drift_low \(10\)"),
        ("scheduler:\n  grad: {growth_low: 12}", "scheduler.grad.growth_high",
         r"growth_high \(10\) must be above growth_low \(12\).*raise growth_high"),
    ],
)
def test_a_signal_band_upside_down_names_its_upper_key(
    tmp_path: Path, text: str, key: str, match: str
) -> None:
    with pytest.raises(PolicyError, match=match) as info:
        load_text(tmp_path, text)
    assert info.value.key == key


def test_the_new_signal_keys_load_from_yaml(tmp_path: Path) -> None:
    policy = load_text(
        tmp_path,
        """\
        scheduler:
          loss: {level_span_steps: 4, center_span_steps: 6, spread_span_steps: 16, z_low: 3,
                 z_high: 6.5, slope_threshold: 0,
                 drift_allowance: 1, drift_low: 2, drift_high: 4}
          grad: {span_probes: 16, z_low: 2, z_high: 4, growth_allowance: 0.5, growth_low: 1,
                 growth_high: 2}
          system: {hazard_window_steps: 0}
        """,
    )
    loss, grad = policy.scheduler.loss, policy.scheduler.grad
    assert (loss.level_span_steps, loss.center_span_steps, loss.spread_span_steps) == (4, 6, 16)
    assert (loss.z_low, loss.z_high, grad.span_probes) == (3.0, 6.5, 16)
    assert (loss.drift_allowance, loss.drift_low, loss.drift_high) == (1.0, 2.0, 4.0)
    assert (grad.growth_allowance, grad.growth_low, grad.growth_high) == (0.5, 1.0, 2.0)
    assert policy.scheduler.system.hazard_window_steps == 0


# --- the cases of the issue: each used to escape as another exception or fail later --------


@pytest.mark.parametrize("span", [100_000_000_000, 200_000_000])
def test_a_grad_span_beyond_its_bound_is_refused(tmp_path: Path, span: int) -> None:
    # An EWMA that needs more than 1000 probes to follow a change is no signal.
    with pytest.raises(PolicyError, match="less than or equal to 1000 ") as info:
        load_text(tmp_path, f"scheduler:\n  grad: {{span_probes: {span}}}")
    assert info.value.key == "scheduler.grad.span_probes"


def test_a_timeout_that_overflows_sockets_is_refused(tmp_path: Path) -> None:
    with pytest.raises(PolicyError, match="less than or equal to 86400") as info:
        load_text(tmp_path, "tiers:\n  peer: {timeout_seconds: 1.0e+300}")
    assert info.value.key == "tiers.peer.timeout_seconds"


def test_a_byte_that_is_not_utf8_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    path.write_bytes(b"run_dir: x\n# caf\xe9 au lait\nasync: {max_pending: 2}\n")
    with pytest.raises(PolicyError, match=rf"{path}:2: byte 0xe9 at offset 16 is not UTF") as info:
        load_policy(path)
    assert info.value.key == ""


@pytest.mark.parametrize("literal", ["9" * 5000, "0x" + "f" * 5000, "1" * 65])
def test_an_integer_too_long_for_any_policy_value_is_refused(tmp_path: Path, literal: str) -> None:
    path = write_policy(tmp_path, f"run_dir: x\nasync: {{max_pending: {literal}}}\n")
    with pytest.raises(PolicyError, match=rf"{path}:2: invalid YAML: integer literal of") as info:
        load_policy(path)
    assert info.value.key == ""


@pytest.mark.parametrize(
    "text",
    [
        "bogus: " + "[" * 20_000 + "]" * 20_000,
        "bogus: " + "{a: " * 20_000 + "1" + "}" * 20_000,
        "".join(" " * level + "a:\n" for level in range(600)) + " " * 600 + "b: 1\n",
    ],
    ids=["flow-lists", "flow-mappings", "block-mappings"],
)
def test_deep_nesting_is_refused_before_the_recursion_limit(tmp_path: Path, text: str) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(PolicyError, match=r"invalid YAML: nested deeper than 32 levels"):
        load_policy(path)


BILLION_LAUGHS = """\
a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]
b: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]
c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b]
d: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c]
e: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d]
f: &f [*e, *e, *e, *e, *e, *e, *e, *e, *e]
g: &g [*f, *f, *f, *f, *f, *f, *f, *f, *f]
h: &h [*g, *g, *g, *g, *g, *g, *g, *g, *g]
i: &i [*h, *h, *h, *h, *h, *h, *h, *h, *h]
"""


def test_an_alias_bomb_is_refused_before_anything_expands_it(tmp_path: Path) -> None:
    """PyYAML shares aliased values, so loading is cheap; what must not happen is a later
    repr of the 9**9 values (pydantic's message for the unknown key ``i`` is one)."""
    path = write_policy(tmp_path, BILLION_LAUGHS)
    with pytest.raises(PolicyError, match=rf"{path}:5: invalid YAML: .* more than 10000 values"):
        load_policy(path)


def test_a_refused_alias_bomb_prints_a_short_traceback(tmp_path: Path) -> None:
    with pytest.raises(PolicyError) as info:
        load_text(tmp_path, BILLION_LAUGHS)
    assert len("".join(traceback.format_exception(info.value))) < 10_000


def test_an_alias_chain_deeper_than_the_text_is_refused(tmp_path: Path) -> None:
    chain = [f"x{i}: &x{i} [*x{i - 1}]" for i in range(1, 40)]
    text = "\n".join(["x0: &x0 [1]", *chain, "tiers: {peer: {endpoints: *x39}}"])
    with pytest.raises(PolicyError, match="with its aliases expanded, this value is nested deeper"):
        load_text(tmp_path, text)


@pytest.mark.parametrize("text", ["bogus: &a [*a]", "tiers: {peer: {endpoints: &a [*a]}}"])
def test_an_alias_inside_its_own_value_is_refused(tmp_path: Path, text: str) -> None:
    with pytest.raises(PolicyError, match="invalid YAML: an alias refers to a value that contains"):
        load_text(tmp_path, text)


def test_merge_keys_are_refused_with_a_fix(tmp_path: Path) -> None:
    text = "x: &beat {every: 2}\nlevels:\n  heartbeat: {<<: *beat}\n"
    with pytest.raises(PolicyError, match=r":3: invalid YAML: merge keys \(<<\) are not supported"):
        load_text(tmp_path, text)


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("!!int ", "'' is not a valid !!int"),
        ("async: {max_pending: !!int two}", "'two' is not a valid !!int"),
        ("scheduler: {trigger_threshold: !!float high}", "'high' is not a valid !!float"),
        ("scheduler: {young_daly: !!bool maybe}", "'maybe' is not a valid !!bool"),
        ("run_dir: !!timestamp soon", "'soon' is not a valid !!timestamp"),
        ("!!set 0", "expected a mapping node"),
        ("!!omap :", "found unhashable key"),
    ],
)
def test_explicit_tags_and_keys_pyyaml_cannot_build_are_yaml_errors(
    tmp_path: Path, text: str, match: str
) -> None:
    """PyYAML's scalar constructors trust the resolver's patterns, which an explicit tag skips:
    these raised IndexError, ValueError and TypeError."""
    with pytest.raises(PolicyError, match=rf":1: invalid YAML: {re.escape(match)}") as info:
        load_text(tmp_path, text)
    assert info.value.key == ""


def test_an_explicit_tag_that_agrees_with_the_value_is_fine(tmp_path: Path) -> None:
    assert load_text(tmp_path, "async: {max_pending: !!int '3'}").async_.max_pending == 3


def test_a_directory_is_not_a_policy_file(tmp_path: Path) -> None:
    with pytest.raises(PolicyError, match=f"{tmp_path} is a directory; pass the policy YAML file"):
        load_policy(tmp_path)


def test_a_nul_byte_in_the_path_is_a_policy_error(tmp_path: Path) -> None:
    with pytest.raises(PolicyError, match=r"cannot read policy file .*null byte"):
        load_policy(f"{tmp_path}/a\0b.yaml")


def test_a_file_over_a_mebibyte_is_refused_unread(tmp_path: Path) -> None:
    path = write_policy(tmp_path, "run_dir: x\n" + "# padding\n" * 110_000)
    with pytest.raises(PolicyError, match=rf"{path} is over 1 MiB; a policy file is a few KB"):
        load_policy(path)


@pytest.mark.parametrize(
    ("url", "match"),
    [
        ("nope://bucket/ck", "unknown storage protocol 'nope' in 'nope://bucket/ck'"),
        ("fiel:///data/ck", "unknown storage protocol 'fiel' .*did you mean 'file'"),
        ("simplecache::nope://b/ck", "unknown storage protocol 'nope'"),
        ("nope::/data/ck", "unknown storage protocol 'nope'"),
    ],
)
def test_an_unknown_storage_protocol_is_refused(tmp_path: Path, url: str, match: str) -> None:
    with pytest.raises(PolicyError, match=match) as info:
        load_text(tmp_path, f"tiers:\n  remote: {{url: '{url}'}}")
    assert info.value.key == "tiers.remote.url"


def test_a_protocol_that_arrives_through_run_dir_is_checked_too(tmp_path: Path) -> None:
    with pytest.raises(PolicyError, match="unknown storage protocol 'nope'") as info:
        load_policy(None, run_dir="nope://bucket/run")
    assert info.value.key == "tiers.remote.url"


def _absent_backend() -> tuple[str, str]:
    """A protocol fsspec knows whose package is not installed here (s3 while s3fs is absent):
    the test never depends on which extras a machine has."""
    from fsspec.registry import known_implementations

    for protocol in sorted(known_implementations, key=lambda p: (p != "s3", p)):
        package = known_implementations[protocol]["class"].split(".", 1)[0]
        if package != "fsspec" and importlib.util.find_spec(package) is None:
            return protocol, package
    raise AssertionError("every fsspec backend is installed")


def test_a_storage_backend_that_is_not_installed_names_the_package(tmp_path: Path) -> None:
    protocol, package = _absent_backend()
    with pytest.raises(PolicyError, match=rf"'{protocol}' storage .* not installed "
                       rf".*pip install {package}") as e:
        load_text(tmp_path, f"tiers:\n  remote: {{url: '{protocol}://bucket/{{run_dir}}'}}")
    assert e.value.key == "tiers.remote.url"


@pytest.mark.parametrize(
    "url", ["/data/ck", "relative/ck", "file:///data/ck", "memory://ck", "simplecache::file:///x"]
)
def test_installed_protocols_and_local_paths_load(tmp_path: Path, url: str) -> None:
    assert load_text(tmp_path, f"tiers:\n  remote: {{url: '{url}'}}").tiers.remote.url == url


PEERS = ["h1:7000", "h2:7000", "h3:7000", "h4:7000"]


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"endpoints": PEERS[:3]}, r"4 shards \(3 data \+ 1 parity\).* but 3 endpoint"),
        ({"endpoints": []}, r"4 shards .* but 0 endpoint"),
        ({"endpoints": PEERS[:2], "data_shards": 2, "parity": False}, None),
        ({"endpoints": PEERS[:2], "data_shards": 3, "parity": False}, r"3 shards \(3 data\)"),
        ({"endpoints": PEERS, "data_shards": 4}, r"5 shards \(4 data \+ 1 parity\)"),
        ({"endpoints": PEERS}, None),
    ],
)
def test_an_enabled_peer_tier_needs_one_endpoint_per_shard(
    tmp_path: Path, options: dict[str, object], match: str | None
) -> None:
    tree = {"tiers": {"peer": {"enabled": True, **options}}}
    if match is None:
        assert load_tree(tmp_path, tree).tiers.peer.enabled
        return
    with pytest.raises(PolicyError, match=match) as info:
        load_tree(tmp_path, tree)
    assert info.value.key == "tiers.peer.endpoints"


def test_a_disabled_peer_tier_does_not_count_endpoints(tmp_path: Path) -> None:
    policy = load_tree(tmp_path, {"tiers": {"peer": {"enabled": False, "endpoints": PEERS[:1]}}})
    assert policy.tiers.peer.endpoints == ("h1:7000",)


def test_a_repeated_endpoint_names_the_repeat(tmp_path: Path) -> None:
    endpoints = [*PEERS, "h2:7000"]
    with pytest.raises(PolicyError, match="'h2:7000' is listed twice") as info:
        load_tree(tmp_path, {"tiers": {"peer": {"endpoints": endpoints}}})
    assert info.value.key == "tiers.peer.endpoints[4]"


@pytest.mark.parametrize(
    ("best", "key", "match"),
    [
        ("{metric: '', mode: min}", "retention.best.metric", "at least 1 character"),
        ("{metric: val_loss, mode: up}", "retention.best.mode", "'min' or 'max'"),
        ("{metric: val_loss, keep: 0}", "retention.best.keep", "greater than or equal to 1"),
        ("{mode: min}", "retention.best.metric", "Field required"),
        ("{metric: val_loss, mod: min}", "retention.best.mod", "did you mean 'mode'"),
    ],
)
def test_errors_inside_retention_best_name_the_field(
    tmp_path: Path, best: str, key: str, match: str
) -> None:
    with pytest.raises(PolicyError, match=match) as info:
        load_text(tmp_path, f"retention:\n  best: {best}")
    assert info.value.key == key


def test_moving_a_policy_that_holds_a_huge_int_is_a_policy_error() -> None:
    """A model built in Python can hold an int too long for ``repr``; the message says so."""
    huge = AsyncPolicy.model_construct(max_pending=10**5000)
    policy = load_policy(None).model_copy(update={"async_": huge})
    with pytest.raises(PolicyError, match=r"\(got <int too large to show>\)") as info:
        policy.with_run_dir("/r")
    assert info.value.key == "async.max_pending"


# --- nothing but PolicyError ----------------------------------------------------------------

SECTIONS = sorted({key.rsplit(".", 1)[0] for key in LEAVES if "." in key})
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**70), max_value=10**70)
    | st.floats()
    | st.text(max_size=12)
    | st.sampled_from(["8GiB", "h:1", "[::1]:2", "auto", "{run_dir}", "nope://x", "memory://x"])
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.sampled_from(sorted(LEAVES)) | st.text(max_size=4), inner, max_size=4)
    ),
    max_leaves=12,
)


ANY_TREE = settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@ANY_TREE
@given(st.dictionaries(st.sampled_from(sorted(LEAVES) + SECTIONS), VALUES, max_size=6))
def test_any_policy_tree_loads_or_raises_policy_error(
    tmp_path: Path, settings_by_key: dict[str, Any]
) -> None:
    """Any value at any key, or nested under it, either loads or names what is wrong."""
    tree: dict[str, Any] = {}
    for key, value in settings_by_key.items():
        node = tree
        *sections, leaf = key.split(".")
        for section in sections:
            child = node.setdefault(section, {})
            node = child if isinstance(child, dict) else {}
        node[leaf] = value
    try:
        load_tree(tmp_path, tree)
    except PolicyError as exc:
        assert str(exc)


YAML_TEXT = st.text(alphabet="[]{}:,&*!|>-<?'\"#%@`\n \t\\abx01e9.+", max_size=80)
SNIPPETS = st.sampled_from(
    ["&a ", "*a", "<<: ", "!!int ", "!!python/name:os.system ", "0x" + "f" * 70, "9" * 70, "\xff"]
)


@ANY_TREE
@given(st.lists(YAML_TEXT | SNIPPETS, max_size=8).map("".join), st.binary(max_size=4))
def test_any_text_loads_or_raises_policy_error(tmp_path: Path, text: str, tail: bytes) -> None:
    """YAML syntax, tags, anchors and stray bytes in any order: a policy or a PolicyError."""
    path = tmp_path / "policy.yaml"
    path.write_bytes(text.encode() + tail)
    try:
        load_policy(path)
    except PolicyError as exc:
        assert str(exc)


@pytest.mark.parametrize("key", ["run_dir", "url"])
@pytest.mark.parametrize("char", ["\x00", "\n", "\x7f"])
def test_a_control_character_in_a_path_is_refused_at_load(tmp_path: Path, key: str,
                                                           char: str) -> None:
    data = ({"run_dir": f"runs/a{char}b"} if key == "run_dir"
            else {"tiers": {"remote": {"url": f"/data/a{char}b"}}})
    with pytest.raises(PolicyError, match="control character") as info:
        load_policy(write_policy(tmp_path, yaml.safe_dump(data)))
    assert info.value.key == ("run_dir" if key == "run_dir" else "tiers.remote.url")


@pytest.mark.parametrize(("section", "key"), [("loss", "drift_allowance"),
                                              ("grad", "growth_allowance")])
def test_an_allowance_that_silences_its_cusum_is_refused(tmp_path: Path, section: str,
                                                         key: str) -> None:
    text = f"scheduler: {{{section}: {{z_high: 4.0, z_low: 2.0, {key}: 4.0}}}}\n"
    with pytest.raises(PolicyError, match=f"{key} .* must be below z_high") as info:
        load_text(tmp_path, text)
    assert info.value.key == f"scheduler.{section}.{key}"


HUGE_NUMBERS = {
    "int": "9" * 5000,
    "negative-int": "-" + "9" * 5000,
    "underscored-int": "1_" * 2500 + "1",
    "hex": "0x" + "f" * 5000,
    "octal": "0o" + "7" * 5000,
    "sexagesimal": "1:" * 2000 + "1",
    "float": "9" * 5000 + ".5",
    "negative-float": "-" + "9" * 5000 + ".0",
    "exponent": "1" + "0" * 5000 + "e9",
    "quoted": "'" + "9" * 5000 + "'",
    "byte-size": "'" + "9" * 5000 + " GiB'",
}
DEEP_VALUES = {
    "flow-lists": "[" * 5000 + "]" * 5000,
    "flow-mappings": "{a: " * 5000 + "1" + "}" * 5000,
    "mixed": "[{a: " * 2000 + "1" + "}]" * 2000,
    "just-under-the-limit": "[" * 30 + "]" * 30,
    "as-a-key": "{? " + "[" * 40 + "]" * 40 + " : 1}",
}


@pytest.mark.parametrize("leaf", sorted(LEAVES))
def test_a_5000_digit_number_at_any_key_is_a_policy_error(tmp_path: Path, leaf: str) -> None:
    """Issue 23.6: every spelling of a 5000-digit number, at every key of the schema, is a
    PolicyError (never OverflowError / ValueError from int or float conversion)."""
    for name, literal in HUGE_NUMBERS.items():
        *sections, key = leaf.split(".")
        text = "".join(f"{'  ' * i}{s}:\n" for i, s in enumerate(sections))
        path = write_policy(tmp_path, text + f"{'  ' * len(sections)}{key}: {literal}\n")
        try:
            load_policy(path).to_yaml()
        except PolicyError as exc:
            assert str(exc), name


@pytest.mark.parametrize("section", [*SECTIONS, "bogus"])
def test_deep_nesting_under_any_section_is_a_policy_error(tmp_path: Path, section: str) -> None:
    """Issue 23.6: deep lists and maps (flow or keyed) under every section are refused with a
    PolicyError naming the file, never a RecursionError."""
    for name, value in DEEP_VALUES.items():
        *outer, last = section.split(".")
        text = "".join(f"{'  ' * i}{s}:\n" for i, s in enumerate(outer))
        path = write_policy(tmp_path, text + f"{'  ' * len(outer)}{last}: {value}\n")
        with pytest.raises(PolicyError) as info:
            load_policy(path)
        assert str(path) in str(info.value), name


def test_the_cli_names_a_hostile_policy_and_exits_2(tmp_path: Path) -> None:
    path = write_policy(tmp_path, "async:\n  max_pending: " + "9" * 5000 + "\n")
    done = subprocess.run([sys.executable, "-m", "ckptpilot", "ls", "--config", str(path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert f"{path}:2: invalid YAML: integer literal of 5000 characters" in done.stderr
    assert "Traceback" not in done.stderr

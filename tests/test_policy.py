"""The policy file: defaults, validation errors that name the key, byte sizes, run_dir templates."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import yaml

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
    assert policy.scheduler.grad.k_sigma == 3.0
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
        ("scheduler:\n  loss: {ewma_alpha: 0.2, windw: 3}", "scheduler.loss.windw", "unknown"),
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
        ("scheduler:\n  loss: {ewma_alpha: .nan}", "scheduler.loss.ewma_alpha"),
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
        ("scheduler:\n  loss: {ewma_alpha: 0}", "scheduler.loss.ewma_alpha"),
        ("scheduler:\n  loss: {window: 1}", "scheduler.loss.window"),
        ("scheduler:\n  grad: {probe_every: 0}", "scheduler.grad.probe_every"),
        ("scheduler:\n  grad: {consecutive: 0}", "scheduler.grad.consecutive"),
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
    policy = load_text(tmp_path, "tiers:\n  remote: {url: 's3://b/{{x}}/{run_dir}'}")
    assert policy.tiers.remote.url == "s3://b/{x}/runs/default"


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
    pinned = loaded.model_copy(
        update={"tiers": loaded.tiers.model_copy(update={"remote": RemoteTierPolicy(url="s3://b")})}
    )
    assert pinned.with_run_dir("/b").tiers.remote.url == "s3://b"


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
          peer: {enabled: true, endpoints: ['h1:7000', 'h2:7000']}
          remote: {url: 's3://bucket/{run_dir}'}
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
    assert again.tiers.remote.url == "s3://bucket//data/exp9"
    assert again.with_run_dir("/x").tiers.remote.url == "s3://bucket//x"

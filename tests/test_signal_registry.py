"""Scheduler signals behind one protocol: a new signal is one module plus one policy entry.

The signals added here live in ``tests/ceiling_signal.py``, outside ``ckptpilot``; they reach
the scheduler, the decision and (in the two-rank test) the cross-rank agreement through
``scheduler.extra_signals`` in a policy file, and nothing else.
"""

from __future__ import annotations

import json
import math
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ckptpilot import load_policy
from ckptpilot.errors import PolicyError
from ckptpilot.policy import Policy
from ckptpilot.scheduler import SIGNAL_KEYS, AdaptiveCheckpointScheduler, RetentionClass
from ckptpilot.scheduler.signal import SignalLayout

JOB = Path(__file__).with_name("signaljob.py")

CEILING = """\
scheduler:
  weights: {loss: 0.0, grad: 0.0, system: 0.2}
  trigger_refractory_fraction: 0.0
  extra_signals:
    ceiling: {factory: "ceiling_signal:LossCeiling", weight: 0.8, params: {ceiling: 100}}
"""


def policy_from(tmp_path: Path, text: str) -> Policy:
    path = tmp_path / "policy.yaml"
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return load_policy(path)


def scheduler_from(tmp_path: Path, text: str) -> AdaptiveCheckpointScheduler:
    policy = policy_from(tmp_path, text)
    return AdaptiveCheckpointScheduler(policy.scheduler, policy.retention)


def measurement(scheduler: AdaptiveCheckpointScheduler, **values: float) -> dict[str, float]:
    return {**dict.fromkeys(scheduler.signal_keys, 0.0), **values}


def the_extra_signal(scheduler: AdaptiveCheckpointScheduler, name: str) -> object:
    """The instance the policy entry built (white-box: to see what the scheduler fed it)."""
    return next(s.signal for s in scheduler._signals if s.name == name)


# -- the default policy is unchanged ------------------------------------------------------


def test_without_extra_signals_the_scheduler_measures_the_built_in_keys() -> None:
    scheduler = AdaptiveCheckpointScheduler(Policy().scheduler)
    assert scheduler.signal_keys == SIGNAL_KEYS == (
        "loss", "grad", "system", "hard_errors", "non_finite")
    assert scheduler.layout == SignalLayout(maxed=SIGNAL_KEYS, summed=())
    assert "extra_signals" not in Policy().to_yaml()


# -- a signal added by its policy entry ---------------------------------------------------


def test_an_extra_signal_is_measured_under_its_key_and_moves_the_decision(
    tmp_path: Path,
) -> None:
    with_it = scheduler_from(tmp_path, CEILING)
    without = scheduler_from(tmp_path, "scheduler:\n  weights: {loss: 0.0, grad: 0.8, "
                                       "system: 0.2}\n  trigger_refractory_fraction: 0.0\n")
    assert with_it.signal_keys == ("loss", "grad", "ceiling", "system", "hard_errors",
                                   "non_finite")
    losses = [1.0 + 0.01 * math.sin(step) for step in range(1, 61)]
    losses[49] = 500.0  # step 50: at the ceiling
    decisions = [with_it.decide(step, loss) for step, loss in enumerate(losses, 1)]
    baseline = [without.decide(step, loss) for step, loss in enumerate(losses, 1)]
    spike = decisions[49]
    assert spike.signals["ceiling"] == 1.0 and "ceiling" not in baseline[49].signals
    assert spike.save and spike.reason.startswith("trigger")
    assert spike.score == pytest.approx(0.8 + 0.2 * spike.signals["system"])
    assert not any(d.save for d in baseline)  # the same losses, no extra signal: no save
    assert [d.step for d in decisions if d.save] == [50]
    assert the_extra_signal(with_it, "ceiling").measured_steps == list(range(1, 61))


def test_the_class_attributes_say_whether_a_signal_shortens_or_marks_damage(
    tmp_path: Path,
) -> None:
    shortening = scheduler_from(tmp_path, CEILING)
    # 100 · (1 − 0.8 · 0.5) = 60: a signal that declares shortens_interval shortens it.
    decision = shortening.decide_from(1, measurement(shortening, ceiling=0.5))
    assert decision.interval == 60
    assert decision.retention_class is RetentionClass.ROUTINE  # score 0.4
    critical = shortening.decide_from(2, measurement(shortening, ceiling=1.0))
    assert critical.retention_class is RetentionClass.CRITICAL  # score 0.8, nothing damaged

    damage = scheduler_from(tmp_path, CEILING.replace("LossCeiling", "LossCeilingDamage"))
    decision = damage.decide_from(1, measurement(damage, ceiling=1.0))
    assert decision.interval == 100  # it weighs in the score only
    assert decision.score == pytest.approx(0.8)
    assert decision.retention_class is RetentionClass.IMPORTANT  # critical score, damaged


def test_an_extra_signal_at_half_or_more_is_a_precursor_that_raises_the_hazard(
    tmp_path: Path,
) -> None:
    scheduler = scheduler_from(tmp_path, CEILING)
    assert scheduler.measure(1, 1.0)["system"] == 0.0
    assert scheduler.measure(2, 500.0)["system"] == 1.0
    assert scheduler.measure(3, 1.0)["system"] == pytest.approx(0.99)


def test_the_signals_are_told_of_a_restore(tmp_path: Path) -> None:
    scheduler = scheduler_from(tmp_path, CEILING)
    scheduler.restart(7)
    assert the_extra_signal(scheduler, "ceiling").restarts == [7]


def test_a_summed_signal_is_laid_out_apart_for_the_agreement(tmp_path: Path) -> None:
    scheduler = scheduler_from(tmp_path, CEILING.replace("LossCeiling", "LossCeilingVote"))
    assert scheduler.layout == SignalLayout(
        maxed=("loss", "grad", "system", "hard_errors", "non_finite"), summed=("ceiling",))


def test_a_policy_with_an_extra_signal_round_trips_through_yaml(tmp_path: Path) -> None:
    policy = policy_from(tmp_path, CEILING)
    again = policy_from(tmp_path, policy.to_yaml())
    assert again == policy and hash(again.scheduler) == hash(policy.scheduler)
    assert again.scheduler.extra_signals["ceiling"].params == {"ceiling": 100}


# -- mistakes in the entry name their key -------------------------------------------------


@pytest.mark.parametrize(
    ("entry", "key", "match"),
    [
        ('{factory: "no_such_module:X", weight: 0.8}', "scheduler.extra_signals.ceiling.factory",
         "No module named 'no_such_module'"),
        ('{factory: "ceiling_signal:Nope", weight: 0.8}',
         "scheduler.extra_signals.ceiling.factory", "cannot import name 'Nope'"),
        ('{factory: "not an import path", weight: 0.8}',
         "scheduler.extra_signals.ceiling.factory", "package.module:ClassName"),
        ('{factory: "ceiling_signal:LossCeiling", weight: 0.8}',
         "scheduler.extra_signals.ceiling.params.ceiling", "Field required"),
        ('{factory: "ceiling_signal:LossCeiling", weight: 0.8, params: {ceiling: -1}}',
         "scheduler.extra_signals.ceiling.params.ceiling", "greater than 0"),
        ('{factory: "ceiling_signal:LossCeiling", weight: 0.8, params: {ceiling: 1, hue: 2}}',
         "scheduler.extra_signals.ceiling.params.hue", "Extra inputs"),
        ('{factory: "ceiling_signal:NoParams", weight: 0.8, params: {ceiling: 1}}',
         "scheduler.extra_signals.ceiling.params", "takes no params"),
        ('{factory: "ceiling_signal:NoParams", weight: 1.5}',
         "scheduler.extra_signals.ceiling.weight", "less than or equal to 1"),
        ('{factory: "ceiling_signal:NoParams", weight: -0.1}',
         "scheduler.extra_signals.ceiling.weight", "greater than or equal to 0"),
        ('{factory: "ceiling_signal:NoParams"}',
         "scheduler.extra_signals.ceiling.weight", "Field required"),
    ],
)
def test_a_wrong_entry_is_refused_when_the_policy_loads(
    tmp_path: Path, entry: str, key: str, match: str
) -> None:
    text = CEILING.replace(CEILING.splitlines()[-1], f"    ceiling: {entry}")
    with pytest.raises(PolicyError, match=match) as info:
        policy_from(tmp_path, text)
    assert info.value.key == key


@pytest.mark.parametrize("name", ["loss", "system", "non_finite", "Loud", "2fast"])
def test_an_extra_signal_cannot_take_a_built_in_key_or_an_odd_name(
    tmp_path: Path, name: str
) -> None:
    with pytest.raises(PolicyError, match="cannot name a signal") as info:
        policy_from(tmp_path, CEILING.replace("    ceiling:", f"    {name}:"))
    assert info.value.key == f"scheduler.extra_signals.{name}"


def test_the_weights_with_the_extra_signals_must_sum_to_one(tmp_path: Path) -> None:
    with pytest.raises(PolicyError, match=r"loss \+ grad \+ system \+ "
                       r"extra_signals\.ceiling\.weight must sum to 1, got "
                       r"0\.4 \+ 0\.35 \+ 0\.25 \+ 0\.8 = 1\.8") as info:
        policy_from(tmp_path, CEILING.replace("  weights: {loss: 0.0, grad: 0.0, system: 0.2}\n",
                                              ""))
    assert info.value.key == "scheduler.weights"


def test_a_class_that_is_no_signal_is_refused_when_the_scheduler_is_built(
    tmp_path: Path,
) -> None:
    policy = policy_from(tmp_path, CEILING.replace(
        "    ceiling: {factory: \"ceiling_signal:LossCeiling\", weight: 0.8, params: "
        "{ceiling: 100}}", "    ceiling: {factory: \"ceiling_signal:SummedBadly\", weight: 0.8}"))
    with pytest.raises(PolicyError, match="no scheduler Signal: its combine is 'mean'") as info:
        AdaptiveCheckpointScheduler(policy.scheduler)
    assert info.value.key == "scheduler.extra_signals.ceiling.factory"


# -- two real gloo ranks agree on an extra signal ------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.crash
def test_two_ranks_combine_extra_signals_by_max_and_by_sum(tmp_path: Path) -> None:
    # ceiling (max): 1.0 on a rank whose loss is at least 100; votes (sum): 0.5 on a rank
    # whose loss is at least 10. Trigger at a score of 0.3.
    cfg = tmp_path / "policy.yaml"
    cfg.write_text(textwrap.dedent("""\
        scheduler:
          base_interval: 1000
          max_interval: 100000
          young_daly: false
          trigger_threshold: 0.3
          trigger_refractory_fraction: 0.0
          weights: {loss: 0.0, grad: 0.0, system: 0.0}
          extra_signals:
            ceiling: {factory: "ceiling_signal:LossCeiling", weight: 0.7,
                      params: {ceiling: 100}}
            votes: {factory: "ceiling_signal:LossCeilingVote", weight: 0.3,
                    params: {ceiling: 10, value: 0.5}}
        validation: {load_test: none}
        observability: {tensorboard: false, decision_log: true}
        """))
    # Step 20: rank 1 alone reaches both ceilings (max 1.0, votes 0.5: score 0.85).
    # Step 40: rank 0 alone votes (0.5 · 0.3 = 0.15: no save). Step 60: both vote (sum 1.0,
    # score 0.3: a save that a max, 0.5, would not have made).
    spikes = {0: ["40:50", "60:50"], 1: ["20:1000", "60:50"]}
    port = free_port()
    run_dir = tmp_path / "run"
    procs = [subprocess.Popen(
        [sys.executable, str(JOB), "--rank", str(r), "--port", str(port), "--run-dir",
         str(run_dir), "--config", str(cfg), *(f"--spike={s}" for s in spikes[r])],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    outs = [p.communicate(timeout=240) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]

    logs = [(run_dir / f"decisions_rank_{r:05d}.jsonl").read_text().splitlines() for r in (0, 1)]
    assert logs[0] == logs[1], "the ranks took different decisions"
    decisions = {d["step"]: d for d in map(json.loads, logs[0])}
    assert sorted(decisions) == list(range(1, 71))
    # A step is decided from the values the ranks agreed at the step before.
    assert decisions[21]["signals"]["ceiling"] == 1.0 and decisions[21]["signals"]["votes"] == 0.5
    assert decisions[41]["signals"]["votes"] == 0.5 and decisions[41]["save"] is False
    assert decisions[61]["signals"]["votes"] == 1.0 and decisions[61]["signals"]["ceiling"] == 0
    assert [s for s, d in decisions.items() if d["save"]] == [21, 61]
    assert all(decisions[s]["reason"].startswith("trigger") for s in (21, 61))
    assert results[0]["saves"] == results[1]["saves"]
    assert [step for step, _ in results[0]["saves"]] == [21, 61]

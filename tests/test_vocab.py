"""The shared vocabulary: stored words, the speed order of tiers, the checkpoint key."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from ckptpilot import vocab
from ckptpilot.vocab import CheckpointKey, Level, RecoverySource, RetentionClass, Status, Tier


def test_every_member_equals_the_word_written_to_disk() -> None:
    assert [m.value for m in Level] == ["heartbeat", "pulse", "organ"]
    assert [m.value for m in Tier] == ["memory", "peer", "remote"]
    assert [m.value for m in Status] == ["pending", "valid", "corrupted", "expired"]
    assert [m.value for m in RetentionClass] == ["critical", "important", "routine",
                                                 "milestone"]
    assert [m.value for m in RecoverySource] == ["memory", "peer", "remote", "none"]
    assert Tier.PEER == "peer" and Status.VALID == "valid" and Level.ORGAN == "organ"
    assert {Tier.REMOTE: 1}["remote"] == 1


def test_tiers_sort_fastest_first_and_a_name_compares_as_its_tier() -> None:
    assert sorted([Tier.REMOTE, Tier.MEMORY, Tier.PEER]) == [Tier.MEMORY, Tier.PEER, Tier.REMOTE]
    assert [t.speed for t in Tier] == [0, 1, 2]
    assert Tier.MEMORY < Tier.PEER < Tier.REMOTE
    assert Tier.REMOTE >= Tier.REMOTE > Tier.PEER >= Tier.MEMORY <= Tier.MEMORY
    assert Tier.PEER < "remote" and Tier.PEER > "memory"
    with pytest.raises(ValueError, match="'tape' is not a valid Tier"):
        _ = Tier.PEER < "tape"
    with pytest.raises(TypeError, match="compares with a Tier or a tier name, not 3"):
        _ = Tier.PEER < 3


def test_level_rank_orders_the_levels() -> None:
    assert [level.rank for level in Level] == [0, 1, 2]


def test_the_checkpoint_key_is_the_natural_row_key() -> None:
    key = CheckpointKey("run", 7, 1, Tier.PEER)
    assert key == ("run", 7, 1, "peer")
    assert (key.run_id, key.step, key.rank, key.tier) == ("run", 7, 1, Tier.PEER)


def test_the_vocabulary_imports_nothing_from_the_package() -> None:
    """The ground floor: every other module may import it, so it imports none of them."""
    tree = ast.parse(Path(vocab.__file__).read_text())
    imported = [node.module if isinstance(node, ast.ImportFrom) else alias.name
                for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
                for alias in node.names]
    assert imported and not [m for m in imported if m and m.startswith("ckptpilot")]


def test_the_old_import_paths_name_the_same_objects() -> None:
    import ckptpilot
    from ckptpilot.scheduler import Level as SchedulerLevel
    from ckptpilot.scheduler.decision import Level as DecisionLevel
    from ckptpilot.scheduler.decision import RetentionClass as DecisionRetentionClass
    from ckptpilot.storage.metadata import Status as StoreStatus
    from ckptpilot.storage.metadata import Tier as StoreTier

    assert SchedulerLevel is DecisionLevel is Level
    assert DecisionRetentionClass is RetentionClass
    assert StoreStatus is Status and StoreTier is Tier
    assert ckptpilot.RecoverySource is RecoverySource

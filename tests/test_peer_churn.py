"""The peer tier under churn (issue 27): 32 real ``ckptpilot peer serve`` daemons announced in
a real health registry, joining, draining (SIGTERM) and dying (SIGKILL) on a seeded schedule
while a real pilot saves and restarts; then two holders of its newest peer checkpoint are
SIGKILLed. The harness is ``bench/peer_churn.py`` (the benchmark runs it with 64 and 128 daemons and
times put and fetch as the cluster grows); here it asserts the invariants on what it observed.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import peer_churn as churn

DAEMONS = 32
pytestmark = [pytest.mark.slow, pytest.mark.crash]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[churn.Cluster]:
    c = churn.Cluster(tmp_path_factory.mktemp("churn"), DAEMONS, mem_limit_mib=32)
    try:
        c.grow(DAEMONS, reserve_bytes=2**30)
        yield c
    finally:
        c.close()


def test_a_put_over_32_daemons_fetches_bit_exact_with_its_group_on_distinct_nodes(
        cluster: churn.Cluster) -> None:
    timing = churn.time_put_fetch(cluster, DAEMONS, image_mb=1.0, repeats=1)
    assert timing.groups_ok


def test_restores_under_churn_are_bit_exact_or_walk_back_with_a_reason(
        cluster: churn.Cluster, tmp_path: Path) -> None:
    result = churn.run_churn(cluster, tmp_path, DAEMONS, events=8, seconds=20, seed=3,
                             cycle_steps=9, save_every=3)
    kinds = [e.split()[1] for e in result.events[:-1]]
    assert 1 <= len(kinds) <= 8 and set(kinds) <= {"kill", "drain", "join"}, result.events
    assert len(result.restores) >= 3
    assert [r for r in result.restores if not r.bit_exact] == []
    assert result.unexplained == []
    forced = result.restores[-1]
    assert forced.forced and forced.kind != "exact, peers", forced
    assert forced.reason not in ("", "?"), forced
    assert result.placements >= 3 and result.bad_placements == []
    reg = result.registry
    assert reg.reads > 100 and reg.synthetic_writes > 50, reg
    assert (reg.torn, reg.regressions, reg.changed_same_version, reg.wrong_endpoint) == (
        0, 0, 0, 0), reg
    assert result.marked_down_alive == []


def test_the_torn_read_check_fires_on_writers_that_skip_the_protocol(
        cluster: churn.Cluster) -> None:
    watch = churn.RegistryWatch(cluster.address, cluster.capacity, {}, guarded=False)
    deadline = churn.time.monotonic() + 30
    while watch.check.torn == 0 and churn.time.monotonic() < deadline:
        churn.time.sleep(0.1)
    assert watch.stop().torn > 0


def test_one_flipped_bit_in_any_tensor_is_a_difference() -> None:
    model, opt = churn.make_model(seed=0)
    churn.train_step(model, opt, 1)
    saved = churn.state_of(model, opt)
    assert churn.differing(saved, churn.state_of(model, opt)) == []
    flipped = dict(saved)
    key = next(k for k in saved if "exp_avg_sq" in k)
    bits = flipped[key].clone().view(torch.int32)
    bits.view(-1)[7] ^= 1
    flipped[key] = bits.view(torch.float32)
    assert churn.differing(saved, flipped) == [key]

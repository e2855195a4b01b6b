"""One suite every tier passes (``ckptpilot.tiers.base.CheckpointTier``): memory, peer (real
daemons), remote on ``file://`` and ``memory://`` — each built as the pilot's assembly builds
it — and ``DictTier`` below, a tier that subscribes by being listed in ``EXTRA_TIERS``. The
two-phase put (stage → validate → publish | abort) and the verified ``open`` are the paths the
pilot's writer and restorer take; ``put``/``get`` are their conveniences."""

from __future__ import annotations

import contextlib
import hashlib
import json
from typing import Any

import pytest
import torch
from conftest import Backend
from peerdaemons import KEY, Daemon, revive

from ckptpilot.assembly import memory_tier, peer_tier
from ckptpilot.capture.state import HostBufferPool
from ckptpilot.errors import IntegrityError, NoCheckpointError, StateError
from ckptpilot.tiers.base import (
    PLAIN,
    Check,
    CheckpointImage,
    CheckpointTier,
    OpenedImage,
    PutReceipt,
    Staged,
    StageOptions,
    TierCapabilities,
    put_in_two_phases,
)
from ckptpilot.tiers.peer import PeerTier, PeerUnavailable
from ckptpilot.vocab import Level, RetentionClass, Tier


class DictTier:
    """A fourth tier, in a dict: the suite holds it to the same contract."""

    kind = Tier.MEMORY
    capabilities = TierCapabilities(durable=False, survives_node_loss=False,
                                    folds_deltas=False, speed=0, keeps_older=True)
    where = "a dict"
    failures: tuple[type[BaseException], ...] = (IntegrityError, NoCheckpointError)

    def __init__(self) -> None:
        self._held: dict[int, tuple[CheckpointImage, str]] = {}

    def stage(self, image: CheckpointImage, base: CheckpointImage | None = None, *,
              options: StageOptions = PLAIN) -> Staged:
        image.tensors()
        copy = CheckpointImage(image.step, json.loads(json.dumps(image.meta)),
                               image.arena.clone(), image.layout, image.level, image.reason,
                               image.retention_class, image.score)
        digest = hashlib.sha256(copy.arena.numpy()).hexdigest()
        return Staged(image.step, self.kind, f"dict:{image.step}", digest, image.nbytes,
                      image.nbytes, "raw", 0.0, copy)

    def validate(self, staged: Staged) -> Check:
        return Check(True)

    def publish(self, staged: Staged) -> PutReceipt:
        self._held[staged.step] = (staged.image, staged.digest)
        return PutReceipt(staged.step, staged.location, staged.bytes_raw, digest=staged.digest)

    def abort(self, staged: Staged, why: str) -> str | None:
        return None

    def put(self, image: CheckpointImage, base: CheckpointImage | None = None) -> PutReceipt:
        return put_in_two_phases(self, image, base)

    def open(self, step: int, *, expect: str | None = None,
             at: str | None = None) -> OpenedImage:
        if step not in self._held:
            raise NoCheckpointError(f"dict: step {step} not held")
        image, digest = self._held[step]
        actual = hashlib.sha256(image.arena.numpy()).hexdigest()
        if actual != digest or (expect is not None and actual != expect):
            raise IntegrityError(f"dict: step {step}", expect or digest, actual)
        return OpenedImage.of(CheckpointImage(
            step, image.meta, image.arena.clone(), image.layout, image.level, image.reason,
            image.retention_class, image.score, source=f"dict:{step}",
            bytes_read=image.nbytes))

    def get(self, step: int) -> CheckpointImage:
        opened = self.open(step)
        image = self._held[step][0]
        return CheckpointImage.copied(step, opened.meta,
                                      {k: opened.tensor(k) for k, _, _ in image.layout},
                                      level=image.level, reason=image.reason,
                                      retention_class=image.retention_class, score=image.score)

    def steps(self) -> list[int]:
        return sorted(self._held)

    def locate(self, step: int) -> str:
        return f"dict:{step}"

    def set_aside(self, step: int, why: str) -> str | None:
        return None

    def discard(self, step: int) -> None:
        self._held.pop(step, None)

    def close(self) -> None:
        self._held.clear()

    def corrupt(self, step: int) -> None:
        self._held[step][0].arena[0] ^= 0xFF


EXTRA_TIERS = [DictTier]

_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.int64,
           torch.int32, torch.uint8, torch.bool)


def image(step: int, seed: int | None = None, **labels: Any) -> CheckpointImage:
    """A state of every stored dtype (NaN and an empty tensor included), laid out as
    ``state.capture`` lays an arena (widest element first), with the meta it writes."""
    g = torch.Generator().manual_seed(step if seed is None else seed)
    tensors = {}
    for i, dtype in enumerate(_DTYPES):
        raw = torch.randint(0, 256, (3 + i, 5), dtype=torch.uint8, generator=g)
        width = dtype.itemsize
        tensors[f"model/t{i}"] = raw.reshape(-1)[: (raw.numel() // width) * width].view(dtype)
    tensors["model/t0"][0] = float("nan")
    tensors["optimizer/state/0/empty"] = torch.empty((0, 4), dtype=torch.float32)
    tensors["model/t7"] = tensors["model/t6"].reshape(-1)[:11] % 2 == 1  # bool: 0 or 1 bytes
    ordered = sorted(tensors.items(), key=lambda kv: -kv[1].element_size())
    arena = torch.cat([t.reshape(-1).view(torch.uint8) for _, t in ordered])
    layout = tuple((k, t.dtype, tuple(t.shape)) for k, t in ordered)
    meta = {"format_version": 1, "step": step, "rank": 0, "world_size": 1, "epoch": 2,
            "extras": {"lr": 0.001, "tag": "é", "nested": [1, None, {"a": True}]},
            "model_keys": [k.removeprefix("model/") for k in tensors if k.startswith("model/")],
            "rng": {}}  # what the remote tier's load test requires of a captured state
    return CheckpointImage(step, meta, arena, layout, **labels)


def expected(img: CheckpointImage) -> dict[str, Any]:
    """An independent copy of what ``img`` holds (a tier may keep the arena itself)."""
    return {"meta": json.loads(json.dumps(img.meta)), "level": img.level,
            "tensors": {k: t.reshape(-1).view(torch.uint8).clone().view(t.dtype).reshape(t.shape)
                        for k, t in img.tensors().items()}}


def assert_bit_exact(got: CheckpointImage, want: dict[str, Any], step: int) -> None:
    assert got.step == step
    assert dict(got.meta) == want["meta"]
    assert got.level == want["level"]
    tensors = got.tensors()
    assert list(tensors) == list(want["tensors"])
    for key, t in want["tensors"].items():
        assert tensors[key].dtype == t.dtype and tensors[key].shape == t.shape, key
        assert torch.equal(tensors[key].reshape(-1).view(torch.uint8),
                           t.reshape(-1).view(torch.uint8)), key


def test_a_round_trip_is_bit_exact(backend: Backend) -> None:
    tier = backend.tier()
    img = image(3, level=Level.PULSE, reason="spike", retention_class=RetentionClass.CRITICAL,
                score=0.5)
    want = expected(img)
    receipt = tier.put(img)
    assert (receipt.step, receipt.kept, receipt.delta) == (3, True, False)
    assert receipt.bytes_stored >= img.nbytes > 0
    assert_bit_exact(tier.get(3), want, 3)


def test_a_put_against_a_base_round_trips_and_says_whether_it_sent_a_delta(
        backend: Backend) -> None:
    tier = backend.tier()
    first = image(1)
    tier.put(first)
    second = image(2, seed=1)
    second.arena[:8] ^= 0x01  # a few bytes moved since the base
    want = expected(second)
    receipt = tier.put(second, base=first)
    assert receipt.delta is backend.capabilities.folds_deltas
    assert_bit_exact(tier.get(2), want, 2)


def test_a_step_put_twice_returns_the_second(backend: Backend) -> None:
    tier = backend.tier()
    tier.put(image(4, seed=40))
    second = image(4, seed=41)
    want = expected(second)
    tier.put(second)
    assert tier.steps() == [4]
    assert_bit_exact(tier.get(4), want, 4)


def test_steps_are_listed_ascending_and_older_ones_kept_as_declared(backend: Backend) -> None:
    tier = backend.tier()
    assert tier.steps() == []
    for step in (1, 5, 12):
        tier.put(image(step))
    assert tier.steps() == ([1, 5, 12] if backend.capabilities.keeps_older else [12])


def test_a_discarded_step_is_gone_and_discarding_again_does_nothing(backend: Backend) -> None:
    tier = backend.tier()
    tier.put(image(7))
    tier.discard(7)
    tier.discard(7)
    tier.discard(99)
    assert tier.steps() == []
    with pytest.raises(NoCheckpointError, match=r"\b7\b"):
        tier.get(7)


def test_a_step_never_put_is_a_clear_no_checkpoint_error(backend: Backend) -> None:
    tier = backend.tier()
    tier.put(image(2))
    with pytest.raises(NoCheckpointError, match=r"step 9\b"):
        tier.get(9)


def test_a_flipped_byte_is_an_integrity_error_naming_the_step(backend: Backend) -> None:
    tier = backend.tier()
    tier.put(image(6))
    backend.corrupt(tier, 6)
    with pytest.raises(IntegrityError, match=r"step 6\b"):
        tier.get(6)


def test_an_arena_shorter_than_its_layout_is_refused_and_changes_nothing(
        backend: Backend) -> None:
    tier = backend.tier()
    good = image(1)
    want = expected(good)
    tier.put(good)
    short = image(2)
    short = CheckpointImage(2, short.meta, short.arena[:-3], short.layout)
    with pytest.raises(StateError, match="arena ends at byte"):
        tier.put(short)
    assert tier.steps() == [1]
    assert_bit_exact(tier.get(1), want, 1)


def test_a_put_that_fails_half_way_publishes_nothing(backend: Backend) -> None:
    tier = backend.tier()
    good = image(1)
    want = expected(good)
    tier.put(good)
    broken = backend.broken_tier()
    if broken is None:
        pytest.skip("this tier's put does no I/O that could fail half-way")
    with pytest.raises((OSError, RuntimeError), match="injected"):
        broken.put(image(2))
    assert tier.steps() == [1] == broken.steps()
    with pytest.raises(NoCheckpointError, match=r"step 2\b"):
        tier.get(2)
    assert_bit_exact(tier.get(1), want, 1)


def assert_opened_bit_exact(got: OpenedImage, want: dict[str, Any], step: int) -> None:
    assert got.step == step
    assert dict(got.meta) == want["meta"]
    assert got.level == want["level"]
    assert got.source and got.bytes_read > 0
    for key, t in want["tensors"].items():
        read = got.tensor(key)
        assert read.dtype == t.dtype and read.shape == t.shape, key
        assert torch.equal(read.reshape(-1).view(torch.uint8),
                           t.reshape(-1).view(torch.uint8)), key


def test_a_two_phase_put_is_visible_only_once_published_and_opens_against_its_digest(
        backend: Backend) -> None:
    tier = backend.tier()
    tier.put(image(1))
    img = image(2, level=Level.PULSE, reason="interval")
    want = expected(img)
    staged = tier.stage(img, options=StageOptions(codecs=True, fsync=False))
    assert (staged.step, staged.kind, staged.bytes_raw) == (2, tier.kind, img.nbytes)
    assert staged.location and staged.digest
    assert 2 not in tier.steps(), "a staged image is not a checkpoint yet"
    check = tier.validate(staged)
    assert check.ok, check.reason
    receipt = tier.publish(staged)
    assert receipt.step == 2 and receipt.kept and receipt.digest
    assert 2 in tier.steps()
    assert tier.locate(2)
    assert_opened_bit_exact(tier.open(2, expect=receipt.digest), want, 2)
    assert_bit_exact(tier.get(2), want, 2)


def test_an_aborted_stage_leaves_the_previous_image_alone(backend: Backend) -> None:
    tier = backend.tier()
    first = image(1)
    want = expected(first)
    receipt = tier.put(first)
    staged = tier.stage(image(2, seed=9))
    tier.abort(staged, "failed validation (test)")
    assert tier.steps() == [1]
    with pytest.raises(NoCheckpointError, match=r"step 2\b"):
        tier.open(2)
    assert_opened_bit_exact(tier.open(1, expect=receipt.digest), want, 1)


def test_open_refuses_a_copy_that_is_not_the_one_the_caller_recorded(backend: Backend) -> None:
    tier = backend.tier()
    receipt = tier.put(image(3))
    tier.put(image(3, seed=30))  # another image in its place
    with pytest.raises(IntegrityError):
        tier.open(3, expect=receipt.digest)


def test_open_of_a_step_never_put_or_flipped_names_the_step(backend: Backend) -> None:
    tier = backend.tier()
    tier.put(image(6))
    with pytest.raises(NoCheckpointError, match=r"step 9\b"):
        tier.open(9)
    backend.corrupt(tier, 6)
    with pytest.raises(IntegrityError, match=r"step 6\b|step_00000006"):
        tier.open(6).tensor("model/t0")


def test_capabilities_are_declared(backend: Backend) -> None:
    tier = backend.tier()
    assert isinstance(tier, CheckpointTier)
    assert tier.capabilities == backend.capabilities
    assert tier.capabilities.speed == tier.kind.speed


def test_close_is_idempotent(backend: Backend) -> None:
    tier = backend.tier()
    tier.put(image(1))
    tier.close()
    tier.close()


def test_the_memory_tier_declines_an_image_over_budget_or_older_than_its_newest() -> None:
    tier = memory_tier(image(1).nbytes, HostBufferPool(2))
    assert tier.put(image(5)).kept
    older = tier.put(image(4))
    assert (older.kept, older.bytes_stored, tier.steps()) == (False, 0, [5])
    big = image(6)
    big = CheckpointImage(6, big.meta, torch.cat([big.arena, big.arena[:1]]),
                          (*big.layout, ("model/extra", torch.uint8, (1,))))
    assert not tier.put(big).kept
    assert tier.steps() == []  # never offer step 5 as the newest once 6 was saved


def test_the_peers_discard_a_step_only_with_no_newer_one_held(
        peer_daemons: list[Daemon]) -> None:
    endpoints = [d.endpoint for d in revive(peer_daemons)]
    peers = PeerTier(endpoints, run_id="discard-order", secret=KEY, data_shards=2,
                     probe_interval=0.2, timeout_seconds=5.0, lease_seconds=60.0)
    with contextlib.closing(peer_tier(peers, rank=0)) as tier:
        tier.put(image(2))
        tier.put(image(1))  # out of order: the peers now hold both
        assert tier.steps() == [1, 2]
        with pytest.raises(PeerUnavailable, match=r"cannot drop checkpoint 1 .* drop 2"):
            tier.discard(1)
        assert tier.steps() == [1, 2]
        tier.discard(2)
        assert tier.steps() == []

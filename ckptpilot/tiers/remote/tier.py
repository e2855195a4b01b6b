"""The remote tier as a :class:`~ckptpilot.tiers.base.CheckpointTier`: one rank's images as
organ archives on a :class:`~ckptpilot.tiers.remote.store.RemoteTier`.

An image is an organ archive (``tiers.remote.archive``: safetensors + state + manifest; or,
when the pilot asks for codecs and they pay at the tier's bandwidth, a codec container),
staged in a staging directory, validated there (the post-write validator the tier was built
with: sizes, hashes or a load test in another process, ``validation`` policy) and published
under ``step_{step}_rank_{rank}`` in one rename (on an object store: the manifest written
last). This module sits above both ``tiers.remote.store`` (the bytes) and
``tiers.remote.archive`` (the archive layout), so neither imports the other's caller; the
pilot builds it in ``assembly`` and the conformance suite through the same factory.

Threading: one writer thread and any number of readers; methods hold no shared state (the
codec selector is the writer's alone).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from ckptpilot.errors import CheckpointFormatError, IntegrityError, NoCheckpointError
from ckptpilot.tiers.base import (
    PLAIN,
    Check,
    CheckpointImage,
    OpenedImage,
    PutReceipt,
    Staged,
    StageOptions,
    Survey,
    TierCapabilities,
    put_in_two_phases,
)
from ckptpilot.tiers.remote.archive import (
    StagedArchive,
    check_sizes,
    checkpoint_name,
    list_archives,
    model_layout,
    parse_checkpoint_name,
    publish_organ,
    read_manifest,
    read_organ,
    stage_organ,
)
from ckptpilot.tiers.remote.store import RemoteTier
from ckptpilot.vocab import Level, RetentionClass, Tier

if TYPE_CHECKING:
    from ckptpilot.codecs.selector import CodecSelector
    from ckptpilot.validation.postwrite import PostWriteValidator

__all__ = ["RemoteCheckpointTier"]


def _load_malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc: nothing to trim
        return None


_MALLOC_TRIM = _load_malloc_trim()


def _trim_heap() -> None:
    """Give the heap that encoding freed back to the system: glibc keeps the freed memory of
    its worker-thread arenas, so without a trim every pulse leaves the process larger by a
    good part of the state. Runs on the writer thread, never on the training thread."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def _codec_summary(staged: StagedArchive) -> str:
    """``raw`` for safetensors; else how many tensors each codec took, e.g.
    ``byteplane:12,raw:30``."""
    if staged.index is None:
        return "raw"
    counts = Counter(entry.codec for entry in staged.index.tensors)
    return ",".join(f"{codec}:{n}" for codec, n in sorted(counts.items()))


class RemoteCheckpointTier:
    """The images of one rank on a :class:`RemoteTier` (see the module docstring).

    ``validator`` checks a staged archive before its publication (None: sizes only);
    ``codecs`` encodes an image staged with ``StageOptions(codecs=True)`` (None: plain).
    The tier does not own ``remote``, ``validator`` or ``codecs``: ``close`` leaves them."""

    kind = Tier.REMOTE
    capabilities = TierCapabilities(durable=True, survives_node_loss=True, folds_deltas=False,
                                    speed=Tier.REMOTE.speed, keeps_older=True)
    failures: tuple[type[BaseException], ...] = (CheckpointFormatError, NoCheckpointError,
                                                 OSError)

    def __init__(self, remote: RemoteTier, *, rank: int,
                 validator: PostWriteValidator | None = None,
                 codecs: CodecSelector | None = None) -> None:
        self.remote = remote
        self.rank = rank
        self.validator = validator
        self.codecs = codecs
        self.url = remote.url
        self.where = f"the remote tier {remote.url}"

    def stage(self, image: CheckpointImage, base: CheckpointImage | None = None, *,
              options: StageOptions = PLAIN) -> Staged:
        """Write the archive into a fresh staging directory (``base`` is ignored): through the
        codecs when ``options.codecs`` asks for them and they would save more transfer time
        at this tier's bandwidth than the container's extra hash pass costs, else as
        safetensors. A failure leaves staging debris that no listing takes for a checkpoint.
        The pending row records the staging directory and the manifest's ``self_sha256``."""
        t0 = time.perf_counter()
        snapshot = image.snapshot()
        codec_for = None
        if options.codecs and self.codecs is not None:
            self.codecs.new_save()
            if not self.codecs.plain_pays(snapshot.tensors):
                codec_for = self.codecs.codec_for
        staged = stage_organ(self.remote, snapshot, level=image.level.value,
                             reason=image.reason, retention_class=image.retention_class.value,
                             score=image.score, codec_for=codec_for, fsync=options.fsync)
        seconds = time.perf_counter() - t0
        if codec_for is not None:
            _trim_heap()
        return Staged(image.step, self.kind, self.remote.path(staged.staging),
                      staged.manifest["self_sha256"], image.nbytes, staged.bytes,
                      _codec_summary(staged), seconds, image, handle=staged)

    def validate(self, staged: Staged) -> Check:
        """The staged archive, checked where it lies by the tier's validator."""
        archive: StagedArchive = staged.handle
        if self.validator is None:
            t0 = time.perf_counter()
            try:
                check_sizes(self.remote, archive.staging, archive.manifest)
            except CheckpointFormatError as e:
                return Check(False, str(e), time.perf_counter() - t0)
            return Check(True, "ok (sizes only)", time.perf_counter() - t0)
        result = self.validator.validate(self.remote, archive.staging, archive.manifest,
                                         model_layout(staged.image.snapshot()))
        return Check(result.ok, result.reason, result.seconds)

    def publish(self, staged: Staged) -> PutReceipt:
        """One rename of the staging directory (or the manifest written last on an object
        store); an archive of the same step already there is set aside (``*.replaced-*``)."""
        archive: StagedArchive = staged.handle
        publish_organ(self.remote, archive)
        return PutReceipt(staged.step, self.remote.path(archive.name), archive.bytes,
                          digest=staged.digest, codec=staged.codec,
                          write_seconds=staged.write_seconds or 0.0)

    def abort(self, staged: Staged, why: str) -> str | None:
        """Set the staged archive aside as ``*.corrupted-*``, for inspection."""
        archive: StagedArchive = staged.handle
        return self.remote.path(self.remote.set_aside(archive.staging, "corrupted",
                                                      label=archive.name))

    def put(self, image: CheckpointImage, base: CheckpointImage | None = None) -> PutReceipt:
        """:meth:`stage` → :meth:`validate` → :meth:`publish` (or :meth:`abort` and raise)."""
        return put_in_two_phases(self, image, base)

    def open(self, step: int, *, expect: str | None = None,
             at: str | None = None) -> OpenedImage:
        """The archive, every file checked against its manifest as it is read (a container:
        as it is decoded), and the manifest against ``expect``, the ``self_sha256`` its row
        recorded: another archive in its place (an older copy, another run's) is refused."""
        name = checkpoint_name(step, self.rank)
        try:
            loaded = read_organ(self.remote, name, manifest_sha256=expect)
        except CheckpointFormatError:
            if not self.remote.exists(name):
                raise self._not_held(step, name) from None
            raise
        read = sum(int(f["bytes"]) for f in loaded.manifest["files"].values())
        return OpenedImage(step, loaded.meta, Level(loaded.manifest["level"]), loaded.location,
                           read, loaded.tensor)

    def _not_held(self, step: int, name: str) -> NoCheckpointError:
        return NoCheckpointError(
            f"{self.remote.path(name)}: step {step} of rank {self.rank} is not on the "
            f"remote tier; `ckptpilot ls` lists the steps it holds")

    def get(self, step: int) -> CheckpointImage:
        """The archive, every file checked against its manifest, copied into one arena."""
        name = checkpoint_name(step, self.rank)
        if not self.remote.exists(name) or not self.remote.committed(name):
            raise self._not_held(step, name)
        try:
            loaded = read_organ(self.remote, name)
        except IntegrityError as e:
            raise IntegrityError(f"step {step}: {e.key}", e.expected, e.actual) from e
        manifest = loaded.manifest
        image = CheckpointImage.copied(
            step, loaded.meta, loaded.tensors, level=Level(manifest["level"]),
            reason=manifest["reason"], retention_class=RetentionClass(manifest["retention_class"]),
            score=manifest["score"])
        read = sum(int(f["bytes"]) for f in manifest["files"].values())
        return replace(image, source=loaded.location, bytes_read=read)

    def steps(self) -> list[int]:
        return sorted(step for step, _ in list_archives(self.remote, self.rank).published)

    def locate(self, step: int) -> str:
        return self.remote.path(checkpoint_name(step, self.rank))

    def survey(self) -> Survey:
        """This rank's published archives and the staging debris of saves that never
        finished; ``OSError`` when the tier cannot be listed."""
        listing = list_archives(self.remote, self.rank)
        return Survey({step: self.remote.path(name) for step, name in listing.published},
                      [self.remote.path(name) for name in listing.staging])

    def clear(self, location: str) -> None:
        """Remove an unfinished save (a location from :meth:`survey`)."""
        self.remote.remove(location.removeprefix(self.remote.path("")))

    def labels(self, step: int) -> Mapping[str, Any]:
        """The archive's manifest, checked, not its data: what a step without a row is."""
        return read_manifest(self.remote, checkpoint_name(step, self.rank))

    def owns(self, location: str) -> bool:
        """Whether a row's ``location`` (a published, staging or set-aside archive) is one
        of this pilot's archives: a ``ckptpilot.dcp`` checkpoint in the same run directory
        has rows of its own layout, which this tier does not read."""
        entry = location.rstrip("/").rsplit("/", 1)[-1].split(".", 1)[0]
        return parse_checkpoint_name(entry) is not None

    def set_aside(self, step: int, why: str) -> str | None:
        name = checkpoint_name(step, self.rank)
        if not self.remote.exists(name):
            return None
        return self.remote.path(self.remote.set_aside(name, why))

    def discard(self, step: int) -> None:
        name = checkpoint_name(step, self.rank)
        if self.remote.exists(name):
            self.remote.remove(name, step=step, rank=self.rank)

    def close(self) -> None:
        """Nothing to release: every call opens and closes its own files."""

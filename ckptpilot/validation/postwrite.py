"""Post-write validation: may this staged checkpoint become ``valid``? (SPEC §7)

Runs the checks the policy's ``validation`` section enables on a checkpoint that is written
but not yet published: the load test in a separate process (file sizes, headers, the required
fields and the consistency of names/shapes/dtypes with the live model; in the paranoid mode
also a re-hash of every file against the digests computed while writing and a decode of every
tensor), or — with ``load_test: none`` — sizes only (paranoid: a re-hash). Owns the load-test
worker's lifetime: it is started with the validator, so it is ready by the first save.

Threading: used from one thread at a time (the pilot's writer thread, or the CLI).
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ckptpilot.errors import CheckpointFormatError
from ckptpilot.policy import ValidationPolicy
from ckptpilot.tiers.remote.archive import check_sizes, verify_organ
from ckptpilot.tiers.remote.store import RemoteTier
from ckptpilot.validation.loadcheck import LoadChecker, LoadCheckResult


class PostWriteValidator:
    def __init__(self, policy: ValidationPolicy, *, timeout_seconds: float = 300.0) -> None:
        self.policy = policy
        self._checker = (LoadChecker(timeout_seconds=timeout_seconds)
                         if policy.load_test == "subprocess" else None)
        if self._checker is not None:
            self._checker.start()

    def validate(self, tier: RemoteTier, name: str, manifest: Mapping[str, Any],
                 expected_layout: Mapping[str, tuple[str, list[int]]]) -> LoadCheckResult:
        """Check the checkpoint directory ``name`` on ``tier`` (staged or published)."""
        t0 = time.perf_counter()
        layout = expected_layout if self.policy.consistency else {}
        if self._checker is not None:
            local = tier.local_path(name)
            options = {"sha256": self.policy.sha256, "reread": self.policy.paranoid}
            if local is not None:
                return self._checker.check(local, manifest, layout, **options)
            with tempfile.TemporaryDirectory(prefix="ckptpilot-validate-") as tmp:
                for fname in manifest["files"]:
                    tier.download(f"{name}/{fname}", str(Path(tmp) / fname))
                return self._checker.check(tmp, manifest, layout, **options)
        rehash = self.policy.sha256 and self.policy.paranoid
        try:
            if rehash:
                verify_organ(tier, name, manifest)
            else:
                check_sizes(tier, name, manifest)
        except CheckpointFormatError as e:
            return LoadCheckResult(False, str(e), time.perf_counter() - t0)
        return LoadCheckResult(True, "ok (hashes only)" if rehash else "ok (sizes only)",
                               time.perf_counter() - t0)

    def close(self) -> None:
        if self._checker is not None:
            self._checker.close()

"""Post-write validation: may this staged checkpoint become ``valid``? (SPEC §7)

Runs the checks the policy's ``validation`` section enables on a checkpoint that is written
but not yet published: the load test in a separate process (which re-hashes every file
against the digests computed while writing, decodes every tensor, checks the required fields
and the consistency of names/shapes/dtypes with the live model), or — with
``load_test: none`` — a re-hash only. Owns the load-test worker's lifetime.

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
from ckptpilot.storage.archive import verify_organ
from ckptpilot.tiers.remote import RemoteTier
from ckptpilot.validation.loadcheck import LoadChecker, LoadCheckResult


class PostWriteValidator:
    def __init__(self, policy: ValidationPolicy, *, timeout_seconds: float = 300.0) -> None:
        self.policy = policy
        self._checker = (LoadChecker(timeout_seconds=timeout_seconds)
                         if policy.load_test == "subprocess" else None)

    def validate(self, tier: RemoteTier, name: str, manifest: Mapping[str, Any],
                 expected_layout: Mapping[str, tuple[str, list[int]]]) -> LoadCheckResult:
        """Check the checkpoint directory ``name`` on ``tier`` (staged or published)."""
        t0 = time.perf_counter()
        layout = expected_layout if self.policy.consistency else {}
        if self._checker is not None:
            local = tier.local_path(name)
            if local is not None:
                return self._checker.check(local, manifest, layout, sha256=self.policy.sha256)
            with tempfile.TemporaryDirectory(prefix="ckptpilot-validate-") as tmp:
                for fname in manifest["files"]:
                    tier.download(f"{name}/{fname}", str(Path(tmp) / fname))
                return self._checker.check(tmp, manifest, layout, sha256=self.policy.sha256)
        if self.policy.sha256:
            try:
                verify_organ(tier, name, manifest)
            except CheckpointFormatError as e:
                return LoadCheckResult(False, str(e), time.perf_counter() - t0)
        return LoadCheckResult(True, "ok (hashes only)" if self.policy.sha256 else "not checked",
                               time.perf_counter() - t0)

    def close(self) -> None:
        if self._checker is not None:
            self._checker.close()

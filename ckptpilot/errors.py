"""The error hierarchy of ckptpilot.

Every error names what is at fault (a policy key path, a file, a tensor, a step) and, where
there is one, suggests the fix. They derive from built-in bases so callers that already catch
``ValueError`` / ``RuntimeError`` keep working.
"""

from __future__ import annotations


class CkptPilotError(Exception):
    """Base of every error raised on purpose by ckptpilot."""


class PolicyError(CkptPilotError, ValueError):
    """The policy (YAML or model) is invalid; ``key`` is the dotted path at fault."""

    def __init__(self, key: str, message: str) -> None:
        self.key = key
        super().__init__(f"{key}: {message}" if key else message)


class StateError(CkptPilotError, ValueError):
    """The training state cannot be captured or restored (unsupported value, layout mismatch)."""


class CheckpointFormatError(CkptPilotError, ValueError):
    """A checkpoint on storage is malformed, truncated or of an unknown format version."""


class IntegrityError(CheckpointFormatError):
    """Bytes read back do not match the digest recorded when they were written."""

    def __init__(self, key: str, expected: str, actual: str, digest: str = "SHA256") -> None:
        self.key = key
        self.expected = expected
        self.actual = actual
        self.digest = digest
        super().__init__(f"{key}: {digest} mismatch (expected {expected}, got {actual})")

    def __reduce__(self) -> tuple[type[IntegrityError], tuple[str, str, str, str]]:
        # Rebuilt from its fields when pickled to another process (DCP sends every rank's
        # exception to the others).
        return (type(self), (self.key, self.expected, self.actual, self.digest))


class CheckpointWriteError(CkptPilotError, RuntimeError):
    """A background save failed; raised on the training thread at the next observe/close."""


class NoCheckpointError(CkptPilotError, LookupError):
    """A specific checkpoint was asked for and no valid one exists."""


class RollbackLimitError(CkptPilotError, RuntimeError):
    """Loss spikes came back after ``rollback.max_rollbacks`` rollbacks within
    ``rollback.window_steps`` steps: rolling back again would loop, so the run stops."""


class RunDirBusyError(CkptPilotError, RuntimeError):
    """Another live pilot holds this rank's lease on the run directory."""


class RunIdError(CkptPilotError, RuntimeError):
    """The run directory's ``run_id`` file is damaged and nothing left in the directory says
    what it was; the message names the file and how to put it right."""


class LineageError(CkptPilotError, RuntimeError):
    """A rank's lineage record (``lineage_rank_NNNNN.jsonl``: where each restore cut the run's
    history) is damaged, or a checkpoint names a continuation the record does not know, so
    which saved steps a restore abandoned cannot be told."""


class RemovalRefusedError(CkptPilotError, PermissionError):
    """A deletion was refused before anything was touched: its target is not a checkpoint of
    the tier (``tiers.remote.entries`` has the rule). An ``OSError``, so that a caller that goes on
    past a failed removal (a prune, the debris of a killed writer) goes on past this one."""


class RemoteIOError(CkptPilotError, OSError):
    """The remote tier could not be reached for one operation after its retries
    (``tiers.remote.retries``); names the URL and the last cause. An ``OSError``: a restore
    skips that copy (an I/O error never marks a checkpoint corrupted) and a save fails."""

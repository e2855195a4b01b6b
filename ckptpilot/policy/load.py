"""Reading a policy: the installed reference file and :func:`load_policy`."""

from __future__ import annotations

import importlib.resources
import os
from pathlib import Path

from ckptpilot.policy.reader import read_policy_yaml
from ckptpilot.policy.schema import Policy, resolve_policy, validate_policy


def default_policy_path() -> Path:
    """The reference policy file installed with the package (``configs/default.yaml`` of the
    source tree): every key at its default, each one commented — the file to copy and edit.
    ``load_policy()`` with no path gives the same values."""
    return Path(str(importlib.resources.files("ckptpilot") / "configs" / "default.yaml"))


def load_policy(
    path: str | os.PathLike[str] | None = None,
    *,
    run_dir: str | os.PathLike[str] | None = None,
) -> Policy:
    """Read, validate and resolve a policy file.

    ``path=None`` gives the defaults and an empty file does too. ``run_dir`` overrides the
    file's ``run_dir``; then every ``{run_dir}`` in a string value (at any depth, list items
    included) is replaced by it. Literal braces are written ``{{`` and ``}}``. Relative paths
    stay relative to the working directory, not to the policy file.
    Every problem raises :class:`PolicyError` naming the key (and the file).
    """
    source = None if path is None else os.fspath(path)
    data = {} if source is None else read_policy_yaml(source)
    if run_dir is not None:
        data["run_dir"] = os.fspath(run_dir)
    template = validate_policy(data, source).model_dump(mode="json", by_alias=True)
    return resolve_policy(template, source)

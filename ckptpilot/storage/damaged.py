"""Setting a damaged auxiliary run file aside, so that a restart goes on without it.

The heartbeat ring and the failure ledger only inform a restart (how many steps were lost, the
MTBF); every checkpoint is validated on its own. A damaged one must therefore neither stop a
run from resuming nor be overwritten unseen: its owner renames it to
``<name>.damaged-<unix time>`` beside the original, where it stays for inspection, and starts
a fresh file on the original path.

This module owns only that rename and the WARNING that names the file and what was wrong. It
does not decide what counts as damage; the format's owner (``heartbeat.py``, ``ledger.py``,
beside it in ``storage/``) does.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from ckptpilot.rundir import aside_path

__all__ = ["set_aside"]

log = logging.getLogger("ckptpilot")


def set_aside(path: Path, problem: str, consequence: str) -> Path:
    """Rename ``path`` (a file, or whatever took its place) to a free ``.damaged-`` name.

    ``problem`` says what is wrong with it and ``consequence`` what the run loses by going on
    without it; both go into the WARNING. Returns the new path. An ``OSError`` from the rename
    propagates: a file that can be neither read nor moved needs the user.
    """
    aside = aside_path(path, "damaged")
    os.rename(path, aside)
    log.warning(
        "%s is damaged (%s); kept it as %s and started a fresh one; %s",
        path,
        problem,
        aside.name,
        consequence,
    )
    return aside

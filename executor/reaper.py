"""Reaping: finding and ending what a dead worker or a crashed run left behind, on whichever provider it ran.

Three callers: a worker at start-up and the driver when a worker actor dies (owners dead or TTL passed,
any run), and ``rollout gc`` after a crash (``--run RUN --all``: everything of that run, alive owner or
not, for when the run is known to be over). Every provider's reaper is idempotent and bounded.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

from executor.config import SandboxConfig
from sandboxes import owner
from sandboxes.owner import forget_dead
from sandboxes.prepared import reap_prepared

log = logging.getLogger(__name__)

# A worker of a run on an object store writes each launch's evidence to this node's scratch first, under
# ``<TMPDIR>/rollout-evidence/<run_id>/scratch/<owner>/``, named after its owner record there, so that
# what a SIGKILLed worker left is known dead by that record's free lock and removed by the next reaper.
EVIDENCE_SCRATCH_DIR = "scratch"


def evidence_scratch_root() -> Path:
    return Path(tempfile.gettempdir()) / "rollout-evidence"


def new_evidence_scratch(run_id: str) -> Path:
    """A fresh scratch directory of this process's for run ``run_id``'s evidence on this node."""
    root = evidence_scratch_root()
    mine = root / run_id / EVIDENCE_SCRATCH_DIR / owner.hold(root)
    mine.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix="evidence-", dir=mine))


def reap_evidence_scratch() -> list[str]:
    """Remove the evidence scratch of dead workers on this node."""
    root = evidence_scratch_root()
    reaped = owner.reap_dead_dirs(root, EVIDENCE_SCRATCH_DIR)
    forget_dead(root)
    return reaped


def reap(sandbox: SandboxConfig, run_id: str | None = None, *, everything: bool = False) -> list[str]:
    """End the sandboxes ``sandbox`` describes that are stale (``everything``: all of ``run_id``)."""
    if everything and not run_id:
        raise ValueError("ending every sandbox needs a run id")
    root = sandbox.root_dir()
    reap_prepared(root)  # the laid-out workspaces of dead workers: disk, nothing running
    reap_evidence_scratch()  # and their evidence not yet put to the run's object store
    reaped = sandbox.reap(root, run_id, everything=everything)
    forget_dead(root)  # last: a missing record says its owner is dead, to whatever it owned
    return reaped


def reap_quietly(sandbox: SandboxConfig) -> list[str]:
    """``reap`` for callers in the middle of a run: a failing reaper is logged, never raised."""
    try:
        reaped = reap(sandbox)
    except Exception as exc:
        log.warning("reaping %s sandboxes failed: %s", sandbox.provider, str(exc)[:1000])
        return []
    if reaped:
        log.warning("reaped %d %s sandboxes of dead workers: %s", len(reaped), sandbox.provider, reaped[:20])
    return reaped

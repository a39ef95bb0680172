"""Reaping: finding and ending what a dead worker or a crashed run left behind, on whichever provider it ran.

Callers: a worker at start-up (owners dead or TTL passed, any run, on its node); the driver, on every
node of the cluster (``reap_everywhere``), when a worker actor died and again at the run's end after one
did; and ``rollout gc`` after a crash (``--run RUN --all``: everything of that run, alive owner or not, for
when the run is known to be over), on this machine or, with ``--address``, on every node. Besides the
sandboxes it removes what dead workers left on the node (laid-out workspaces, evidence scratch, gateway
sockets) and the run directories they leave empty. Every provider's reaper is idempotent and bounded.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import stat
import tempfile
import time
from pathlib import Path
from typing import Any

from executor.config import SandboxConfig
from sandboxes import owner
from sandboxes.owner import forget_dead
from sandboxes.prepared import PREPARED_DIR, reap_prepared

log = logging.getLogger(__name__)

# A worker of a run on an object store writes each launch's evidence to this node's scratch first, under
# ``<TMPDIR>/rollout-evidence/<run_id>/scratch/<owner>/``, named after its owner record there, so that
# what a SIGKILLed worker left is known dead by that record's free lock and removed by the next reaper.
EVIDENCE_SCRATCH_DIR = "scratch"
# The worker's gateway socket (executor/worker.py): ``<TMPDIR>/rollout-gw-<pid>-<hex>.sock``.
GATEWAY_SOCKET_PREFIX = "rollout-gw-"
# A run directory left empty, or a gateway socket nobody answers on, is removed once it is this old: one
# just made may be about to get its first entry, or its server's listen().
SETTLED_S = 60.0
# The reaping of every node of a cluster: how long the driver or `rollout gc` waits for the nodes' answers.
EVERYWHERE_S = 120.0


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
    remove_empty_runs(root, EVIDENCE_SCRATCH_DIR)
    return reaped


def remove_empty_runs(root: Path, *kinds: str, now: float | None = None) -> list[str]:
    """Remove ``<root>/<run>/<kind>`` and then ``<root>/<run>`` where each is empty and has been for
    ``SETTLED_S`` (its mtime): the directories a run's workers leave once their own parts are gone. A
    non-empty directory is never touched (rmdir refuses it). Returns those removed, relative to ``root``."""
    now = time.time() if now is None else now
    removed: list[str] = []

    def settled(path: Path) -> bool:
        try:
            return now - path.lstat().st_mtime >= SETTLED_S
        except OSError:
            return False

    def rmdir(path: Path) -> None:
        with contextlib.suppress(OSError):
            path.rmdir()
            removed.append(str(path.relative_to(root)))

    try:
        runs = [p for p in Path(root).iterdir() if p.name != owner.OWNERS_DIR and p.is_dir()]
    except OSError:
        return removed
    for run in runs:
        run_settled = settled(run)  # before its emptied parts go, which touches its mtime
        for kind in kinds:
            if settled(run / kind):
                rmdir(run / kind)
        if run_settled:
            rmdir(run)
    return removed


def reap_gateway_sockets(now: float | None = None) -> list[str]:
    """Remove the gateway sockets of this node's dead workers: nobody accepts on them (a connection is
    refused), and they are ``SETTLED_S`` old. Works across PID namespaces, which a pid would not."""
    now = time.time() if now is None else now
    removed = []
    for path in Path(tempfile.gettempdir()).glob(f"{GATEWAY_SOCKET_PREFIX}*.sock"):
        try:
            st = path.lstat()
            if not stat.S_ISSOCK(st.st_mode) or now - st.st_mtime < SETTLED_S or _answered(path):
                continue
            path.unlink()
            removed.append(str(path))
        except OSError:
            continue
    return removed


def _answered(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(str(path))
        except ConnectionRefusedError:
            return False
        except OSError:
            return True  # not a refusal (a full backlog, a timeout): someone may be there
    return True


def reap(sandbox: SandboxConfig, run_id: str | None = None, *, everything: bool = False) -> list[str]:
    """End the sandboxes ``sandbox`` describes that are stale (``everything``: all of ``run_id``)."""
    if everything and not run_id:
        raise ValueError("ending every sandbox needs a run id")
    root = sandbox.root_dir()
    reap_prepared(root)  # the laid-out workspaces of dead workers: disk, nothing running
    reap_evidence_scratch()  # and their evidence not yet put to the run's object store
    reap_gateway_sockets()
    reaped = sandbox.reap(root, run_id, everything=everything)
    forget_dead(root)  # last: a missing record says its owner is dead, to whatever it owned
    remove_empty_runs(root, PREPARED_DIR)
    return reaped


def reap_everywhere(
    sandbox: SandboxConfig,
    run_id: str | None = None,
    *,
    everything: bool = False,
    timeout_s: float = EVERYWHERE_S,
) -> tuple[list[str], list[str]]:
    """``reap`` on every alive node of the connected Ray cluster, each by a task pinned to its node:
    (what was reaped, the nodes that did not answer within ``timeout_s``, each with why)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    remote = ray.remote(num_cpus=0, max_retries=0)(reap)
    refs: dict[Any, str] = {}
    for node in ray.nodes():
        if node.get("Alive"):
            pinned = remote.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)
            )
            ref = pinned.remote(sandbox, run_id, everything=everything)
            refs[ref] = f"node {node['NodeID'][:12]} ({node.get('NodeManagerAddress')})"
    done, pending = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
    reaped: list[str] = []
    failed = [f"{refs[ref]}: no answer within {timeout_s:.0f} s" for ref in pending]
    for ref in done:
        try:
            reaped.extend(ray.get(ref))
        except Exception as exc:
            failed.append(f"{refs[ref]}: {str(exc)[-500:]}")
    for ref in pending:
        ray.cancel(ref, force=True)
    return reaped, failed


def reap_quietly(sandbox: SandboxConfig, *, everywhere: bool = False) -> list[str]:
    """``reap`` for callers in the middle of a run (``everywhere``: on every node, from a driver): a
    failing reaper is logged, never raised."""
    try:
        if everywhere:
            reaped, failed = reap_everywhere(sandbox)
            if failed:
                log.warning("reaping %s sandboxes failed on: %s", sandbox.provider, "; ".join(failed)[:1000])
        else:
            reaped = reap(sandbox)
    except Exception as exc:
        log.warning("reaping %s sandboxes failed: %s", sandbox.provider, str(exc)[:1000])
        return []
    if reaped:
        log.warning("reaped %d %s sandboxes of dead workers: %s", len(reaped), sandbox.provider, reaped[:20])
    return reaped

"""Which Ray cluster ``rollout run`` uses, and where a Ray job's output must not go.

Imports nothing of Ray: the CLI decides both before Ray starts, so a refused run costs no cluster."""

from __future__ import annotations

import os
from pathlib import Path

from executor.storage import is_object_uri
from executor.tasks import InputError

# The address that means "a local cluster of this process's own", as ray.init takes it.
LOCAL = "local"

# Where Ray unpacks a job's `--working-dir` on each node: SESSION/runtime_resources/working_dir_files/PKG
# (ray._private.ray_constants.DEFAULT_RUNTIME_ENV_DIR_NAME, WorkingDirPlugin in
# ray/_private/runtime_env/working_dir.py). The job's entrypoint runs with PKG as its cwd, and Ray deletes
# PKG once no job's runtime environment uses it. Spelled out here so that checking costs no Ray import;
# tests/test_ray_job.py checks the names against the installed Ray.
RUNTIME_ENV_DIR = "runtime_resources"
WORKING_DIR_FILES = "working_dir_files"


def cluster_address(configured: str | None) -> str | None:
    """The address of the cluster to join, or None for a local cluster of our own.

    ``configured`` is the run's ``ray_address`` (``--address`` overrides the config's); without one,
    ``RAY_ADDRESS`` (set by ``ray job submit`` and by cluster/submit_run.sh). The explicit setting wins
    over the environment: it names this run's cluster, while ``RAY_ADDRESS`` is set for every process of a
    shell or job. ``local`` asks for a cluster of our own even where ``RAY_ADDRESS`` is set. Nothing else
    joins: a cluster someone started on this machine with ``ray start`` is not ours to join unasked
    (``ray.init()`` without an address would, and then refuses the CPU count we give a cluster we start)."""
    address = configured or os.environ.get("RAY_ADDRESS") or None
    return None if address == LOCAL else address


def asks_own_cluster(configured: str | None) -> bool:
    """True when the run asked for a local cluster of its own (``local``): then not even the warm
    executor of ``rollout up`` is used."""
    return (configured or os.environ.get("RAY_ADDRESS") or None) == LOCAL


def ray_working_dir(path: Path) -> Path | None:
    """The copy of a Ray job's working directory that ``path`` lies in, if it lies in one."""
    for inner in (path, *path.parents):
        if inner.parent.name == WORKING_DIR_FILES and inner.parent.parent.name == RUNTIME_ENV_DIR:
            return inner
    return None


def check_out(out: str) -> None:
    """Refuse an output root inside Ray's copy of a job's working directory: a relative ``out`` of a
    run submitted with ``ray job submit --working-dir`` resolves there, and Ray deletes that copy with
    the job's runtime environment, rows and all, while reporting the job a success. An object-store URI
    lies in no working directory."""
    if is_object_uri(out):
        return
    path = Path(out).absolute()
    if ray_working_dir(path) is not None:
        raise InputError(
            f"out {path}: inside Ray's copy of the job's working directory (ray job submit --working-dir), "
            "which Ray deletes after the job; give --out (or out:) an object-store URI, e.g. "
            "--out s3://BUCKET/runs, or an absolute path on a filesystem the whole cluster shares, e.g. "
            "--out /shared/runs"
        )

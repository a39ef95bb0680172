"""The driver's cluster: the one ``cfg`` or ``RAY_ADDRESS`` names, else the warm executor ``rollout up``
left running, else a local one of this process's own; and how the driver leaves it once the run's work is
safe. Its state is this process's (one connection to Ray per process)."""

from __future__ import annotations

import contextlib
import os
from typing import Any

import ray
from ray.exceptions import RayError

from executor import stopping, warm
from executor.cluster import asks_own_cluster, cluster_address
from executor.config import RunConfig
from executor.local_ray import close_held, start_local_ray, stop_local_ray

# The GCS address of the local cluster this process started, while it runs: that one is ours to stop.
_own_gcs: str | None = None
# This process's hold on the warm executor it attached to (executor/warm.py), while attached.
_warm_lease: warm.Lease | None = None
# The warm executor was let go of (workers released, lease released) but its connection was left for the
# process's exit to close (``leave_ray(..., exiting=True)``).
_left_connected = False


def connect_ray(cfg: RunConfig, *, signals: bool = True) -> bool:
    """Join the cluster ``cfg`` or ``RAY_ADDRESS`` names (see ``cluster_address``), else attach to the
    warm executor ``rollout up`` left running, else start a local one of our own. True when connected to
    a local cluster this process started (then it is ours to stop, by ``stop_own_ray``), False when
    joined or attached (``leave_ray`` lets go of either). ``signals``: SIGTERM and SIGINT stop the run in
    order from now on (executor/stopping.py), which a command wants and a trainer's process may not."""
    try:
        if ray.is_initialized():
            return _own_gcs is not None and ray.get_runtime_context().gcs_address == _own_gcs
        return _connect(cfg)
    finally:
        if signals:
            stopping.take()  # after ray.init, which sets its own handlers


def _connect(cfg: RunConfig) -> bool:
    global _own_gcs, _warm_lease
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    address = cluster_address(cfg.ray_address)
    if address:
        ray.init(address=address, log_to_driver=True)
        return False
    if not asks_own_cluster(cfg.ray_address) and (lease := warm.attach()) is not None:
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # as the warm executor's cluster was started
        try:
            warm.connect(lease.record)
        except Exception:
            lease.release()
            raise
        _warm_lease = lease
        return False
    _own_gcs = start_local_ray()
    return True


def attached_lease() -> warm.Lease | None:
    """The warm executor this process is attached to, if it is."""
    return _warm_lease


def leave_ray(own: bool, workers: list[Any], *, exiting: bool = False) -> None:
    """Once the run's work is safe: stop the cluster we started, or let go of the warm executor (its
    workers keep what they built, the next run gets them warm), or, on a cluster we joined, end the
    run's workers once they have closed what they hold.

    ``exiting``: the process ends next (``rollout run``). An attached driver then leaves its connection
    for that end to close (``left_connected``): ``ray.shutdown()`` of a driver spends ~0.3 s waiting on
    its core worker's disconnect, while a driver's process ending tells the cluster the same (its job
    ends). Nothing of the run waits on the connection by then: every row and the summary are written,
    the workers have released the run's parts and hold no session of it, and the lease is given back."""
    global _warm_lease, _left_connected
    if own:
        stop_own_ray(workers)
    elif _warm_lease is None:
        # A cluster we joined. From a process that goes on (a trainer's) its job does not end, so the
        # run's workers would outlive the run; from one that ends (`ray job submit`'s entrypoint) the
        # job's end kills them at once, with no time to remove their sandboxes' cgroups and their
        # gateway's socket. Either way they close what they hold, then go.
        close_workers(workers)
    elif _warm_lease is not None:
        warm.release(workers)
        if exiting:
            _left_connected = True
        else:
            ray.shutdown()  # our driver's connection only: the warm cluster runs on
        _warm_lease.release()
        _warm_lease = None


def left_connected() -> bool:
    """True once this process let go of the warm executor it attached to and left its connection to it
    for the process's end to close (``leave_ray(..., exiting=True)``): the process must end next."""
    return _left_connected


def close_workers(workers: list[Any]) -> None:
    """End the run's worker actors: each closes what it holds (bounded), then is killed."""
    close_held(workers)
    for worker in workers:
        with contextlib.suppress(RayError, ValueError):
            ray.kill(worker)


def stop_own_ray(workers: list[Any]) -> None:
    """Stop the local cluster this process started, once the run's work is safe (rows durable,
    sandboxes stopped, summary written): the workers close what they hold, then the cluster goes
    (``executor.local_ray.stop_local_ray``)."""
    global _own_gcs
    stop_local_ray(workers)
    _own_gcs = None


def worker_options(cfg: RunConfig) -> dict[str, Any]:
    """How the run's worker actors are placed and restarted."""
    return {
        "num_cpus": 0,
        "max_restarts": -1,
        "max_task_retries": 0,
        "max_concurrency": cfg.concurrency.sessions_per_worker + 8,
        "resources": cfg.concurrency.worker_resources or None,
        "scheduling_strategy": "SPREAD",
    }

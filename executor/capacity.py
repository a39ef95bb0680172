"""Whether the cluster can host the run's worker actors (``concurrency.worker_resources``).

Ray keeps an actor that no node can host pending for ever, and the run with it: sessions in flight,
no worker, no row, no word. So the request is checked against the nodes before any worker is created:
when no alive node offers it, and no node is on its way (the autoscaler's report says which are being
launched), the run is refused in one line. A cluster whose capacity later drops below the run's workers
(a node lost, drained) is watched during the run, and the progress line says so.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from executor.tasks import InputError

log = logging.getLogger(__name__)

# How long the check waits for nodes the autoscaler is launching (a node type's min_workers after
# `ray up`): a cloud instance boots and joins in minutes.
PENDING_WAIT_S = 600.0
PENDING_POLL_S = 2.0
WATCH_S = 5.0  # how often the run's progress checks the cluster's capacity


def fits(request: dict[str, float], resources: dict[str, float]) -> int:
    """How many actors asking ``request`` a node with ``resources`` (its totals) hosts at once."""
    counts = [int(resources.get(name, 0.0) // amount) for name, amount in request.items() if amount > 0]
    return min(counts) if counts else 1_000_000


def placeable(request: dict[str, float], nodes: list[dict[str, Any]]) -> int:
    """How many worker actors asking ``request`` the alive ``nodes`` (``ray.nodes()``) host at once."""
    return sum(fits(request, n.get("Resources") or {}) for n in nodes if n.get("Alive"))


def describe(request: dict[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(request.items())) + "}"


def _offered(nodes: list[dict[str, Any]], names: set[str]) -> str:
    """What the alive nodes offer of the resources asked for, bounded."""
    alive = [n for n in nodes if n.get("Alive")]
    said = [describe({k: v for k, v in (n.get("Resources") or {}).items() if k in names}) for n in alive[:10]]
    more = f" and {len(alive) - 10} more" if len(alive) > 10 else ""
    return f"{len(alive)} alive node(s) offer " + ", ".join(said) + more


def _pending_nodes() -> int:
    """Nodes the autoscaler reports as being launched or set up; 0 without an autoscaler's report."""
    from executor import ray_private

    kv_get = ray_private.resolve("ray.experimental.internal_kv._internal_kv_get")
    if kv_get is None:
        return 0
    try:
        raw = kv_get("__autoscaling_status")  # ray_constants.DEBUG_AUTOSCALING_STATUS
        report = (json.loads(raw) if raw else {}).get("autoscaler_report") or {}
    except Exception as exc:  # a report it could not read: as if no autoscaler
        log.debug("no autoscaler report: %s", exc)
        return 0
    launches = report.get("pending_launches") or {}
    return sum(int(v) for v in launches.values()) + len(report.get("pending_nodes") or [])


def check(request: dict[str, float], workers: int, *, wait_s: float = PENDING_WAIT_S) -> None:
    """Refuse (InputError, one line) a request no alive node can host while no node is on its way;
    wait, bounded, while one is. Fewer places than workers is said once, and the run goes on."""
    if not request:
        return  # a worker asks for nothing (num_cpus=0): every node hosts it
    import ray

    deadline = time.monotonic() + wait_s
    while True:
        nodes = ray.nodes()
        places = placeable(request, nodes)
        if places or not _pending_nodes() or time.monotonic() >= deadline:
            break
        time.sleep(PENDING_POLL_S)  # waiting for the autoscaler's nodes to join, bounded
    if not places:
        raise InputError(
            f"concurrency.worker_resources {describe(request)}: no node of the cluster can host a worker "
            f"({_offered(nodes, set(request))}); start nodes with these resources (ray start --resources) "
            "or change worker_resources"
        )
    if places < workers:
        log.warning(
            "concurrency.worker_resources %s: the cluster hosts %d of the run's %d workers at once; the "
            "rest wait for room",
            describe(request),
            places,
            workers,
        )


class Watch:
    """The cluster's capacity for the run's workers, checked every ``WATCH_S`` during the run; ``note``
    is what the progress line shows, None while every worker has a place."""

    def __init__(self, request: dict[str, float], workers: int) -> None:
        self.request = request
        self.workers = workers
        self.note: str | None = None
        self._last = time.monotonic()

    def tick(self, force: bool = False) -> None:
        if not self.request or (not force and time.monotonic() - self._last < WATCH_S):
            return
        self._last = time.monotonic()
        import ray

        try:
            places = placeable(self.request, ray.nodes())
        except Exception as exc:  # the GCS not answering now: said by Ray; the next tick asks again
            log.debug("cluster capacity unknown: %s", exc)
            return
        if places >= self.workers:
            self.note = None
        else:
            self.note = (
                f"the cluster now hosts {places} of {self.workers} workers asking {describe(self.request)}"
            )

"""Every private Ray API the product reaches for, in one table: what each is for, the Ray releases it
was checked on, and what happens where it is absent.

The supported range is pyproject.toml's (``ray[default]>=2.49.2,<2.61``); CI runs the Ray-facing tests on
both ends of it (``make test-ray-oldest``). A private name Ray moved or dropped never breaks a run: the
code that wanted it takes the fallback the table names, and says so once per process in the log (a
warning; an info line where the table knows the release has no such name and the fallback is then what
Ray does anyway). Nothing else in ``executor/``, ``sandboxes/`` or ``harnesses/`` names ``ray._private``,
``ray._raylet``, ``ray._common`` or a private function of a public module.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

# The releases every item was checked on unless it says otherwise: the two ends of the supported range.
CHECKED = ("2.49.2", "2.60.0")


@dataclass(frozen=True)
class Private:
    """One private Ray name, and what the product does without it."""

    name: str  # dotted: a module path, then attributes (``ray._private.node.Node.start_api_server``)
    used_for: str
    absent: str  # what happens where it is missing
    checked: tuple[str, ...] = CHECKED
    # Checked releases known to lack it, where the fallback is Ray's own behaviour: said as info.
    absent_in: tuple[str, ...] = ()


_LEAN = "a lean local node (executor/local_ray.py: _lean_node)"
_LEAN_ABSENT = (
    "ray.init starts Ray's default node (an autoscaler monitor, a log monitor, the dashboard before the "
    "raylet, Ray's fixed agent port, a 1 s registration poll): a slower start, nothing else"
)

ITEMS: dict[str, Private] = {
    p.name: p
    for p in (
        Private(
            "ray._private.ray_constants.ENABLE_RAY_CLUSTER",
            "keeping a local cluster of ours on the loopback (executor/local_ray.py: loopback_only)",
            "only RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 in the environment says it, which the processes Ray "
            "starts read; this process's own ray.init reads what it read at import",
        ),
        Private(
            "ray._private.ray_constants.PROCESS_TYPE_DASHBOARD",
            "finding the dashboard process a node of ours started (executor/local_ray.py)",
            'the name "dashboard", its value in every checked release',
        ),
        Private("ray._private.parameter.RayParams", _LEAN, _LEAN_ABSENT),
        Private("ray._private.utils.get_dashboard_dependency_error", _LEAN, _LEAN_ABSENT),
        Private("ray._private.node.Node.start_api_server", _LEAN, _LEAN_ABSENT),
        Private("ray._private.worker.disconnect", _LEAN, _LEAN_ABSENT),
        Private("ray._private.services.get_node", _LEAN, _LEAN_ABSENT),
        Private("ray._private.services._get_gcs_client_options", _LEAN, _LEAN_ABSENT),
        Private(
            "ray._private.state.GlobalState",
            "learning within 20 ms that a node of ours registered (executor/local_ray.py: _registered_soon)",
            "Ray's own wait for the registration, which polls once a second",
        ),
        Private(
            "ray._private.services.find_node_ids",
            "attaching to the warm executor's node by the id its record names, skipping Ray's scan of "
            "every process's command line (executor/warm.py: connect)",
            "Ray finds the node itself; releases without it (2.49) ask the GCS by IP and scan nothing",
            absent_in=("2.49.2",),
        ),
        Private(
            "ray.experimental.internal_kv._internal_kv_get",
            "reading the autoscaler's report of nodes on their way (executor/capacity.py)",
            "as if no autoscaler reported any: a request no alive node hosts is refused at once",
        ),
        Private(
            "ray._private.ray_constants.DEFAULT_RUNTIME_ENV_DIR_NAME",
            "recognising Ray's copy of a job's working directory (executor/cluster.py, which spells the "
            "name out so the CLI decides without importing Ray; tests/test_ray_job.py checks it)",
            "nothing at run time; a Ray that renamed it fails that test",
        ),
        Private(
            "ray._common.usage.usage_lib",
            "pre-importing what a run imports (executor/driver_server.py: PRELOAD)",
            "not pre-imported: a run handed over imports it itself, if it needs it",
        ),
        Private(
            "ray._private.arrow_serialization",
            "pre-importing what a run imports (executor/driver_server.py: PRELOAD)",
            "not pre-imported: a run handed over imports it itself, if it needs it",
        ),
        Private(
            "ray._private.runtime_env.uv_runtime_env_hook",
            "pre-importing what a run imports (executor/driver_server.py: PRELOAD)",
            "not pre-imported: a run handed over imports it itself, if it needs it",
        ),
    )
}

_said: set[str] = set()
_said_lock = threading.Lock()


def resolve(name: str) -> Any | None:
    """The object ``name`` (a key of ``ITEMS``) names in the installed Ray, or None where it has none
    (said once per process)."""
    item = ITEMS[name]  # a name not in the table is a bug here, not a Ray difference
    found = _lookup(item.name)
    if found is None:
        _say_absent(item)
    return found


def available(*names: str) -> bool:
    """Whether every one of ``names`` resolves; each missing one is said once."""
    return all([resolve(name) is not None for name in names])  # a list: every missing one is said


@contextlib.contextmanager
def patched(name: str, replacement: Callable[[Any], Any]) -> Iterator[bool]:
    """While inside: ``name`` is ``replacement(original)``, then the original again. Yields whether it
    was patched (False where the installed Ray has no such name, said once)."""
    original = resolve(name)
    if original is None:
        yield False
        return
    holder, attr = _lookup(name.rpartition(".")[0]), name.rpartition(".")[2]
    setattr(holder, attr, replacement(original))
    try:
        yield True
    finally:
        setattr(holder, attr, original)


def owner(name: str) -> Any | None:
    """What holds ``name`` (a key of ``ITEMS``; its module, say), to change it there; None as ``resolve``."""
    if resolve(name) is None:
        return None
    return _lookup(name.rpartition(".")[0])


def _lookup(dotted: str) -> Any | None:
    """Import the longest module prefix of ``dotted``, then walk the attributes after it."""
    parts = dotted.split(".")
    for split in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for attr in parts[split:]:
            obj = getattr(obj, attr, None)
            if obj is None:
                return None
        return obj
    return None


def _say_absent(item: Private) -> None:
    with _said_lock:
        if item.name in _said:
            return
        _said.add(item.name)
    version = _ray_version()
    level = logging.INFO if version in item.absent_in else logging.WARNING
    log.log(level, "Ray %s has no %s (used for %s): %s", version, item.name, item.used_for, item.absent)


def _ray_version() -> str:
    try:
        import ray
    except ImportError:
        return "(not installed)"
    return str(getattr(ray, "__version__", "?"))

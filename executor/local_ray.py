"""A local Ray cluster of this process's own: started lean, on the loopback only, and fast; stopped once
its workers closed what they hold."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import ray
from ray.exceptions import RayError

from executor import ray_private
from executor.cluster import LOCAL

log = logging.getLogger(__name__)


def start_local_ray() -> str:
    """Start a local cluster of this process's own; its GCS address."""
    # Loopback only, no token to distribute, no dashboard to pay for.
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    with loopback_only(), _lean_node():
        ray.init(
            # "local", not None: without an address ray.init joins a cluster `ray start` left on this machine.
            address=LOCAL,
            num_cpus=max(2, os.cpu_count() or 2),
            include_dashboard=False,
            log_to_driver=False,
            # Its INFO line would be the only output of a run the preflight refuses in one line.
            logging_level=logging.WARNING,
            _node_ip_address="127.0.0.1",
            # Ray starts one idle worker process per CPU for the first driver and holds that driver's
            # connection until they are up: ~1 s of imports each, on the CPUs the node is starting on,
            # for processes a run may never use (its worker actors get processes of their own as they
            # are created, which then overlaps the driver's own start).
            _system_config={"prestart_worker_first_driver": False, **_PROMPT_CONNECTS},
        )
    return str(ray.get_runtime_context().gcs_address)


CLOSE_S = 30.0  # for the workers to close what they hold before the cluster they run in stops


def stop_local_ray(workers: list[Any]) -> None:
    """Stop the local cluster this process started, once the run's work is safe (rows durable,
    sandboxes stopped, summary written): the workers close what they hold, then the cluster goes.

    ``ray.shutdown()`` at interpreter exit took ~2 s, none of it ours: a 0.5 s pause for log lines
    (only when called from atexit), then each of Ray's processes in turn is sent SIGTERM and given up
    to 1 s (the autoscaler monitor took all of that second; it is not started now, see
    ``_lean_node``)."""
    close_held(workers)
    ray.shutdown()


def close_held(workers: list[Any]) -> None:
    """Each worker closes what it holds, bounded."""
    # A worker class without close (a benchmark's null worker) holds nothing to close.
    closes = [close.remote() for w in workers if (close := getattr(w, "close", None)) is not None]
    try:
        ray.get(closes, timeout=CLOSE_S)
    except (RayError, TimeoutError) as exc:
        # A worker gone or stuck: its sandboxes' supervisors end with its process, as after a crash.
        log.warning("workers did not all close within %.0f s: %s", CLOSE_S, str(exc)[:500])


# A Ray process connecting to a local socket (the raylet to its object store, a worker to its raylet)
# that is not listening yet retries every 1 s, 10 times: the raylet lost a whole second to its own
# object store's thread in about one start in three. The same 10 s bound, in 20 ms steps.
_PROMPT_CONNECTS = {
    "raylet_client_connect_timeout_milliseconds": 20,
    "raylet_client_num_connect_attempts": 500,
}
# How often the driver asks the GCS whether its node's raylet has registered (Ray asks every 1 s).
_NODE_POLL_S = 0.02
_RAYLET_START_S = 30.0  # Ray's own bound for it (raylet_start_wait_time_s)
# The dashboard process serves nothing a cluster of ours uses; it must not starve (Ray gives it 60 s).
_DASHBOARD_NICE = 10
# Ray's bound on the dashboard's start (RAY_DASHBOARD_STARTUP_TIMEOUT_S, 60 s), and some.
_DASHBOARD_START_S = 90.0


@contextlib.contextmanager
def loopback_only() -> Iterator[None]:
    """While ``ray.init`` starts a local cluster of ours, or attaches to one (the warm executor's): its
    servers listen on 127.0.0.1 only, and the attaching driver looks for them there. Ray turns
    ``_node_ip_address="127.0.0.1"`` into the machine's routable address and binds its GCS, raylet and
    workers to every interface, which with no token (``RAY_AUTH_MODE=disabled``) would let anyone on the
    network run code on this host. Ray keeps to the loopback only where it thinks clusters unsupported,
    which it reads from the environment at its import (long before this call) and then from its
    constants module: both are set, the environment for the processes it starts."""
    previous = os.environ.get(_CLUSTERS_ENV)
    os.environ[_CLUSTERS_ENV] = "0"  # the processes it starts now (and theirs later) inherit it
    try:
        with ray_private.patched("ray._private.ray_constants.ENABLE_RAY_CLUSTER", lambda _was: False):
            yield
    finally:
        if previous is None:
            os.environ.pop(_CLUSTERS_ENV, None)
        else:
            os.environ[_CLUSTERS_ENV] = previous


# Ray reads it as "clusters are unsupported here (Windows, macOS): keep to the loopback".
_CLUSTERS_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


@contextlib.contextmanager
def _lean_node() -> Iterator[None]:
    """While ``ray.init`` starts a local cluster of ours: what it does not need is not started or not
    waited for, and what it needs does not wait on another cluster of this machine. ``ray.init`` takes
    none of these settings, which ``ray start`` takes in part (``--no-monitor``, ``--include-log-monitor``,
    ``--dashboard-agent-listen-port``), so they go into the node it builds:

    - the dashboard agent's HTTP port: a free one, not Ray's fixed 52365. With another cluster on the
      machine (a warm executor, a test's) that port is taken, and the agent retried it with backoff for
      3.4 s before going on without it, while the node's registration, and so ``ray.init``, waited;
    - no autoscaler monitor: it scales nothing on one node, holds nothing, and its SIGTERM handler made
      ``ray.shutdown()`` wait 1 s (it reports its own "failure" to a GCS that has just been stopped);
    - no log monitor: it streams workers' output to drivers, and ours take none (``log_to_driver``);
    - the dashboard process and the dashboard agent in Ray's minimal mode, as a ``ray`` without the
      dashboard's packages runs them: no metrics, HTTP or gRPC servers, nothing imported for them. The
      node registers only once its agent is up, so the agent's start is on ``ray.init``'s path. Jobs
      and the state API go through these servers; a cluster of a run's own serves neither;
    - the dashboard process starts beside the raylet, not before it, and at a lower priority (nice
      ``_DASHBOARD_NICE``): ``ray.init`` waited for it to come up (~1 s of imports) before it started
      the raylet, which needs nothing of it, and its imports took the CPUs from the node's agents, which
      the raylet's registration waits for, and from the first worker actor's. Nothing of ours waits for
      it but the cluster's shutdown, which must know its process to stop it (``_DashboardBeside``);
    - the driver learns of its raylet's registration within 20 ms (``_registered_soon``), not within
      Ray's 1 s poll: half a second of every start on average.

    The monitor and the log monitor are each a Python process importing on the CPUs the node's agents
    and the first worker actor start on. Where Ray's private names moved (executor/ray_private.py),
    ray.init starts its default node."""
    if not ray_private.available(*_LEAN_NAMES):
        yield
        return
    base = ray_private.resolve("ray._private.parameter.RayParams")

    class LeanParams(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.setdefault("dashboard_agent_listen_port", _free_port())
            kwargs.setdefault("no_monitor", True)
            kwargs.setdefault("include_log_monitor", False)
            super().__init__(*args, **kwargs)

    gcs_client_options = ray_private.resolve("ray._private.services._get_gcs_client_options")
    dashboard = _DashboardBeside(
        ray_private.resolve("ray._private.node.Node.start_api_server"),
        ray_private.owner("ray._private.worker.disconnect"),
    )

    def once_registered(get_node: Any) -> Any:
        def get_node_once_registered(gcs_address: str, node_id: str) -> Any:
            _registered_soon(gcs_client_options(gcs_address), node_id)
            return get_node(gcs_address, node_id)

        return get_node_once_registered

    with contextlib.ExitStack() as patches:
        patches.enter_context(
            ray_private.patched("ray._private.parameter.RayParams", lambda _base: LeanParams)
        )
        patches.enter_context(
            ray_private.patched(
                "ray._private.utils.get_dashboard_dependency_error",
                lambda _check: lambda: ImportError("a local cluster of rollout's own"),
            )
        )
        patches.enter_context(
            ray_private.patched(
                "ray._private.node.Node.start_api_server",
                lambda _start: lambda self, **kwargs: dashboard.start(self, **kwargs),
            )
        )
        patches.enter_context(ray_private.patched("ray._private.services.get_node", once_registered))
        try:
            yield
        except BaseException:
            dashboard.wait_started()  # a ray.init that failed leaves no start of it under way
            raise


# What _lean_node changes in Ray's start of a node; without any one of them it changes nothing.
_LEAN_NAMES = (
    "ray._private.parameter.RayParams",
    "ray._private.utils.get_dashboard_dependency_error",
    "ray._private.node.Node.start_api_server",
    "ray._private.worker.disconnect",
    "ray._private.services.get_node",
    "ray._private.services._get_gcs_client_options",
)


class _DashboardBeside:
    """The dashboard process of a node of ours, started beside its raylet by a thread of its own.

    Before the driver disconnects (the first step of ``ray.shutdown()``, whoever calls it, at exit too),
    the start is waited for: it polls the GCS through the driver's client, which the disconnect drops,
    and only once it is done is the process known to the node, and so stopped with the rest. The thread
    then lives as long as the process: Ray fate-shares the processes it starts with what started them
    (``PR_SET_PDEATHSIG``), which the kernel reads as the thread, so the dashboard ended with it."""

    def __init__(self, start_api_server: Any, worker: Any) -> None:
        self._start_api_server = start_api_server
        self._worker = worker
        self._done = threading.Event()

    def start(self, node: Any, **kwargs: Any) -> None:
        """In place of ``Node.start_api_server``: returns at once."""
        threading.Thread(
            target=self._run, args=(node, kwargs), name="rollout-ray-dashboard", daemon=True
        ).start()
        disconnect = self._worker.disconnect

        def disconnect_once_started(*args: Any, **kwargs: Any) -> Any:
            self.wait_started()
            if self._worker.disconnect is disconnect_once_started:
                self._worker.disconnect = disconnect
            return disconnect(*args, **kwargs)

        self._worker.disconnect = disconnect_once_started

    def wait_started(self) -> None:
        self._done.wait(_DASHBOARD_START_S)

    def _run(self, node: Any, kwargs: dict[str, Any]) -> None:
        # Per thread on Linux, and inherited by the process this thread starts.
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), _DASHBOARD_NICE)
        try:
            self._start_api_server(node, **kwargs)
        except Exception as exc:  # as Ray's own failure to start it (raise_on_failure false): said, not fatal
            log.warning("the Ray dashboard process did not start: %s", str(exc)[:500])
        finally:
            self._done.set()
        key = ray_private.resolve("ray._private.ray_constants.PROCESS_TYPE_DASHBOARD") or "dashboard"
        for info in node.all_processes.get(key, ()):
            info.process.wait()  # bounded by the node's life: its shutdown stops the process


def _registered_soon(gcs_options: Any, node_id: str) -> None:
    """Wait, bounded, until the GCS lists node ``node_id`` alive, asking every ``_NODE_POLL_S``.

    Ray's own wait for it asks the GCS, then sleeps a whole second before asking again, while the
    raylet's registration (its agents' start) takes 1-2 s; Ray's wait then follows at once and keeps
    its own bound and error. A GCS that does not answer is left to it as well."""
    global_state = ray_private.resolve("ray._private.state.GlobalState")
    if global_state is None:
        return
    state = global_state()
    state._initialize_global_state(gcs_options)
    deadline = time.monotonic() + _RAYLET_START_S
    try:
        while time.monotonic() < deadline:
            if any(n.get("NodeID") == node_id and n.get("Alive") for n in state.node_table()):
                return
            time.sleep(_NODE_POLL_S)
    except Exception:  # Ray's own wait reports it, as it would have without this one
        return
    finally:
        state.disconnect()


def _free_port() -> int:
    """A TCP port free on every address now (the node picks its IP itself)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])

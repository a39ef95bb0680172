"""Raylets of our own for `rollout bench --parts f --nodes N`: `ray start` processes on this machine, each
ended by its pid (never `ray stop`, which would end every Ray cluster on the host)."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from sandboxes.testing.leaks import processes_under

_NODE_PORTS = (
    "node-manager-port object-manager-port metrics-export-port dashboard-agent-listen-port "
    "dashboard-agent-grpc-port runtime-env-agent-port"
).split()
_HEAD_PORTS = ["port", "dashboard-port", "ray-client-server-port", *_NODE_PORTS]
_WORKER_PORTS = 60  # each node's range for its worker processes
_NODES_UP_S = 180.0
_NODES_END_S = 60.0


def _free_ports(n: int, given: set[int], consecutive: bool = False) -> list[int]:
    """Ports below the kernel's ephemeral range (where no bind to port 0 lands), each free when checked
    and none handed out twice; as tests/ports.py picks them."""
    top = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])

    def free(port: int) -> bool:
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                return False
        return port not in given

    for _ in range(1000):
        first = random.randrange(20000, top - n)
        picked = list(range(first, first + n)) if consecutive else random.sample(range(20000, top), n)
        if len(set(picked)) == n and all(map(free, picked)):
            given.update(picked)
            return picked
    raise RuntimeError(f"no {n} free ports below {top}")


@contextlib.contextmanager
def raylets(n: int, slots: int, env: dict[str, str]) -> Iterator[str]:
    """``n`` raylets on this machine (a head and ``n - 1`` joined to it, each `ray start --block` a child
    of ours, its temp dir its own), each offering ``slots`` of the ``sandbox_slot`` resource that each
    worker actor asks one of, so the workers spread evenly; yields the head's address once every node
    has registered. At the end each is ended by its pid, and whatever is left under their temp dirs is
    killed by pid."""
    import ray

    root = Path(tempfile.mkdtemp(prefix="rb-f-", dir="/tmp"))  # Ray's socket paths must fit 107 bytes
    given: set[int] = set()
    procs: list[subprocess.Popen[bytes]] = []
    ray_bin = str(Path(sys.executable).parent / "ray")
    # Loopback only and no token to hand out, as every cluster of ours on one machine (local_ray.py): a
    # token left in ~/.ray by another cluster would otherwise turn token auth on for these nodes.
    node_env = {
        **os.environ,
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1",
        "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled"),
        **env,
    }
    node_env.pop("RAY_ADDRESS", None)
    head_ports = dict(zip(_HEAD_PORTS, _free_ports(len(_HEAD_PORTS), given), strict=True))
    address = f"127.0.0.1:{head_ports['port']}"
    try:
        for i in range(n):
            for attempt in range(_NODE_TRIES):
                proc = _start_node(i, address, head_ports, given, slots, root, ray_bin, node_env)
                procs.append(proc)
                # One at a time, and again if it gave up: `ray start` gives its raylet 30 s to register
                # (a constant of Ray's), which a loaded machine does not always meet.
                if _until_nodes(address, i + 1, proc):
                    break
                if i == 0 or attempt == _NODE_TRIES - 1:
                    logs = "".join(
                        f"--- {f.name}: {f.read_text()[-800:]}" for f in sorted(root.glob("*.log"))
                    )
                    raise RuntimeError(f"raylet {i} not up after {attempt + 1} starts: {logs}")
        yield address
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)  # `ray start --block` stops its node's processes
        for proc in procs:
            try:
                proc.wait(timeout=_NODES_END_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=30)
        for entry in processes_under(str(root)):
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(entry.split(":", 1)[0]), signal.SIGKILL)
        ray.shutdown()
        import shutil

        shutil.rmtree(root, ignore_errors=True)


_NODE_TRIES = 3


def _start_node(
    i: int,
    address: str,
    head_ports: dict[str, int],
    given: set[int],
    slots: int,
    root: Path,
    ray_bin: str,
    env: dict[str, str],
) -> subprocess.Popen[bytes]:
    ports = (
        head_ports if i == 0 else dict(zip(_NODE_PORTS, _free_ports(len(_NODE_PORTS), given), strict=True))
    )
    low = _free_ports(_WORKER_PORTS, given, consecutive=True)[0]
    args = ["--head", "--dashboard-host", "127.0.0.1"] if i == 0 else ["--address", address]
    temp = root / f"n{i}-{len(given)}"  # each node's sockets and logs its own, a retried one's too
    args += ["--temp-dir", str(temp), "--num-cpus", "1", "--node-ip-address", "127.0.0.1"]
    args += ["--resources", json.dumps({"sandbox_slot": slots})]
    args += [f"--{k}={v}" for k, v in ports.items()]
    args += [f"--min-worker-port={low}", f"--max-worker-port={low + _WORKER_PORTS - 1}"]
    with (root / f"{temp.name}.log").open("wb") as log:
        return subprocess.Popen(
            [ray_bin, "start", "--block", *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )


def _until_nodes(address: str, n: int, node: subprocess.Popen[bytes]) -> bool:
    """Whether ``n`` nodes are alive in the cluster at ``address`` within a bound, while ``node`` (the
    last one started) runs; asked from a short-lived process, so that this one's Ray client is the
    run's own."""
    ask = (
        "import ray, sys, time\n"
        f"ray.init(address={address!r}, logging_level='ERROR')\n"
        f"end = time.monotonic() + {_NODES_UP_S}\n"
        f"while sum(x['Alive'] for x in ray.nodes()) < {n} and time.monotonic() < end:\n"
        "    time.sleep(0.5)\n"  # a condition, asked again; bounded
        f"sys.exit(0 if sum(x['Alive'] for x in ray.nodes()) >= {n} else 1)\n"
    )
    env = {
        **os.environ,
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1",
        "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled"),
    }
    env.pop("RAY_ADDRESS", None)
    asker = subprocess.Popen(
        [sys.executable, "-c", ask], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.monotonic() + _NODES_UP_S + 60
    try:
        while asker.poll() is None and node.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)  # a condition, looked at again; bounded
        return asker.poll() == 0 and node.poll() is None
    finally:
        if asker.poll() is None:
            asker.kill()
            asker.wait(timeout=30)

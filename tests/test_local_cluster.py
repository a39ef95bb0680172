"""A run's own local cluster listens on the loopback only: it runs with no token, so a server of it on
another interface would let anyone on the network run code on this host. A driver attaching to such a
cluster (the warm executor's) finds it there.

The probes run in processes of their own, with the environment a user's shell has: not conftest's
setting, which keeps the tests' own clusters on the loopback whatever the code does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from sandboxes.testing.leaks import ended

REPO = Path(__file__).parents[1]

# Starts the cluster as `rollout run` does, then reports the GCS address and every TCP port in LISTEN
# held by this process or one it started (Ray's GCS, raylet, agents and workers), with its address.
PROBE = r"""
import json, os
from executor.driver import stop_own_ray
from executor.local_ray import start_local_ray
from sandboxes import proctree

def sockets(pid):
    found = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                found.add(link[8:-1])
    except OSError:
        pass
    return found

gcs = start_local_ray()
ours = {os.getpid()} | proctree.descendants(proctree.snapshot(), os.getpid())
inodes = set().union(*(sockets(pid) for pid in ours))
listening = []
for table in ("/proc/net/tcp", "/proc/net/tcp6"):
    with open(table) as f:
        for line in f.readlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                listening.append(fields[1])
stop_own_ray([])
print(json.dumps({"gcs": gcs, "listening": listening}))
"""


def _user_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"}


LOOPBACK = {
    "0100007F",  # 127.0.0.1, as /proc/net/tcp writes it
    "0000000000000000FFFF00000100007F",  # ::ffff:127.0.0.1
    "00000000000000000000000001000000",  # ::1
}


def test_a_runs_own_cluster_listens_on_the_loopback_only() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=180, cwd=REPO, env=_user_env()
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["gcs"].startswith("127.0.0.1:")
    addresses = {entry.split(":")[0] for entry in report["listening"]}
    assert report["listening"]  # the probe saw Ray's servers at all
    assert addresses <= LOOPBACK, report["listening"]


# A cluster of ours held open (as `rollout up` holds one) until its stdin closes.
HOLD = r"""
import json, sys
import ray
from executor.driver import stop_own_ray
from executor.local_ray import start_local_ray
gcs = start_local_ray()
print(json.dumps({"gcs": gcs, "node_id": ray.get_runtime_context().get_node_id()}), flush=True)
sys.stdin.read()
stop_own_ray([])
"""

# A driver attaching to it as `rollout run` attaches to the warm executor, and running a task there.
ATTACH = r"""
import json, sys, time
import ray
from executor.warm import Record, connect
held = json.loads(sys.argv[1])
connect(Record(0, held["gcs"], 60.0, time.time(), held["node_id"]))
print(json.dumps({"answer": ray.get(ray.remote(lambda: 42).remote(), timeout=120)}))
"""


def test_a_driver_attaches_to_a_loopback_cluster_of_ours() -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, cwd=REPO, env=_user_env(),
    )  # fmt: skip
    try:
        held = holder.stdout.readline() if holder.stdout else ""
        assert held, holder.stderr.read() if holder.stderr and holder.poll() is not None else "no cluster"
        assert json.loads(held)["gcs"].startswith("127.0.0.1:")
        # Without the fix Ray looked for the GCS on the machine's routable address and retried for minutes.
        proc = subprocess.run(
            [sys.executable, "-c", ATTACH, held], capture_output=True, text=True, timeout=180, cwd=REPO,
            env=_user_env(),
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"answer": 42}
    finally:
        if holder.stdin:
            holder.stdin.close()
        holder.wait(timeout=120)


# The dashboard process of a cluster of ours, which Ray fate-shares with the thread that starts it: it
# must outlive that thread's start of it, and be stopped with the cluster, also when the cluster is
# stopped while the dashboard is still starting (its start is waited for before the driver disconnects).
DASHBOARD = r"""
import json, os, sys, time
import ray
from executor.driver import stop_own_ray
from executor.local_ray import start_local_ray
from sandboxes import proctree

def tree():
    return sorted(proctree.descendants(proctree.snapshot(), os.getpid()))

def dashboards(pids):
    found = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"dashboard/dashboard.py" in f.read():
                    found.append(pid)
        except OSError:
            pass
    return found

report = {}
start_local_ray()
report["at_once"] = tree()
stop_own_ray([])  # at once: the dashboard is still importing

start_local_ray()
node = ray._private.worker._global_node
deadline = time.monotonic() + 120
while "dashboard" not in node.all_processes and time.monotonic() < deadline:
    time.sleep(0.05)  # bounded: Ray's own start of the dashboard gives up after 60 s
assert ray.get(ray.remote(lambda: os.getpid()).remote(), timeout=120)  # a worker's start: long after
report["running"] = tree()
report["dashboards_running"] = dashboards(report["running"])
stop_own_ray([])
print(json.dumps(report))
"""


def test_the_dashboard_lives_with_the_cluster_and_is_stopped_with_it() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", DASHBOARD], capture_output=True, text=True, timeout=300, cwd=REPO,
        env=_user_env(),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    # A stop during the dashboard's start used to cut its poll of the GCS short (Ray logged the error).
    assert "internal_kv_get" not in proc.stderr and "Failed to start" not in proc.stderr, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(report["dashboards_running"]) == 1  # alive long after the thread that started it was done
    for pid in report["at_once"] + report["running"]:
        assert ended(pid, 60), f"process {pid} of a stopped cluster still runs"

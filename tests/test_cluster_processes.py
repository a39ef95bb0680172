"""A real multi-process cluster: `ray start --head` and two worker raylets started with
`ray start --address`, each a process tree of its own with its own ports, temp dir and node-local scratch;
the run submitted with `ray job submit`, its output on S3 (moto's server). One worker raylet is killed
mid-run: its sessions run again elsewhere, every completed row's evidence is in storage, every
(task, sample) has exactly one final row, and no sandbox is left."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from executor.store import read_table
from sandboxes.proctree import read_proc
from tests.conftest import REPO, processes_under, sandbox_yaml
from tests.ports import free_ports
from tests.s3_server import s3_server
from tests.test_ray_job import RAY, _dashboard_up, _end

pytestmark = pytest.mark.integration

N_TASKS = 6
WORKER_PORTS = 41  # each worker raylet's range
BOUND_S = 180.0
NODE_PORTS = (
    "node-manager-port object-manager-port metrics-export-port dashboard-agent-listen-port "
    "dashboard-agent-grpc-port runtime-env-agent-port"
).split()


def _wait(what: str, ready: Callable[[], bool], procs: list[subprocess.Popen[bytes]], logs: Path) -> None:
    deadline = time.monotonic() + BOUND_S
    while not ready():
        dead = [p.args for p in procs if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            said = "".join(f"--- {f.name}\n{f.read_text()[-1500:]}" for f in sorted(logs.glob("*.log")))
            pytest.fail(f"no {what} (exited: {dead}):\n{said}")
        time.sleep(0.2)  # waiting for a condition, bounded; not synchronisation by sleeping


def _start(args: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(
            [str(RAY), "start", "--block", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )


def _raylet_pid(temp_dir: Path) -> int | None:
    """The raylet of the node whose temp dir is ``temp_dir`` (it names it on its command line). A process
    in the middle of an exec shows an empty command line; one the raylet forked shows the raylet's until
    its exec, so a raylet whose parent is one too is not the raylet."""
    raylets: dict[int, int] = {}
    for entry in processes_under(str(temp_dir)):
        pid, _, cmdline = entry.partition(":")
        if cmdline.split()[:1] and cmdline.split()[0].endswith("/raylet"):
            info = read_proc(int(pid))
            if info is not None:
                raylets[info.pid] = info.ppid
    return next((pid for pid, ppid in raylets.items() if ppid not in raylets), None)


def _gated_sessions(marker: str) -> int:
    return sum(1 for entry in processes_under(marker) if "while" in entry)


def test_a_worker_raylet_killed_mid_run_loses_no_row_and_no_evidence(monkeypatch, gate_dir):
    # Short, under /tmp: Ray's socket paths must fit in 107 bytes.
    root = Path(tempfile.mkdtemp(prefix="rr-mp-", dir="/tmp"))
    logs = root / "logs"
    logs.mkdir()
    procs: list[subprocess.Popen[bytes]] = []
    markers: dict[int, Path] = {}  # a started process's pid: the dir every process of its own names
    with s3_server(logs / "moto.log") as s3:
        s3.client().create_bucket(Bucket="runs")
        for key, value in s3.env().items():  # this process reads the run back from the same store
            monkeypatch.setenv(key, value)
        base_env = {
            **{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"},
            **s3.env(),  # as a cloud node has its credentials: in its environment, never in the run
            "RAY_AUTH_MODE": "disabled",
            "RAY_USAGE_STATS_ENABLED": "0",
            # tests/conftest.py sets it to 0 for the single-node clusters; a node joining a head needs 1.
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1",
            "PYTHONPATH": str(REPO),
            # A lost node is declared dead in seconds, not the default half minute.
            "RAY_health_check_period_ms": "1000",
            "RAY_health_check_failure_threshold": "3",
            "RAY_health_check_initial_delay_ms": "1000",
        }
        try:
            head_ports = dict(zip(["port", "dashboard-port", *NODE_PORTS], free_ports(8), strict=True))
            procs.append(
                _start(
                    ["--head", "--temp-dir", str(root / "head"), "--num-cpus", "2"]
                    + ["--node-ip-address", "127.0.0.1", "--dashboard-host", "127.0.0.1"]
                    + [f"--{k}={v}" for k, v in head_ports.items()],
                    logs / "head.log",
                    base_env,
                )
            )
            markers[procs[-1].pid] = root / "head"
            dashboard = f"http://127.0.0.1:{head_ports['dashboard-port']}"
            _wait("dashboard", lambda: _dashboard_up(dashboard), procs, logs)
            nodes: dict[str, Path] = {}
            starts: dict[str, subprocess.Popen[bytes]] = {}
            for name in ("a", "b"):
                temp = root / f"n{name}"
                scratch = root / f"scratch-{name}"  # this node's TMPDIR: the worker's evidence scratch
                scratch.mkdir()
                ports = dict(zip(NODE_PORTS, free_ports(len(NODE_PORTS)), strict=True))
                low = free_ports(WORKER_PORTS, consecutive=True)[0]  # all free, not only the first
                procs.append(
                    _start(
                        ["--address", f"127.0.0.1:{head_ports['port']}", "--temp-dir", str(temp)]
                        + ["--num-cpus", "1", "--node-ip-address", "127.0.0.1"]
                        + ["--resources", json.dumps({"sandbox_slot": 2, f"node_{name}": 1})]
                        + [f"--{k}={v}" for k, v in ports.items()]
                        + [f"--min-worker-port={low}", f"--max-worker-port={low + WORKER_PORTS - 1}"],
                        logs / f"node-{name}.log",
                        {**base_env, "TMPDIR": str(scratch)},
                    )
                )
                nodes[name], starts[name] = temp, procs[-1]
                markers[procs[-1].pid] = temp
            for temp in nodes.values():
                _wait(f"raylet under {temp}", lambda t=temp: _raylet_pid(t) is not None, procs, logs)

            job = root / "job"
            job.mkdir()
            gate = gate_dir / "gate"  # where the sandboxes see it: /tmp is hidden from them
            (job / "tasks.jsonl").write_text(
                "".join(
                    json.dumps({"id": f"t{i}", "prompt": "p", "verify": "test -f done.txt"}) + "\n"
                    for i in range(N_TASKS)
                )
            )
            agent = f"while [ ! -e {gate} ]; do sleep 0.1; done; touch done.txt; echo done"
            (job / "cfg.yaml").write_text(
                "tasks: tasks.jsonl\nout: s3://runs/cluster\nrun_id: mp\n"
                f"sandbox: {sandbox_yaml(root / 'sandboxes', gate)}\n"
                f"harness: {{name: command, command: {json.dumps(agent)}}}\n"
                "concurrency: {workers: 2, sessions_per_worker: 2, worker_resources: {sandbox_slot: 1}}\n"
                "policy: {rules: {sandbox_lost: {retry: true, max_attempts: 3, backoff_base_s: 0.1}}}\n"
            )
            run = [sys.executable, "-m", "executor.cli", "run", "cfg.yaml", "--no-preflight"]
            submit = subprocess.Popen(
                [str(RAY), "job", "submit", "--address", dashboard, "--working-dir", str(job), "--", *run],
                stdout=(logs / "submit.log").open("wb"),
                stderr=subprocess.STDOUT,
                env=base_env,
                start_new_session=True,
            )
            procs.append(submit)
            markers[submit.pid] = job
            sandboxes = str(root / "sandboxes")
            # Mid-run for certain: all four sessions (two per worker actor) are inside the agent.
            _wait("four sessions mid-run", lambda: _gated_sessions(sandboxes) >= 4, procs, logs)
            victim, workers = next((n, w) for n in nodes if (w := _worker_pids(dashboard, n)))
            raylet = _raylet_pid(nodes[victim])
            assert raylet is not None
            os.kill(raylet, signal.SIGKILL)
            procs.remove(starts[victim])  # its `ray start --block` ends with its raylet
            # Its worker process ends with it; only then may the agents go on, so those sessions never end.
            _wait("the killed node's worker to end", lambda: not any(_alive(p) for p in workers), procs, logs)
            gate.touch()
            submit.wait(timeout=BOUND_S)
            said = (logs / "submit.log").read_text()
            assert submit.returncode == 0, said[-4000:]

            rows = read_table("s3://runs/cluster/mp").to_pylist()
            finals = [(r["task_id"], r["sample_index"]) for r in rows if r["final"]]
            assert sorted(finals) == [(f"t{i}", 0) for i in range(N_TASKS)], rows  # each exactly once
            lost = [r for r in rows if r["failure_kind"] == "sandbox_lost"]
            assert lost and all(not r["final"] for r in lost), "no session of the killed node ran again"
            keys = set(s3.keys("runs"))
            for r in rows:
                if r["status"] == "completed":
                    prefix = r["evidence_dir"].removeprefix("s3://runs/") + "/"
                    assert {prefix + "harness.stdout.gz", prefix + "model/attempts.jsonl"} <= keys, r
                    assert r["reward"] == 1.0
            survivor = root / f"scratch-{'b' if victim == 'a' else 'a'}"
            left = list(survivor.glob("rollout-evidence/mp/scratch/*/evidence-*"))
            assert not left, f"evidence left on a node's disk: {left}"
            assert not _gated_sessions(sandboxes), processes_under(sandboxes)
        finally:
            # Each process ended with its own node's dir as the marker, the workers before the head: with
            # the whole root as the marker, ending the head waited out _end's bound on the surviving
            # node's processes, which only their own `ray start` ends.
            for proc in reversed(procs):
                if proc.poll() is None:
                    _end(proc, str(markers.get(proc.pid, root)))
            for leftover in processes_under(str(root)):
                os.kill(int(leftover.split(":", 1)[0]), signal.SIGKILL)
            shutil.rmtree(root, ignore_errors=True)


def _worker_pids(dashboard: str, node: str) -> list[int]:
    """The pids of the SandboxWorker actors alive on the node that advertises ``node_<node>``."""
    from ray.util.state import list_actors, list_nodes

    ids = {n.node_id for n in list_nodes(address=dashboard) if f"node_{node}" in (n.resources_total or {})}
    actors = list_actors(address=dashboard, filters=[("state", "=", "ALIVE")])
    return [a.pid for a in actors if a.node_id in ids and a.class_name == "SandboxWorker" and a.pid]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"

"""Network isolation of local sandboxes: a loopback-only namespace per command, the gateway reached
through its Unix socket. Never probes an outside address: it only lists the namespace's interfaces."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from executor.store import read_table
from harnesses.gateway import Gateway
from harnesses.testing.scripted_model import ScriptedModel
from sandboxes import netns
from sandboxes.base import SandboxLostError, SandboxSpec
from sandboxes.local import LocalSandboxProvider
from sandboxes.proctree import read_proc, snapshot
from tests.conftest import processes_under
from tests.test_local_sandbox import Fifo


def _unavailable() -> str | None:
    try:
        netns.check_available()
    except netns.IsolationUnavailable as exc:
        return str(exc)
    return None


pytestmark = pytest.mark.skipif(_unavailable() is not None, reason=str(_unavailable()))


@asynccontextmanager
async def _isolated(tmp_path: Path, **layers: Any) -> AsyncIterator[tuple[Any, Gateway]]:
    scripted = ScriptedModel()
    await scripted.start()
    gateway = Gateway(scripted.base_url, None)
    await gateway.start(unix_path=str(tmp_path / "gw.sock"))
    forward = (urlsplit(gateway.url).port or 0, str(tmp_path / "gw.sock"))
    provider = LocalSandboxProvider(tmp_path / "sandboxes", network_forward=forward, **layers)
    sandbox = await provider.start(SandboxSpec(run_id="r", session_id="s", ttl_s=120))
    try:
        yield sandbox, gateway
    finally:
        await sandbox.stop()
        await gateway.stop()
        await scripted.stop()


async def test_the_namespace_has_only_loopback(tmp_path):
    async with _isolated(tmp_path) as (sandbox, _gateway):
        names = await sandbox.exec(
            [sys.executable, "-c", "import socket; print([n for _, n in socket.if_nameindex()])"], timeout=30
        )
        devices = await sandbox.exec(["cat", "/proc/net/dev"], timeout=30)
    assert names.exit_code == 0, names.stderr_tail
    assert names.stdout_tail.strip() == "['lo']"
    listed = [line.split(":")[0].strip() for line in devices.stdout_tail.splitlines()[2:] if ":" in line]
    assert listed == ["lo"]


HOLD = """
import socket, sys
conn = socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=20)
with open(sys.argv[2], "w") as report:
    report.write("connected\\n")
conn.recv(1)  # until the relay's end of it closes
"""
WAIT = """
import sys
with open(sys.argv[1], "w") as report:
    report.write("waiting\\n")
open(sys.argv[2]).readline()
"""


async def test_the_server_is_its_namespaces_init_and_no_supervisor_holds_a_relayed_connection(tmp_path):
    """With a view from the base mount namespace (root's), the sandbox's supervisor server is its PID
    namespace's init and runs the relay itself (namespaces.ServerInit): no process of its own besides,
    the supervisors' host pids reported, and none of the relay's sockets (a connection it holds as a
    supervisor is forked) left in a supervisor, where it would outlive the relay's close of it."""
    async with _isolated(tmp_path, pids="isolated", filesystem="readonly") as (sandbox, gateway):
        server = sandbox._server.pid
        nspid = [
            line.split()[1:]
            for line in Path(f"/proc/{server}/status").read_text().splitlines()
            if line.startswith("NSpid:")
        ]
        assert nspid == [[str(server), "1"]]
        report, go = Fifo(Path(sandbox.workdir) / "report"), Fifo(Path(sandbox.workdir) / "go")
        port = str(urlsplit(gateway.url).port)
        holder = asyncio.ensure_future(sandbox.exec([sys.executable, "-c", HOLD, port, "report"], timeout=60))
        waiter = None
        try:
            assert await report.lines(1) == ["connected"]
            waiter = asyncio.ensure_future(
                sandbox.exec([sys.executable, "-c", WAIT, "report", "go"], timeout=60)
            )
            assert await report.lines(1) == ["waiting"]
            running = [proc.pid for proc in sandbox._running.values()]
            assert len(running) == 2
            assert {read_proc(pid).ppid for pid in running} == {server}
            children = {pid for pid, info in snapshot().items() if info.ppid == server}
            assert children == set(running)  # no init of the namespace beside them
            # The first command, alone in the sandbox at its start, is the server's own (folded.py); the
            # second, started beside it, has a supervisor.
            supervisors = [pid for pid in running if read_proc(pid).name == b"rollout-sup"]
            assert len(supervisors) == 1
            for pid in supervisors:
                held = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
                assert not [name for name in held if name.startswith("socket:")], held
            os.write(go._w, b"go\n")
            assert (await waiter).exit_code == 0
        finally:
            for task in (holder, waiter):
                if task is not None and not task.done():
                    task.cancel()
            report.close()
            go.close()


FETCH = """
import sys, urllib.request
with urllib.request.urlopen(sys.argv[1] + "/models", timeout=20) as answer:
    print(answer.status, answer.read().decode())
"""


LISTEN = """
import os, socket, sys
listener = socket.create_server(("127.0.0.1", int(sys.argv[1])))
with open(sys.argv[2], "w") as report:
    report.write(os.readlink("/proc/self/ns/net") + "\\n")
listener.accept()  # until the sandbox stops
"""
PROBE = """
import os, socket, sys
for port in sys.argv[1:]:
    try:
        socket.create_connection(("127.0.0.1", int(port)), timeout=10).close()
        print(port, "open")
    except ConnectionRefusedError:
        print(port, "refused")
print(os.readlink("/proc/self/ns/net"))
"""


async def test_an_ended_sandboxs_network_namespace_serves_a_later_one_with_nothing_of_it_left(tmp_path):
    """The fork server hands an ended sandbox's network namespace (its PID namespace emptied) to a later
    sandbox rather than making one: a port the first one's command listened on is closed there, the
    gateway's port open; two sandboxes alive at once never share one."""
    async with _isolated(tmp_path, pids="isolated", filesystem="readonly", user=True) as (first, gateway):
        provider = first._provider
        gateway_port = str(urlsplit(gateway.url).port)
        report = Fifo(Path(first.workdir) / "report")
        report.path.chmod(0o666)  # for the sandbox's own uid
        listening = asyncio.ensure_future(
            first.exec([sys.executable, "-c", LISTEN, "4242", "report"], timeout=60)
        )
        try:
            [first_ns] = await report.lines(1)
            second = await provider.start(SandboxSpec(run_id="r", session_id="s2", ttl_s=120))
            beside = await second.exec([sys.executable, "-c", PROBE, "4242", gateway_port], timeout=30)
            assert beside.stdout_tail.split("\n")[:2] == ["4242 refused", f"{gateway_port} open"]
            assert beside.stdout_tail.split("\n")[2] != first_ns
            await first.stop()
            with pytest.raises(SandboxLostError):  # its command was running
                await listening
            # The provider may hold one spare server, forked before the first ended: the next but one
            # sandbox's server is forked after.
            later = []
            for name in ("s3", "s4"):
                sandbox = await provider.start(SandboxSpec(run_id="r", session_id=name, ttl_s=120))
                probe = await sandbox.exec([sys.executable, "-c", PROBE, "4242", gateway_port], timeout=30)
                later.append(probe.stdout_tail.split("\n")[:3])
                await sandbox.stop()
            await second.stop()
        finally:
            report.close()
            if not listening.done():
                listening.cancel()
    assert [lines[:2] for lines in later] == [["4242 refused", f"{gateway_port} open"]] * 2
    assert first_ns in [lines[2] for lines in later]


SPOIL = """
import os
ports = "/proc/sys/net/ipv4/ip_local_port_range"
with open(ports) as f:
    print(" ".join(f.read().split()))
with open(ports, "w") as f:
    f.write("40000 40000")  # one local port for every connection made here from now on
print(os.readlink("/proc/self/ns/net"))
"""
LOOK = """
import os
with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
    print(" ".join(f.read().split()))
print(os.readlink("/proc/self/ns/net"))
"""


async def test_a_sandbox_whose_commands_run_as_root_hands_no_network_namespace_on(tmp_path):
    """Root in a sandbox can change its network namespace (here: its local port range, down to one
    port): with no uid of its own, an ended sandbox's namespace is given to no other sandbox."""
    async with _isolated(tmp_path, pids="isolated", filesystem="readonly") as (first, _gateway):
        provider = first._provider
        spoiled = await first.exec([sys.executable, "-c", SPOIL], timeout=30)
        assert spoiled.exit_code == 0, spoiled.stderr_tail
        await first.stop()
        later = []
        for name in ("s2", "s3"):
            sandbox = await provider.start(SandboxSpec(run_id="r", session_id=name, ttl_s=120))
            later.append(
                (await sandbox.exec([sys.executable, "-c", LOOK], timeout=30)).stdout_tail.split("\n")[:2]
            )
            await sandbox.stop()
    default, first_ns = spoiled.stdout_tail.split("\n")[:2]
    assert [ports for ports, _ns in later] == [default] * 2
    assert first_ns not in [ns for _ports, ns in later]


async def test_the_gateway_is_reached_through_its_unix_socket(tmp_path):
    async with _isolated(tmp_path) as (sandbox, gateway):
        session = gateway.open_session("s1", tmp_path / "evidence")
        fetched = await sandbox.exec([sys.executable, "-c", FETCH, session.base_url], timeout=30)
        attempts, probes = list(session.attempts), session.summary()["probes"]
    assert fetched.exit_code == 0, fetched.stderr_tail
    status, body = fetched.stdout_tail.split(" ", 1)
    assert status == "200" and json.loads(body)["data"][0]["id"] == "scripted-model"
    assert attempts == [] and probes == 1  # a model listing reached the endpoint, and is no model call


async def test_exit_codes_signals_and_timeouts_pass_through(tmp_path):
    async with _isolated(tmp_path) as (sandbox, _gateway):
        seven = await sandbox.exec(["sh", "-c", "exit 7"], timeout=30)
        killed = await sandbox.exec(["sh", "-c", "kill -9 $$"], timeout=30)
        slow = await sandbox.exec(["sh", "-c", "sleep 600"], timeout=1)
        assert not processes_under(str(tmp_path / "sandboxes"))
    assert (seven.exit_code, seven.signal) == (7, None)
    assert (killed.exit_code, killed.signal) == (None, 9)
    assert slow.timed_out and slow.exit_code is None


# The harness's own tool call lists the interfaces it can see; the verifier passes only on "lo" alone.
LIST_INTERFACES = {
    "id": "interfaces",
    "prompt": "Write the network interfaces you can see into net.txt",
    "model_script": [
        {"type": "shell", "command": "cat /proc/net/dev > net.txt"},
        {"type": "text", "text": "Listed them in net.txt."},
    ],
    "verify": "test \"$(grep -c : net.txt)\" = 1 && grep -q 'lo:' net.txt",
}


@pytest.mark.integration
@pytest.mark.usefixtures("codex_installed")
def test_a_run_with_isolated_sandboxes(tmp_path):
    """`sandbox: {network: isolated}` through the whole path: driver, Ray worker, gateway socket, Codex."""
    (tmp_path / "tasks.jsonl").write_text(json.dumps(LIST_INTERFACES) + "\n")
    (tmp_path / "run.yaml").write_text(
        f"tasks: tasks.jsonl\nout: out\nsandbox: {{root: {tmp_path / 'sandboxes'}, network: isolated}}\n"
        "limits: {deadline_s: 120, grace_s: 2}\nconcurrency: {workers: 1, sessions_per_worker: 1}\n"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "executor.cli", "run", str(tmp_path / "run.yaml")],
        cwd=Path(__file__).parents[1],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, RAY_TMPDIR="/tmp/rollout-ray-tests"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = read_table(tmp_path / "out" / "run").to_pylist()
    assert (row["status"], row["reward"]) == ("completed", 1.0), row["error_message"]
    assert not processes_under(str(tmp_path / "sandboxes"))

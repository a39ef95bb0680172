"""A container sandbox's root commands against the agent beside them (sandboxes/nest.py), as a policy
would try them: each attack is an exec of a real container's agent, which must come back as that
command's own result (graded), never as the sandbox lost, and leave the next exec working. And a root
command stays root for what it does in its container: files of any owner, another user, a low port."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandboxes.container import ROOT_IN
from sandboxes.testing.images import podman_usable
from tests import test_container

# The container tests' fixtures: a provider on the test image, a sandbox of it.
provider, sandbox = test_container.provider, test_container.sandbox
GATEWAY_PORT = 4999  # where the provider's forwarder serves the gateway in the container


@pytest.fixture
def gateway_socket(tmp_path: Path) -> Iterator[str]:
    """A stand-in for the gateway's socket that answers each connection with a line and holds it open
    until the test ends: a command that reads the line knows its connection is being relayed."""
    path = str(tmp_path / "gw.sock")
    held: list[socket.socket] = []
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(path)
        listener.listen()

        def answer() -> None:
            while True:
                try:
                    conn, _ = listener.accept()
                    conn.sendall(b"HTTP/1.1 204 No Content\r\n\r\n")
                except OSError:  # the listener closed: the test is over
                    return
                held.append(conn)

        threading.Thread(target=answer, daemon=True).start()
        yield path
        listener.shutdown(socket.SHUT_RDWR)
    for conn in held:
        conn.close()


pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(podman_usable() is not None, reason=str(podman_usable())),
]

# A root command's raise of every process's OOM score, by number: a thread's /proc/TID is not listed.
RAISE_EVERY_SCORE = """for p in range(1, 3001):
    try:
        with open(f"/proc/{p}/oom_score_adj", "w") as f:
            f.write("1000")
    except OSError:
        pass
"""


def oom_scores_seen_from_outside(sandbox) -> list[str]:
    """Every OOM score in the sandbox's container, read with the engine's exec (no command of ours)."""
    container = sandbox.descriptor()["container"]
    scores = "cat /proc/[0-9]*/oom_score_adj | sort -u"
    seen = subprocess.run(
        ["podman", "exec", container, "sh", "-c", scores], capture_output=True, text=True, timeout=60
    )
    return seen.stdout.split()


# Each reaches for what runs the commands, or for what the agent keeps: its last line says how far it
# got, so that a test of an attack that silently did nothing fails.
ATTACKS = {
    "kill its parent": "kill -9 $PPID; kill -TERM $PPID; echo parent-signalled",
    "kill every process it can": "kill -9 -1; kill -TERM -1; echo all-signalled",
    "signal its process group": "trap '' TERM; kill -TERM 0; echo group-signalled",
    "signal the agent, pid 1": "kill -TERM 1; kill -INT 1; kill -9 1; echo pid1-signalled",
    "signal every pid by number": (
        "for p in $(seq 2 400); do [ $p = $$ ] || kill -9 $p 2>/dev/null; done; echo numbers-signalled"
    ),
    "read the agent's token and drive it": (
        f"cat {ROOT_IN}/control/token || echo no-token;"
        f" find {ROOT_IN}/control {ROOT_IN}/run {ROOT_IN}/logs -mindepth 1 | wc -l; echo token-tried"
    ),
    "reach the agent's files through /proc": (
        "for p in /proc/[0-9]*; do cat $p/root/rollout/control/token $p/environ 2>/dev/null; done;"
        " echo proc-tried"
    ),
    "break the result files": (
        f"rm -rf {ROOT_IN}/run/* {ROOT_IN}/logs/* 2>/dev/null; mv {ROOT_IN}/run {ROOT_IN}/x 2>/dev/null;"
        " echo results-tried"
    ),
    "make the agent the OOM killer's choice": (  # by number: a thread's /proc/TID is not listed
        "for p in $(seq 1 3000); do echo 1000 2>/dev/null > /proc/$p/oom_score_adj; done; echo oom-tried"
    ),
    "make the agent the OOM killer's choice through its relay's threads": (  # ones made after it began
        "python3 - <<'END'\n"
        "import socket\n"
        f"held = [socket.create_connection(('127.0.0.1', {GATEWAY_PORT}), timeout=30) for _ in range(2)]\n"
        "assert all(s.recv(1) for s in held)  # the gateway's first byte came back: each is relayed\n"
        + RAISE_EVERY_SCORE
        + "END\n"
        "echo relayed-oom-tried"
    ),
    "shrink the limits of every process it can": (  # an agent left with 3 descriptors fails
        "for p in $(seq 1 400); do [ $p = $$ ] || prlimit --pid $p --nofile=3:3 --as=20000000:20000000;"
        " done 2>/dev/null; ulimit -n 512 && echo limits-tried"
    ),
    "undo the covers": (
        f"umount {ROOT_IN}/run 2>/dev/null; unshare -U -r -m sh -c 'umount {ROOT_IN}/run; ls {ROOT_IN}/run'"
        " 2>/dev/null | wc -l; echo covers-tried"
    ),
}


@pytest.mark.parametrize("attack", ATTACKS)
async def test_a_root_command_cannot_end_its_exec_as_the_sandbox_lost(sandbox, attack):
    assert sandbox.isolation_label == "nested", sandbox.isolation_label
    script = ATTACKS[attack]
    res = await sandbox.exec(["sh", "-c", script], timeout=60)
    # Its own result: it ran to its last line (or was ended by what it did to itself), nothing of the
    # agent's was read, and the agent still serves the next command.
    last = script.rsplit("echo ", 1)[1]
    assert last in res.stdout_tail, (res.exit_code, res.signal, res.stdout_tail, res.stderr_tail)
    assert sandbox._token not in res.stdout_tail
    if "token" in attack:
        assert res.stdout_tail == "no-token\n0\ntoken-tried\n"
    if "covers" in attack:
        assert res.stdout_tail == "0\ncovers-tried\n"
    if "OOM" in attack:  # seen from outside: every process of ours as the OOM killer had it
        assert oom_scores_seen_from_outside(sandbox) == ["0"]
    follow = await sandbox.exec(["sh", "-c", "echo still-here"], timeout=60)
    assert (follow.exit_code, follow.stdout_tail) == (0, "still-here\n")


RAISE_WHEN_TOLD = f"""
import os, time
open("{ROOT_IN}/work/started", "w").close()
deadline = time.monotonic() + 50
while not os.path.exists("{ROOT_IN}/work/go") and time.monotonic() < deadline:  # the worker has spoken
    time.sleep(0.01)
{RAISE_EVERY_SCORE}print(os.path.exists("{ROOT_IN}/work/go"))
"""


def _until(path: Path, bound_s: float = 50.0) -> bool:
    deadline = time.monotonic() + bound_s
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    return path.exists()


async def test_a_connection_the_worker_opens_during_a_root_command_meets_no_thread_it_can_raise(sandbox):
    """The agent serves a connection opened while a command runs (the worker's stop, a probe) with a
    thread it had before the command began: a thread started for it would have a /proc/TID/oom_score_adj
    of its own, unsealed, and a thread's is its whole process's."""
    work = Path(sandbox.host_workdir)
    raising = asyncio.ensure_future(sandbox.exec(["python3", "-c", RAISE_WHEN_TOLD], timeout=60))
    assert await asyncio.to_thread(_until, work / "started")
    control = os.open(work.parent / "control", os.O_PATH)
    with socket.socket(socket.AF_UNIX) as conn:
        conn.settimeout(30)
        conn.connect(f"/proc/self/fd/{control}/agent.sock")
        # As the worker's client asks: its connection kept open, and its thread with it.
        request = f"GET /health HTTP/1.1\r\nHost: agent\r\nAuthorization: Bearer {sandbox._token}\r\n\r\n"
        conn.sendall(request.encode())
        assert conn.recv(15) == b"HTTP/1.1 200 OK"
        (work / "go").touch()
        res = await raising
    os.close(control)
    assert (res.exit_code, res.stdout_tail) == (0, "True\n"), res
    assert oom_scores_seen_from_outside(sandbox) == ["0"]


async def test_a_root_command_that_kills_its_own_group_is_its_own_death(sandbox):
    res = await sandbox.exec(["sh", "-c", "kill -9 0; echo survived"], timeout=60)
    assert (res.exit_code, res.signal, res.stdout_tail) == (None, 9, "")
    follow = await sandbox.exec(["sh", "-c", "echo still-here"], timeout=60)
    assert (follow.exit_code, follow.stdout_tail) == (0, "still-here\n")


async def test_what_a_root_command_leaves_behind_ends_with_its_exec(sandbox):
    res = await sandbox.exec(["sh", "-c", "(setsid sleep 300 &); echo started"], timeout=60)
    assert (res.exit_code, res.stdout_tail) == (0, "started\n")
    ps = await sandbox.exec(["sh", "-c", "cat /proc/[0-9]*/comm 2>/dev/null"], timeout=60)
    assert "sleep" not in ps.stdout_tail.split(), ps.stdout_tail


# What pkill does: find a process by its command line in /proc, signal the pid found there.
PKILL = """
import os, signal, subprocess, time
assert os.readlink("/proc/self") == str(os.getpid()) and os.path.exists(f"/proc/{os.getpid()}/stat")
sleeper = subprocess.Popen(["sleep", "234"])
def cmdline(pid):
    try:  # as pkill: a process it cannot read (gone, or not its to see) is not the one
        return open(f"/proc/{pid}/cmdline", "rb").read()
    except OSError:
        return b""
wanted = b"sleep\\x00234\\x00"
# Popen returns once the exec has begun; the new program's arguments are in place a moment later.
for _ in range(5000):
    if cmdline(sleeper.pid) == wanted:
        break
    time.sleep(0.001)
found = [int(p) for p in os.listdir("/proc") if p.isdigit() and cmdline(p) == wanted]
os.kill(found[0], signal.SIGTERM)
print(found == [sleeper.pid], sleeper.wait(10))
"""


async def test_a_root_command_sees_itself_in_proc_and_pkill_finds_its_own(sandbox):
    """No PID namespace of its own: the /proc it sees is its own pids' (what a fresh one would be where
    the engine's masked paths allow none), so ``/proc/$$`` and ``pkill`` mean what they say."""
    res = await sandbox.exec(["python3", "-c", PKILL], timeout=60)
    assert (res.exit_code, res.stdout_tail) == (0, "True -15\n"), res.stderr_tail


async def test_a_nested_root_command_is_still_root_in_its_container(sandbox):
    script = (
        "set -e; cd /tmp; touch f; chown 1234:4321 f; stat -c '%u:%g' f;"
        " setpriv --reuid 65534 --regid 65534 --clear-groups id -u;"
        " echo x >> /etc/passwd-probe; rm /etc/passwd-probe;"
        ' python3 -c \'import socket; s = socket.socket(); s.bind(("127.0.0.1", 80)); print("port-80")\''
    )
    res = await sandbox.exec(["sh", "-c", script], timeout=60)
    assert (res.exit_code, res.stdout_tail) == (0, "1234:4321\n65534\nport-80\n"), res.stderr_tail


# What a policy would run in its harness's shell to be masked rather than graded: every reach at once.
# The shell outlives it (a signal to the namespace's pid 1 is passed on to the command, the harness),
# so that the command harness, which never calls the model, finishes and its row is graded too.
REACH_ALL = (
    "trap '' TERM INT; kill -TERM 1; kill -INT 1; cat /rollout/control/token; rm -rf /rollout/run/*"
    " /rollout/logs/*; for p in $(seq 2 400); do [ $p = $$ ] || { prlimit --pid $p --nofile=3:3;"
    " kill -9 $p; } done 2>/dev/null; kill -9 -1; echo done"
)


@pytest.mark.parametrize("harness_kind", ["command", "codex"])
async def test_a_rollout_whose_commands_reach_for_the_agent_is_graded(
    tmp_path, test_images, codex_installed, harness_kind
):
    """Through the real harness path: the command harness runs the reach as its command, Codex as a shell
    step of the scripted model's. Either way the row is the agent's own failure, graded (reward 0,
    accepted), never the sandbox lost (retried, then masked)."""
    from executor.session import SessionRequest, run_session
    from harnesses.command import CommandHarness
    from tests.conftest import session_context
    from tests.test_container import HOST_ARGS
    from tests.test_reward_integrity import _decision, _task

    steps = [{"type": "shell", "command": REACH_ALL}, {"type": "text", "text": "done"}]
    task = _task(steps if harness_kind == "codex" else None, image=test_images.base)
    harness = CommandHarness(command=REACH_ALL) if harness_kind == "command" else None
    section = {"provider": "container", "root": str(tmp_path / "sandboxes"), **HOST_ARGS}
    async with session_context(tmp_path, {"sandbox": section}, harness=harness) as ctx:
        row = await run_session(SessionRequest("reach", task, 0, 1), ctx)
    assert row["failure_kind"] != "sandbox_lost", (row["failure_kind"], row["error_message"])
    assert (row["verified"], row["reward"]) == (True, 0.0), (row["failure_kind"], row["error_message"])
    assert _decision(row) == "accept"
    assert row["sandbox_isolation"] == "nested"

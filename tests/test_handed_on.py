"""An ended sandbox's supervisor server serves a later sandbox (LocalSandboxProvider.keep_server): its
PID namespace emptied, its caps and network namespace kept, nothing of the ended sandbox's left for the
next one to meet, whatever it did to stay: a daemon in a session of its own named as the executor's
processes are, files in its view's /tmp and /dev/shm, a shared memory segment, its model client pinned
at the gateway's relay. Real sandboxes, as root with a uid of their own; skipped where they cannot be
made."""

from __future__ import annotations

import asyncio
import os
import socket
import sys
import textwrap
from pathlib import Path

import pytest

from sandboxes import isolation, pidlimit, uidpool
from sandboxes.base import SandboxError, SandboxLostError, SandboxSpec
from sandboxes.local import LocalSandboxProvider
from sandboxes.local_sandbox import LocalSandbox
from sandboxes.proctree import descendants, has_env_entry, snapshot
from sandboxes.testing.leaks import ended
from tests.test_local_sandbox import Fifo
from tests.test_netns import _isolated
from tests.test_shared_view import _provider

pytestmark = pytest.mark.skipif(
    isolation.mounts_unavailable() is not None or uidpool.pool_unavailable() is not None,
    reason=f"no root view, or no uid pool: {isolation.mounts_unavailable() or uidpool.pool_unavailable()}",
)

# What the first sandbox leaves as it is stopped: a daemon in a session of its own that ignores SIGTERM
# and is named as the executor's supervisors are, files in the view's /tmp and /dev/shm, a shared memory
# segment; then it says so and waits to be stopped.
STAY = """echo a > /tmp/left && echo a > /dev/shm/left && ipcmk -M 4096 >/dev/null
setsid sh -c 'printf rollout-sup > /proc/self/comm; trap "" TERM; touch hid; while :; do sleep 1; done' &
until [ -e hid ]; do sleep 0.01; done
echo staying > report
sleep 1000
"""
# What the next sandbox sees: every process of its PID namespace by name, what was left in its view.
LOOK = """for p in /proc/[0-9]*; do cat "$p/comm"; done | sort -u | tr '\\n' ' '; echo
echo "$(cat /tmp/left /dev/shm/left 2>/dev/null | wc -l) $(ipcs -m | grep -c 4096)"
"""


async def _start(provider: LocalSandboxProvider, name: str) -> LocalSandbox:
    return await provider.start(SandboxSpec(run_id="r", session_id=name, ttl_s=300))


async def test_an_ended_sandboxs_server_serves_the_next_with_nothing_of_the_first_left(tmp_path):
    provider = _provider(tmp_path)
    try:
        first = await _start(provider, "first")
        server, caps = first._server.pid, (first.pids_cgroup, first.memory_cgroup)
        report = Fifo(Path(first.workdir) / "report")
        report.path.chmod(0o666)  # for the sandbox's own uid
        staying = asyncio.ensure_future(first.exec(["sh", "-c", STAY], timeout=120))
        try:
            assert await report.lines(1) == ["staying"]
            left = descendants(snapshot(), server)
            assert len(left) >= 3, left  # the command, its sleep, the daemon (and its sleep)
            await first.stop()
        finally:
            report.close()
        with pytest.raises(SandboxLostError):  # its command was running
            await staying
        assert all(ended(pid, 10) for pid in left), left

        second = await _start(provider, "second")
        assert second._server.pid == server  # handed on, with its caps, under a marker of its own
        assert second._marker_token != first._marker_token and has_env_entry(server, second._marker)
        assert (second.pids_cgroup, second.memory_cgroup) == caps
        looked = await second.exec(["sh", "-c", LOOK], timeout=60)
        await second.stop()
    finally:
        await provider.aclose()
    names, kept = looked.stdout_tail.splitlines()
    # The namespace's own init (the server), the command and its pipeline: nothing of the first sandbox's.
    assert "rollout-server" in names.split() and set(names.split()) <= {
        "rollout-server",
        "sh",
        "cat",
        "sort",
        "tr",
    }, names
    assert kept == "0 0", looked  # no line of the files left in /tmp and /dev/shm, no segment
    assert ended(server, 10)  # the provider's close ends the servers it kept


ASK = textwrap.dedent(
    """\
    import json, sys, urllib.error, urllib.request
    req = urllib.request.Request(
        sys.argv[1] + "/chat/completions",
        data=json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode(),
        headers={"Authorization": "Bearer " + sys.argv[2], "Content-Type": "application/json"},
    )
    try:
        urllib.request.urlopen(req, timeout=60).read()
        print("answered")
    except urllib.error.HTTPError as exc:
        print("refused", exc.code, exc.read().decode()[:200])
    """
)


async def test_the_next_sandboxs_model_client_is_its_own_not_the_ended_ones(tmp_path):
    """The gateway's relay pins the sandbox's first model client, and refuses a model call from any
    other process of it (sandboxes/netns.py): the next sandbox on the same server pins its own."""
    async with _isolated(tmp_path, pids="isolated", filesystem="readonly", user=True) as (first, gateway):
        provider = first._provider
        server = first._server.pid
        answers = []
        sandboxes = [first]
        for name in ("first", "second", "third"):
            sandbox = sandboxes[-1] if name == "first" else await _start(provider, name)
            sandboxes.append(sandbox)
            session = gateway.open_session(name, tmp_path / name, one_client=True)
            asked = await sandbox.exec(
                [sys.executable, "-c", ASK, session.base_url, session.token], timeout=60
            )
            answers.append((sandbox._server.pid, asked.stdout_tail.strip(), session.summary()))
            await sandbox.stop()
        await provider.aclose()
    assert [pid for pid, _answer, _summary in answers] == [server] * 3
    assert [answer for _pid, answer, _summary in answers] == ["answered"] * 3, answers
    assert [summary["not_the_harness"] for _pid, _answer, summary in answers] == [0] * 3


# The sandbox's model client: asks, and waits for an answer that never comes.
CONNECT = """
import socket, sys
conn = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
conn.sendall(b"GET / HTTP/1.1\\r\\n\\r\\n")
conn.recv(1)
"""


async def test_a_server_whose_relay_still_carries_a_connection_of_the_ended_sandbox_ends_instead(tmp_path):
    """The gateway relay's connections are bounded per server (netns.py): one of the ended sandbox's still
    in flight (here its upstream neither answers nor closes) is not the next sandbox's to inherit, so the
    server ends rather than serve it, and the next sandbox gets another."""
    gateway = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # a stalled upstream
    gateway.bind(str(tmp_path / "gw.sock"))
    gateway.listen()
    gateway.settimeout(60)
    provider = LocalSandboxProvider(
        tmp_path / "sandboxes",
        kill_grace_s=0.5,
        keep=False,
        network_forward=(8, str(tmp_path / "gw.sock")),
        pids="isolated",
        filesystem="readonly",
        user=True,
    )
    held: list[socket.socket] = []
    try:
        first = await _start(provider, "first")
        server = first._server.pid
        asking = asyncio.ensure_future(first.exec([sys.executable, "-c", CONNECT, "8"], timeout=60))
        upstream, _addr = await asyncio.to_thread(gateway.accept)  # relayed: held open, never answered
        held.append(upstream)
        await first.stop()
        with pytest.raises(SandboxLostError):  # its command was waiting
            await asking
        assert ended(server, 10)
        second = await _start(provider, "second")
        assert second._server.pid != server
        asking = asyncio.ensure_future(second.exec([sys.executable, "-c", CONNECT, "8"], timeout=60))
        upstream, _addr = await asyncio.to_thread(gateway.accept)  # the new server relays too
        held.append(upstream)
        await second.stop()
        with pytest.raises(SandboxLostError):
            await asking
    finally:
        await provider.aclose()
        for conn in held:
            conn.close()
        gateway.close()


def _capped(tmp_path: Path) -> LocalSandboxProvider:
    """``_provider``'s sandboxes with a process and a memory cap, where the host has the cgroups."""
    return _provider(
        tmp_path,
        max_processes=64 if pidlimit.unavailable(pidlimit.PIDS) is None else None,
        max_memory_mb=512 if pidlimit.unavailable(pidlimit.MEMORY) is None else None,
    )


def _members(groups: list[str]) -> list[str]:
    """The processes still in ``groups`` (cgroup.procs files) that exist."""
    return [pid for group in groups if os.path.exists(group) for pid in Path(group).read_text().split()]


async def test_an_agents_ended_sandbox_hands_its_server_to_the_grading_one_and_keeps_its_caps(tmp_path):
    """Once its harness has ended (``end_commands``), an agent's sandbox runs nothing more, and its server
    serves the next sandbox (the grading one), under that one's marker and in caps of that one's own:
    the agent's caps stay with the agent's files, which count toward them and stay readable until its
    stop, which then leaves the caps empty or gone."""
    provider = _capped(tmp_path)
    try:
        agent = await _start(provider, "agent")
        server = agent._server.pid
        caps = [group for group in (agent.pids_cgroup, agent.memory_cgroup) if group]
        wrote = await agent.exec(["sh", "-c", "echo mine > note; echo $$"], timeout=60)
        assert wrote.exit_code == 0, wrote
        await agent.end_commands()
        with pytest.raises(SandboxError, match="commands have ended"):
            await agent.exec(["true"], timeout=30)
        assert await agent.read_file("note", 100) == b"mine\n"

        grading = await _start(provider, "grading")
        assert grading._server.pid == server
        assert grading._marker_token != agent._marker_token and has_env_entry(server, grading._marker)
        assert not has_env_entry(server, agent._marker)
        theirs = [group for group in (grading.pids_cgroup, grading.memory_cgroup) if group]
        assert len(theirs) == len(caps) and not set(theirs) & set(caps)
        assert str(server) not in _members(caps)  # the server left the agent's caps for the grading's
        looked = await grading.exec(["sh", "-c", LOOK], timeout=60)
        await agent.stop()
        assert _members(caps) == []
        assert grading._server.pid == server
        assert (await grading.exec(["true"], timeout=30)).exit_code == 0
        await grading.stop()
    finally:
        await provider.aclose()
    names = looked.stdout_tail.splitlines()[0]
    assert set(names.split()) <= {"rollout-server", "sh", "cat", "sort", "tr"}, names
    assert ended(server, 10)


async def test_a_server_handed_on_early_that_no_sandbox_took_goes_on_with_the_caps_at_the_stop(tmp_path):
    """An agent's server handed on before its stop (``end_commands``) and not taken by then is still in
    the agent's caps: they go on with it, as with a server handed on at the stop, to the next sandbox."""
    provider = _capped(tmp_path)
    try:
        agent = await _start(provider, "agent")
        server = agent._server.pid
        caps = (agent.pids_cgroup, agent.memory_cgroup)
        await agent.exec(["true"], timeout=60)
        await agent.end_commands()
        await agent.stop()
        later = await _start(provider, "later")
        assert later._server.pid == server and (later.pids_cgroup, later.memory_cgroup) == caps
        assert (await later.exec(["sh", "-c", "echo $((1 + 1))"], timeout=30)).stdout_tail.strip() == "2"
        await later.stop()
    finally:
        await provider.aclose()


async def test_a_server_handed_on_early_then_taken_and_handed_on_again_is_not_the_firsts_again(tmp_path):
    """The agent's server, handed on early, serves a second sandbox, which hands it on early too: at the
    agent's stop it is kept again, but in the second's caps, not the agent's. The agent's stop frees its
    own caps (it does not take the server back as if in them), the second's stop takes it back with
    its own, and the next sandbox's caps are the ones its server is in; nothing is left at the close."""
    provider = _capped(tmp_path)
    made: list[str] = []
    try:
        agent = await _start(provider, "agent")
        server = agent._server.pid
        agent_caps = [group for group in (agent.pids_cgroup, agent.memory_cgroup) if group]
        await agent.exec(["true"], timeout=60)
        await agent.end_commands()
        second = await _start(provider, "second")
        assert second._server.pid == server
        second_caps = [group for group in (second.pids_cgroup, second.memory_cgroup) if group]
        assert second_caps and not set(second_caps) & set(agent_caps)
        await second.exec(["true"], timeout=60)
        await second.end_commands()
        await agent.stop()
        await second.stop()
        later = await _start(provider, "later")
        assert later._server.pid == server
        later_caps = [group for group in (later.pids_cgroup, later.memory_cgroup) if group]
        assert later_caps == second_caps and str(server) in _members(later_caps)
        await later.stop()
        made = [*agent_caps, *second_caps]
    finally:
        await provider.aclose()
    assert made and [group for group in made if os.path.exists(group)] == []

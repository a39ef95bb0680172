"""The in-sandbox agent as a real process, and the remote client the session code sees."""

from __future__ import annotations

import contextlib
import http.client
import io
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from sandboxes import identity, uidpool
from sandboxes.agent import DEFAULT_MAX_CONNECTIONS
from sandboxes.base import SandboxError, SandboxLostError, SandboxSpec, WorkspaceSpec
from sandboxes.remote import AGENT_PATH, RemoteSandbox, agent_files, agent_transport
from sandboxes.workspace import lay_out, workspace_diff
from tests.agent_process import AgentProcess, start_agent

TOKEN = "s3cret-token-for-tests"


@pytest.fixture
def agent(tmp_path):
    proc = start_agent(tmp_path / "sb", TOKEN, "--max-upload-bytes", "100000")
    yield proc
    proc.kill()


def _remote(agent: AgentProcess, *, token: str = TOKEN, ttl_s: float = 600) -> RemoteSandbox:
    async def teardown() -> None:
        agent.kill()

    async def probe() -> str | None:
        return None if agent.proc.poll() is None else f"agent exited {agent.proc.returncode}"

    return RemoteSandbox(
        sandbox_id="agent-test",
        provider_name="test",
        spec=SandboxSpec(run_id="r", session_id="s", ttl_s=ttl_s),
        base_url=agent.url,
        token=token,
        root=str(agent.root),
        teardown=teardown,
        probe=probe,
        marker_token=uuid.uuid4().hex,
    )


def _marked(marker: str) -> list[int]:
    entry = f"ROLLOUT_SANDBOX={marker}".encode()
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/environ", "rb") as f:
                    if entry in f.read().split(b"\0"):
                        found.append(int(name))
            except OSError:
                pass
    return found


def test_no_token_no_service(tmp_path):
    empty = tmp_path / "token"
    empty.write_text("")
    for args in ([], ["--token-file", str(empty)], ["--token-env", "ROLLOUT_TEST_UNSET_VAR"]):
        proc = subprocess.run(
            [sys.executable, str(AGENT_PATH), "--root", str(tmp_path / "sb"), *args],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert proc.returncode == 2, args
        assert "refusing to start" in proc.stderr


def test_missing_or_wrong_token_rejected(agent):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
        resp = httpx.get(f"{agent.url}/health", headers=headers, timeout=10)
        assert resp.status_code == 401
        resp = httpx.post(f"{agent.url}/exec", headers=headers, json={"argv": ["true"]}, timeout=10)
        assert resp.status_code == 401
    ok = httpx.get(f"{agent.url}/health", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
    assert ok.status_code == 200 and ok.json()["ok"] is True


async def test_wrong_token_through_the_client(agent):
    sandbox = _remote(agent, token="not-it")
    with pytest.raises(SandboxError, match="401"):
        await sandbox.exec(["true"], timeout=5)


async def test_paths_escaping_the_root_are_refused(agent, tmp_path):
    sandbox = _remote(agent)
    outside = tmp_path / "outside.txt"
    outside.write_text("secret")
    (agent.root / "work" / "link").symlink_to(tmp_path)
    for path in ("../../outside.txt", str(outside), "link/outside.txt", "/etc/passwd"):
        with pytest.raises(SandboxError, match="403"):
            await sandbox.read_file(path, 100)
        with pytest.raises(SandboxError, match="403"):
            await sandbox.write_file(path, b"x")
    assert outside.read_text() == "secret"
    with pytest.raises(SandboxError, match="403"):
        await sandbox.exec(["true"], timeout=5, cwd="/tmp")
    # A tar member climbing out, or a symlink pointing out, refuses the whole archive.
    for member in ("../escape.txt", "sym"):
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:") as tar:
            info = tarfile.TarInfo(member)
            if member == "sym":
                info.type, info.linkname = tarfile.SYMTYPE, "/etc"
                tar.addfile(info)
            else:
                info.size = 1
                tar.addfile(info, io.BytesIO(b"x"))
        resp = httpx.post(
            f"{agent.url}/untar",
            params={"dest": "."},
            content=buf.getvalue(),
            headers={"Authorization": f"Bearer {TOKEN}"},
            timeout=10,
        )
        assert resp.status_code == 403, resp.text
    assert not (agent.root / "escape.txt").exists() and not (agent.root / "work" / "sym").exists()


async def test_oversized_upload_is_refused(agent):
    sandbox = _remote(agent)
    with pytest.raises(SandboxError, match="413"):
        await sandbox.write_file("big.bin", b"x" * 100_001)
    assert not (agent.root / "work" / "big.bin").exists()
    await sandbox.write_file("ok.bin", b"x" * 100_000)  # the limit itself is allowed
    assert (await sandbox.health())["ok"]


async def test_exec_timeout_kills_the_group(agent):
    sandbox = _remote(agent)
    marker = sandbox.base_env["ROLLOUT_SANDBOX"]
    script = "sleep 300 & (setsid sleep 301 &) ; echo started; sleep 302"
    result = await sandbox.exec(["bash", "-c", script], timeout=1.0, name="slow")
    assert result.timed_out and result.exit_code is None
    assert "started" in result.stdout_tail
    assert _marked(marker) == []


async def test_exec_files_and_workspace_like_a_local_sandbox(agent, tmp_path):
    sandbox = _remote(agent)
    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    (src / "pkg" / "mod.py").write_text("x = 1\n")
    await lay_out(sandbox, WorkspaceSpec(files={"a.txt": "one\n"}, copy_from=str(src)))
    result = await sandbox.exec(
        ["bash", "-c", 'cat; echo "$GREETING from $(pwd)"; echo err >&2; exit 3'],
        timeout=30,
        env={"GREETING": "hi"},
        stdin=b"from stdin\n",
    )
    assert result.exit_code == 3 and not result.timed_out
    assert result.stdout_tail == f"from stdin\nhi from {sandbox.workdir}\n"
    assert result.stderr_tail == "err\n" and result.stderr_bytes == 4
    assert await sandbox.read_file(result.stdout_path, 4) == b"from"
    with pytest.raises(FileNotFoundError):
        await sandbox.read_file("missing.txt", 10)
    await sandbox.write_file("a.txt", b"two\n", 0o600)
    assert (agent.root / "work" / "a.txt").stat().st_mode & 0o777 == 0o600
    diff = await workspace_diff(sandbox)
    assert diff is not None and "-one" in diff and "+two" in diff and "pkg/mod.py" not in diff


@pytest.mark.parametrize("left_out", [None, "supervisor_server.py"])
async def test_the_agent_runs_from_the_files_a_sandbox_is_given(tmp_path, left_out):
    """Copied alone into a directory, as into a Slurm job's control directory or the ECS image, with
    nothing of the package importable: ``agent_files()`` is all the agent and its supervisor need. Its
    supervisor server is among them; without it (no server to be had) each command gets an interpreter
    of its own, as before there was one."""
    shipped = tmp_path / "control"
    shipped.mkdir()
    for src in agent_files():
        if src.name != left_out:
            shutil.copy2(src, shipped / src.name)
    # -E -S: neither PYTHONPATH nor site-packages, so no `sandboxes` package to fall back on.
    alone = start_agent(tmp_path / "sb", TOKEN, agent=shipped / "agent.py", python_flags=("-E", "-S"))
    try:
        sandbox = _remote(alone)
        marker = sandbox.base_env["ROLLOUT_SANDBOX"]
        result = await sandbox.exec(["bash", "-c", "(setsid sleep 300 &); echo hi; exit 3"], timeout=30)
        assert result.exit_code == 3 and result.stdout_tail == "hi\n"
        assert _marked(marker) == []  # the supervisor, run from the copy, ended what the command left
        chain = await _ancestry(sandbox)
    finally:
        alone.kill()
    # Above the command its supervisor, then the server, or (with none) the agent itself.
    assert chain[1][1] == "rollout-sup", chain
    assert chain[2][1] == "rollout-server" if left_out is None else chain[2][0] == alone.proc.pid, chain


async def test_stop_ends_running_commands_and_the_agent(agent):
    sandbox = _remote(agent)
    marker = sandbox.base_env["ROLLOUT_SANDBOX"]
    import asyncio

    running = asyncio.ensure_future(sandbox.exec(["sleep", "300"], timeout=300))
    deadline = time.monotonic() + 20
    while not _marked(marker) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert _marked(marker)
    await sandbox.stop()
    with pytest.raises(SandboxLostError):
        await running
    assert agent.proc.wait(15) == 0
    assert _marked(marker) == []
    await sandbox.stop()  # idempotent


_ANCESTRY = (
    'p=$$; while [ "$p" -gt 1 ]; do echo "$p $(cat /proc/$p/comm)"; p=$(cut -d" " -f4 /proc/$p/stat); done'
)


async def _ancestry(sandbox: RemoteSandbox) -> list[tuple[int, str]]:
    """(pid, name) of a command run through the agent, and of each process above it."""
    res = await sandbox.exec(["sh", "-c", _ANCESTRY], timeout=30)
    assert res.exit_code == 0, res.stderr_tail
    return [(int(pid), comm) for pid, comm in (line.split(" ", 1) for line in res.stdout_tail.splitlines())]


async def test_one_server_forks_every_commands_supervisor_and_is_started_again_when_lost(agent):
    sandbox = _remote(agent)

    def server_of(chain: list[tuple[int, str]]) -> int:
        comms = [comm for _pid, comm in chain]
        # The command, its supervisor, the server, the agent: no interpreter started for the command.
        assert comms[:3] == ["sh", "rollout-sup", "rollout-server"], chain
        assert chain[3][0] == agent.proc.pid, chain
        return chain[2][0]

    first, second = await _ancestry(sandbox), await _ancestry(sandbox)
    server = server_of(first)
    assert server_of(second) == server and first[1][0] != second[1][0]  # one server, a supervisor each
    env = await sandbox.exec(["env", "-0"], timeout=30)  # the command's environment is the client's alone
    entries = (await sandbox.read_file(env.stdout_path, 65536)).decode().split("\0")
    marked = [entry for entry in entries if entry.startswith("ROLLOUT_SANDBOX=")]
    assert marked == ["ROLLOUT_SANDBOX=" + sandbox.base_env["ROLLOUT_SANDBOX"]], marked
    os.kill(server, signal.SIGKILL)
    # A command that met the server dying is refused as lost (it may have started: never run twice), or
    # started another way; by its answer the agent knows the server is gone, and the next one has a new one.
    with contextlib.suppress(SandboxLostError):
        await _ancestry(sandbox)
    again = server_of(await _ancestry(sandbox))
    assert again != server
    await sandbox.stop()
    assert agent.proc.wait(15) == 0
    # The server does not outlive its agent.
    assert not _alive_as(again, "rollout-server")


def _alive_as(pid: int, comm: str) -> bool:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip() == comm
    except OSError:
        return False


def test_an_agent_is_reached_over_plain_http_only():
    """Agents serve plain HTTP: the worker's transport to one loads no CA store, and a URL that would need
    TLS is refused in one line rather than spoken to unverified."""
    with pytest.raises(ValueError, match="plain http, not 'https://node:8080'"):
        agent_transport("https://node:8080")
    assert agent_transport("http://node:8080") is not None


async def test_a_dead_agent_reads_as_a_lost_sandbox(agent):
    sandbox = _remote(agent)
    agent.proc.kill()
    agent.proc.wait(10)
    with pytest.raises(SandboxLostError, match="agent exited"):
        await sandbox.exec(["true"], timeout=5)


# -- a flood of hostile connections ----------------------------------------------------------------------

FLOOD = 2000
HELD = 150  # more than the connection cap, all open at once
FLOOD_CLIENTS = 48
SLOW_S = 2.0  # the agent's idle and header timeouts in the flood test
CLIENT_WAIT_S = 30.0  # a client's own bound: a connection still open after it was never cut
RSS_BOUND_MB = 120


class _Peaks:
    """The agent's threads, descriptors and RSS, sampled from /proc while the flood runs."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.threads = self.fds = 0
        self.stop = threading.Event()

    def sample(self) -> None:
        status = Path(f"/proc/{self.pid}/status").read_text()
        threads = int(re.search(r"^Threads:\s+(\d+)", status, re.M).group(1))  # type: ignore[union-attr]
        self.threads = max(self.threads, threads)
        self.fds = max(self.fds, len(os.listdir(f"/proc/{self.pid}/fd")))

    def run(self) -> None:
        while not self.stop.wait(0.01):  # pacing the sampler, not waiting for anything
            self.sample()

    def rss_mb(self) -> float:
        status = Path(f"/proc/{self.pid}/status").read_text()
        return int(re.search(r"^VmHWM:\s+(\d+) kB", status, re.M).group(1)) / 1024  # type: ignore[union-attr]


def _connect(agent: AgentProcess) -> socket.socket:
    return socket.create_connection((agent.host, agent.port), timeout=CLIENT_WAIT_S)


def _cut(sock: socket.socket) -> bool:
    """Wait, bounded, for the agent to close the connection; whatever it says before that is drained."""
    try:
        while True:
            if not sock.recv(65536):
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False
    finally:
        sock.close()


def _status(sock: socket.socket, request: bytes) -> int | None:
    """The status the agent answers ``request`` with, or None if it closed without one."""
    try:
        sock.sendall(request)
        head = b""
        while b"\r\n" not in head:
            chunk = sock.recv(4096)
            if not chunk:
                return None
            head += chunk
        return int(head.split(b" ", 2)[1])
    except (ConnectionResetError, BrokenPipeError):
        return None
    finally:
        sock.close()


def _trickle(sock: socket.socket) -> bool:
    """Send a request's headers a byte at a time, never finishing them; True once the agent cuts in."""
    partial = b"GET /health HTTP/1.1\r\nHost: agent\r\nX-Slow: " + b"z" * 400
    try:
        for i in range(len(partial)):
            sock.send(partial[i : i + 1])
            if select.select([sock], [], [], 0.05)[0]:  # pacing the trickle; readable means cut
                break
    except (ConnectionResetError, BrokenPipeError):
        sock.close()
        return True
    return _cut(sock)


def _flood_one(agent: AgentProcess, i: int) -> tuple[str, int | None, bool]:
    """Connection ``i`` of the flood: (kind, status answered or None, cut by the agent)."""
    kind = ("none", "wrong", "bare", "none", "wrong", "silent", "trickle", "none", "wrong", "held")[i % 10]
    try:
        sock = _connect(agent)
    except OSError:
        return kind, None, True  # refused outright: rejected too
    if kind == "silent":
        return kind, None, _cut(sock)
    if kind == "held":
        sock.sendall(b"POST /exec HTTP/1.1\r\n")
        return kind, None, _cut(sock)
    if kind == "trickle":
        return kind, None, _trickle(sock)
    auth = {"none": b"", "wrong": b"Authorization: Bearer wrong\r\n", "bare": TOKEN.encode()}[kind]
    if kind == "bare":
        auth = b"Authorization: " + auth + b"\r\n"  # the token without its scheme is no token
    body = b'{"argv": ["touch", "pwned"], "env": {}, "timeout": 5}'
    request = (
        b"POST /exec HTTP/1.1\r\nHost: agent\r\n" + auth + b"Content-Type: application/json\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )
    return kind, _status(sock, request), True


def _legit(agent: AgentProcess, conn: http.client.HTTPConnection, i: int) -> bool:
    """An authenticated upload then download on ``conn``; True if both answered as they should."""
    headers = {"Authorization": f"Bearer {TOKEN}"}
    data = f"legit {i}\n".encode()
    conn.request("POST", f"/upload?path=legit{i}.txt&mode=600", body=data, headers=headers)
    up = conn.getresponse()
    up.read()
    conn.request("GET", f"/download?path=legit{i}.txt", headers=headers)
    down = conn.getresponse()
    return up.status == 200 and down.status == 200 and down.read() == data


def test_a_flood_of_hostile_connections(tmp_path):
    agent = start_agent(
        tmp_path / "sb", TOKEN, "--idle-timeout-s", str(SLOW_S), "--header-timeout-s", str(SLOW_S)
    )
    peaks = _Peaks(agent.proc.pid)
    sampler = threading.Thread(target=peaks.run, daemon=True)
    try:
        # The worker's way: a kept-alive connection that has shown the token before the flood begins.
        worker = http.client.HTTPConnection(agent.host, agent.port, timeout=CLIENT_WAIT_S)
        assert _legit(agent, worker, 0)
        sampler.start()
        held = [_connect(agent) for _ in range(HELD)]
        peaks.sample()
        with ThreadPoolExecutor(FLOOD_CLIENTS) as pool:
            flood = pool.map(lambda i: _flood_one(agent, i), range(FLOOD - HELD))
            held_cuts = pool.map(_cut, held)
            during, fresh = [], []
            for i in range(1, 21):
                during.append(_legit(agent, worker, i))
                # A new connection mid-flood, as the worker opens when its pool's idle ones expired.
                conn = http.client.HTTPConnection(agent.host, agent.port, timeout=CLIENT_WAIT_S)
                fresh.append(_legit(agent, conn, 100 + i))
                conn.close()
            results, held_cut = list(flood), list(held_cuts)
        peaks.stop.set()
        sampler.join()
        after = http.client.HTTPConnection(agent.host, agent.port, timeout=CLIENT_WAIT_S)
        assert _legit(agent, after, 999)
        rss = peaks.rss_mb()
    finally:
        peaks.stop.set()
        agent.kill()
    answered = [status for _, status, _ in results if status is not None]
    rejected = sum(status != 200 for _, status, _ in results) + HELD
    print(
        f"FLOOD requests={FLOOD} rejected={rejected} peak_threads={peaks.threads} "
        f"peak_fds={peaks.fds} peak_rss_mb={rss:.0f}"
    )
    assert all(during) and all(fresh), (during, fresh)
    assert rejected == FLOOD and set(answered) <= {401, 503} and 401 in answered
    assert not (agent.root / "work" / "pwned").exists()
    slow = [cut for kind, _, cut in results if kind in ("silent", "trickle", "held")]
    assert all(held_cut) and all(slow), (held_cut.count(False), slow.count(False))
    cap = DEFAULT_MAX_CONNECTIONS
    assert peaks.threads <= 2 * cap + 8 and peaks.fds <= 2 * cap + 16
    assert rss < RSS_BOUND_MB


@pytest.mark.skipif(
    os.geteuid() != 0 or isinstance(identity.sandbox_identity(), str),
    reason=f"--run-as needs root and the sandbox user: {identity.sandbox_identity()}",
)
async def test_run_as_runs_every_command_as_the_unprivileged_user():
    """The agent's commands run as the user, which owns the workspace, home and tmp and nothing else."""
    # The user must be able to pass through the root's parents: pytest's tmp_path is private to root.
    base = Path(tempfile.mkdtemp(prefix="rollout-run-as-", dir="/tmp"))
    base.chmod(0o711)
    agent = start_agent(base / "sb", TOKEN, "--run-as", identity.SANDBOX_USER)
    try:
        sandbox = _remote(agent)
        await lay_out(sandbox, WorkspaceSpec(files={"a.txt": "one\n"}))
        await sandbox.write_file("sub/b.txt", b"uploaded\n")
        script = "id -un; echo two > a.txt; echo more >> sub/b.txt; echo x > $HOME/h; ls ../run; touch ../x"
        result = await sandbox.exec(["sh", "-c", script], timeout=30)
        diff = await workspace_diff(sandbox)
        appended = (agent.root / "work" / "sub" / "b.txt").read_text()
        planted = (agent.root / "x").exists()
        # The agent's supervisor server (root) is out of the user's reach: no signal, no request of its.
        server = [pid for pid, comm in (await _ancestry(sandbox)) if comm == "rollout-server"]
        attack = (
            f"kill -9 {server[0]} && echo killed; echo '{{\"id\": 9}}' > /proc/{server[0]}/fd/0 && echo wrote"
        )
        attacked = await sandbox.exec(["sh", "-c", attack], timeout=30)
        after = [pid for pid, comm in (await _ancestry(sandbox)) if comm == "rollout-server"]
    finally:
        agent.kill()
        shutil.rmtree(base, ignore_errors=True)
    assert result.stdout_tail.splitlines()[0] == identity.SANDBOX_USER, result.stderr_tail
    assert "Permission denied" in result.stderr_tail and not planted
    assert attacked.stdout_tail == "" and after == server, (attacked.stdout_tail, attacked.stderr_tail)
    assert appended == "uploaded\nmore\n"
    assert diff is not None and "+two" in diff


@pytest.mark.skipif(
    os.geteuid() != 0 or isinstance(identity.sandbox_identity(), str),
    reason=f"--uid-pool needs root and the sandbox user: {identity.sandbox_identity()}",
)
async def test_agents_on_one_node_run_their_commands_as_uids_of_their_own():
    """Two Slurm jobs' agents on one node (as root, ``--uid-pool``): each runs its commands as a uid of the
    node's pool, not the other's nor the named user's, which its view's passwd names; the files it is
    given are that uid's; its view is the allow-list (no source tree)."""
    base = Path(tempfile.mkdtemp(prefix="rollout-uid-pool-", dir="/tmp"))
    base.chmod(0o711)
    flags = ("--isolation", "auto", "--run-as", identity.SANDBOX_USER, "--uid-pool")
    agents = [start_agent(base / name, TOKEN, *flags) for name in ("a", "b")]
    try:
        results = []
        for agent in agents:
            sandbox = _remote(agent)
            await sandbox.write_file("given.txt", b"x")
            script = f"id -u; id -un; stat -c %u given.txt; ls {Path(__file__).parent}"
            results.append(await sandbox.exec(["sh", "-c", script], timeout=30))
    finally:
        for agent in agents:
            agent.kill()
        shutil.rmtree(base, ignore_errors=True)
    uids = set()
    for res in results:
        uid, name, owner, *_ = res.stdout_tail.splitlines()
        assert int(uid) >= uidpool.POOL_BASE and owner == uid, res
        assert name == identity.SANDBOX_USER
        assert "No such file or directory" in res.stderr_tail, res  # the tests' directory is not there
        uids.add(uid)
    assert len(uids) == 2


GATEWAY_STANDIN = """
import socket, sys
server = socket.create_server(("127.0.0.1", 0))
print(server.getsockname()[1], flush=True)
while True:
    conn, _ = server.accept()
    conn.recv(65536)
    conn.sendall(b"HTTP/1.0 200 OK\\r\\nContent-Length: 20\\r\\n\\r\\nthe gateway answered")
    conn.close()
"""

HOSTILE = """
id -u
cat {home}/secret /proc/{me}/environ
ls /proc | grep -c '^[0-9]'
python3 - {other} {gateway} <<'PY'
import socket, sys, urllib.request
try:
    socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=3).close()
    print("connected")
except OSError as exc:
    print("refused", exc.errno)
print(urllib.request.urlopen(sys.argv[2], timeout=10).read().decode())
PY
echo x > /etc/planted-by-agent-test || echo cannot plant
"""


@pytest.mark.skipif(
    os.geteuid() != 0
    or not (shutil.which("setpriv") and shutil.which("bwrap") and os.path.exists("/usr/bin/python3"))
    or isinstance(identity.sandbox_identity(), str),
    reason="starts the agent as another user: needs root, setpriv, bwrap, the sandbox user, /usr/bin/python3",
)
async def test_an_agent_that_is_not_root_isolates_its_commands_with_bubblewrap():
    """A Slurm job of a worker that is not root: no user switch, but bubblewrap's PID namespace, network
    (the gateway only, through the agent's relay) and view (homes hidden, the host read-only)."""
    who = identity.sandbox_identity()
    assert not isinstance(who, str)
    base = Path(tempfile.mkdtemp(prefix="rollout-agent-bwrap-", dir="/tmp"))
    base.chmod(0o711)
    home = Path(
        tempfile.mkdtemp(prefix="rollout-bwrap-home-", dir="/home" if os.access("/home", os.W_OK) else None)
    )
    home.chmod(0o755)
    (home / "secret").write_text("SECRET for anyone who can see it")
    (home / "secret").chmod(0o644)  # readable by every user: only the view keeps it out
    other = socket.create_server(("127.0.0.1", 0))
    gateway = subprocess.Popen([sys.executable, "-c", GATEWAY_STANDIN], stdout=subprocess.PIPE, text=True)
    # The system's python3: the tests' own may sit where only root can reach it.
    python = "/usr/bin/python3"
    agent = start_agent(base / "sb", TOKEN, "--isolation", "auto", user=tuple(who), python=python)
    try:
        port = int(gateway.stdout.readline()) if gateway.stdout else 0
        sandbox = _remote(agent)
        assert (await sandbox.health())["isolation"] == "network,pids,filesystem"
        url = sandbox.gateway_url(f"http://127.0.0.1:{port}/v1")
        script = HOSTILE.format(home=home, me=os.getpid(), other=other.getsockname()[1], gateway=url)
        res = await sandbox.exec(["bash", "-c", script], timeout=60)
        await sandbox.write_file("kept.txt", b"mine")
        assert await sandbox.read_file("kept.txt", 10) == b"mine"
    finally:
        agent.kill()
        gateway.kill()
        gateway.wait()
        other.close()
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(home, ignore_errors=True)
    out = res.stdout_tail + res.stderr_tail
    lines = res.stdout_tail.splitlines()
    assert len(lines) == 5, out
    assert lines[0] == str(who.uid) and "SECRET" not in out, out
    assert (
        f"{home}/secret: No such file" in res.stderr_tail
        and f"/proc/{os.getpid()}/environ" in res.stderr_tail
    )
    assert int(lines[1]) < 10, out  # isolation.py's two, bwrap's and the command's own: not the host's
    assert lines[2:4] == ["refused 111", "the gateway answered"], out
    assert lines[4] == "cannot plant" and not Path("/etc/planted-by-agent-test").exists()


def test_an_agents_wait_for_a_command_ends_with_it_or_at_its_bound():
    """The agent's wait for a supervisor (agent_commands.wait_exit): the exit status once it has ended,
    also for one already reaped; TimeoutExpired, with the process left running, past the bound."""
    from sandboxes.agent_commands import wait_exit

    # The process ends once the test writes to its stdin: the wait sees an exit the test caused.
    proc = subprocess.Popen(["sh", "-c", "read _; exit 7"], stdin=subprocess.PIPE)
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            wait_exit(proc, 0.2)
        assert proc.poll() is None
        proc.communicate(b"go\n", timeout=30)  # ends it, and reaps it: no pidfd can be opened now
        wait_exit(proc, 30)
        assert proc.returncode == 7
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    ended = subprocess.Popen(["sh", "-c", "exit 3"])
    wait_exit(ended, 30)
    assert ended.returncode == 3

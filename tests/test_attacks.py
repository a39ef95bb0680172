"""Hostile commands against the default local sandbox, run as an agent would run them: each must fail
and leave the run unharmed.

Through the real harness path (the scripted model driving Codex's shell tool) where that is cheap, and
through ``exec`` otherwise. The secrets are fakes in a home of this module's (a real `ray start --head`
with token auth reads its token there), never the machine's own. The sandboxes are the default ones: a
host without what the default isolates with skips this module, saying why."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from executor.session import SessionRequest, run_session
from executor.tasks import Task
from harnesses.command import CommandHarness
from harnesses.gateway import Gateway
from harnesses.testing.scripted_model import ScriptedModel
from sandboxes import isolation, pidlimit, uidpool
from sandboxes.base import ExecResult, SandboxProvider, SandboxSpec
from sandboxes.local import LocalSandbox, LocalSandboxProvider
from sandboxes.local_config import LocalSandboxConfig
from sandboxes.proctree import has_env_entry
from tests.conftest import processes_under, session_context
from tests.test_ray_job import _end, _until, start_head

FULL = "network,pids,filesystem,user"


def _why_not() -> str | None:
    if os.geteuid() != 0:
        return "the default isolates fully only as root (an unprivileged user needs root)"
    for why in (isolation.network_unavailable(), isolation.mounts_unavailable(), pidlimit.unavailable()):
        if why is not None:
            return why
    return None


pytestmark = pytest.mark.skipif(_why_not() is not None, reason=f"no full isolation here: {_why_not()}")

TAG = uuid.uuid4().hex[:10]
RAY_TOKEN = f"ray-token-FAKE-{TAG}"
AWS_SECRET = f"aws-secret-FAKE-{TAG}"
WORKER_KEY = f"sk-worker-FAKE-{TAG}"
SECRETS = (RAY_TOKEN, AWS_SECRET, WORKER_KEY)
DISK_MB = 32


@dataclass
class Host:
    """What an attacker is after on this host: a home with credentials and a Ray head reading them."""

    home: Path
    gcs: int
    raylet: int
    dashboard: int


@pytest.fixture(scope="module")
def host() -> Iterator[Host]:
    # A home where homes are (hidden from sandboxes like /root), else under /tmp (hidden too).
    base = "/home" if os.access("/home", os.W_OK) else None
    home = Path(tempfile.mkdtemp(prefix="rollout-attack-", dir=base))
    (home / ".ray").mkdir()
    (home / ".ray" / "auth_token").write_text(RAY_TOKEN)
    (home / ".aws").mkdir()
    (home / ".aws" / "credentials").write_text(f"[default]\naws_secret_access_key = {AWS_SECRET}\n")
    # Ray's socket paths must fit in 107 bytes: a short temp dir of its own.
    root = Path(tempfile.mkdtemp(prefix="rr-atk-", dir="/tmp"))
    proc, ports, log = start_head(root, {"HOME": str(home), "RAY_AUTH_MODE": "token"}, num_cpus=1)
    try:
        for name in ("port", "node-manager-port", "dashboard-port"):
            _until(f"{name} listening", lambda n=name: _listening(ports[n]), 120, proc, log)
        yield Host(home, ports["port"], ports["node-manager-port"], ports["dashboard-port"])
    finally:
        left = _end(proc, str(root))
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(home, ignore_errors=True)
        assert not left, f"killed by pid after SIGTERM to the head: {left}"


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


@dataclass
class World:
    holder: int  # stands in for the worker: a process with the key in its environment
    provider: LocalSandboxProvider
    a: LocalSandbox
    b: LocalSandbox  # another session on the same worker
    run_dir: Path
    gateway: Gateway
    base_url: str  # session a's gateway URL
    other_url: str  # session b's


@pytest.fixture
async def world(tmp_path: Path) -> AsyncIterator[World]:
    # Stands in for the worker, which holds the key in its environment; a target for ptrace other than
    # this test's own process, which a sandbox that failed to isolate would stop.
    holder = subprocess.Popen(
        ["sleep", "300"], env={"PATH": os.environ["PATH"], "OPENAI_API_KEY": WORKER_KEY}
    )
    scripted = ScriptedModel()
    await scripted.start()
    gateway = Gateway(scripted.base_url, None)
    await gateway.start(unix_path=str(tmp_path / "gw.sock"))
    forward = (urlsplit(gateway.url).port or 0, str(tmp_path / "gw.sock"))
    config = LocalSandboxConfig(max_processes=64, max_file_mb=8, max_disk_mb=DISK_MB)
    provider = config.build(tmp_path / "sandboxes", forward)
    run_dir = tmp_path / "runs" / "r"
    (run_dir / "rows").mkdir(parents=True)
    (run_dir / "rows" / "part-0.parquet").write_text("rows of other rollouts")
    provider.hide(run_dir)
    a = await provider.start(SandboxSpec(run_id="r", session_id="a", ttl_s=300))
    b = await provider.start(SandboxSpec(run_id="r", session_id="b", ttl_s=300))
    Path(b.workdir, "answer.txt").write_text("the other session's work")
    evidence = tmp_path / "evidence"
    urls = [gateway.open_session(s, evidence / s).base_url for s in ("a", "b")]
    try:
        yield World(holder.pid, provider, a, b, run_dir, gateway, urls[0], urls[1])
    finally:
        holder.kill()
        holder.wait(timeout=30)
        for sandbox in (a, b):
            await sandbox.stop()
        await provider.aclose()
        await gateway.stop()
        await scripted.stop()
    assert not processes_under(str(tmp_path / "sandboxes"))


async def _sh(sandbox: LocalSandbox, script: str, timeout: float = 30) -> tuple[int | None, str]:
    res = await sandbox.exec(["sh", "-c", script], timeout=timeout)
    return res.exit_code, res.stdout_tail + res.stderr_tail


def _no_secret(text: str) -> None:
    assert not any(s in text for s in SECRETS), text[-2000:]


# --- reading what is not the sandbox's ---------------------------------------------------------------


READS = {
    "ray token": "cat {home}/.ray/auth_token",
    "aws credentials": "cat {home}/.aws/credentials",
    "root's home": "ls -A /root/.ray /root/.aws /root/.config 2>&1; cat /root/.ray/auth_token",
    "worker environ": "cat /proc/{pid}/environ",
    "every environ": "cat /proc/*/environ | tr '\\0' '\\n' | grep -F {key}",
    "other sandbox": "cat {b}/answer.txt",
    "sandbox root": "ls {root}/r | grep -F b",
    "run directory": "cat {run}/rows/part-0.parquet",
}


@pytest.mark.parametrize("attack", READS, ids=list(READS))
async def test_reading_what_is_not_the_sandboxs_fails(world, host, attack):
    script = READS[attack].format(
        home=host.home,
        pid=world.holder,
        key=WORKER_KEY,
        b=world.b.workdir,
        root=world.provider.root,
        run=world.run_dir,
    )
    code, out = await _sh(world.a, script)
    assert code != 0, out
    _no_secret(out)
    assert "the other session's work" not in out and "rows of other rollouts" not in out


CONNECT = """
import socket, sys
for port in sys.argv[1:]:
    try:
        socket.create_connection(("127.0.0.1", int(port)), timeout=3).close()
        print("connected", port)
    except OSError as exc:
        print("refused", port, exc.errno)
"""


async def test_the_ray_ports_are_out_of_reach(world, host):
    ports = [str(p) for p in (host.gcs, host.raylet, host.dashboard)]
    res = await world.a.exec(["python3", "-c", CONNECT, *ports], timeout=30)
    assert res.exit_code == 0, res.stderr_tail
    assert res.stdout_tail.split("\n")[:3] == [f"refused {p} 111" for p in ports]
    assert all(_listening(int(p)) for p in ports)  # they are up, for the worker


FETCH = """
import sys, urllib.request, urllib.error
for url in sys.argv[1:]:
    try:
        with urllib.request.urlopen(url + "/models", timeout=10) as answer:
            print(answer.status)
    except urllib.error.HTTPError as exc:
        print(exc.code)
"""


async def test_only_its_own_gateway_prefix_answers(world):
    parts = urlsplit(world.base_url)
    origin = f"{parts.scheme}://{parts.netloc}"
    guessed = [f"{origin}/s/{uuid.uuid4().hex}/v1", f"{origin}/s//v1", f"{origin}/v1", f"{origin}/s/x/v1"]
    res = await world.a.exec(["python3", "-c", FETCH, world.base_url, *guessed], timeout=30)
    assert res.exit_code == 0, res.stderr_tail
    own, *others = res.stdout_tail.split()
    assert own == "200" and all(code != "200" for code in others), res.stdout_tail
    # Session b's prefix works only for whoever holds its token: b's harness, never a's.
    assert world.other_url.split("/s/")[1] not in repr(world.a.base_env)


PTRACE = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
for pid in map(int, sys.argv[1:]):
    ok = libc.ptrace(16, pid, 0, 0)  # PTRACE_ATTACH
    print(pid, ok, os.strerror(ctypes.get_errno()))
"""


async def test_ptrace_of_the_worker_or_the_namespace_init_fails(world):
    res = await world.a.exec(["python3", "-c", PTRACE, str(world.holder), "1"], timeout=30)
    lines = res.stdout_tail.splitlines()
    assert lines[0] == f"{world.holder} -1 No such process", res.stdout_tail + res.stderr_tail
    assert lines[1] == "1 -1 Operation not permitted"


async def test_the_namespaces_init_its_supervisor_server_cannot_be_signalled_or_read(world):
    """pid 1 of the sandbox's PID namespace is its supervisor server (namespaces.ServerInit), root with
    the view's namespaces and the worker's pidfd in hand: a command can neither stop it nor look at what
    it holds, and the sandbox serves its next command."""
    probes = "; ".join(
        f"{probe} >/dev/null 2>&1; echo $?"
        for probe in (
            "kill -TERM 1",
            "kill -STOP 1",
            "kill -KILL 1",
            "cat /proc/1/environ",
            "ls /proc/1/fd",
            "readlink /proc/1/ns/mnt",
            "cat /proc/1/maps",
        )
    )
    code, out = await _sh(world.a, probes)
    assert code == 0 and "0" not in out.split(), out
    again = await world.a.exec(["sh", "-c", "echo alive"], timeout=30)
    assert again.stdout_tail.strip() == "alive" and world.a._server.alive


async def test_writes_outside_the_session_fail(world, host):
    probe = Path(__file__).parent / f".attack-probe-{TAG}"  # a host directory in sight, read-only
    targets = [probe, Path("/etc") / f"attack-{TAG}", host.home / "planted", world.b.workdir + "/planted"]
    try:
        for target in targets:
            code, out = await _sh(world.a, f"echo x > {target}")
            assert code != 0, (target, out)
            assert not Path(target).exists()
        code, out = await _sh(world.a, f"echo x > {world.a.workdir}/mine && id -un")
    finally:
        probe.unlink(missing_ok=True)
    assert code == 0 and out.strip() == "rollout-sandbox", out
    assert Path(world.a.workdir, "mine").read_text() == "x\n"
    # Nor can it touch what the worker reads back: the supervisors' results and logs are not in its view.
    code, out = await _sh(world.a, f"ls {world.a.root}/run {world.a.root}/logs")
    assert code != 0, out


# --- taking the host's resources -------------------------------------------------------------------------


async def test_a_fork_bomb_is_capped_and_the_other_session_unharmed(world):
    pidlimit.sweep()  # as another run starting would: empty caps go, a live sandbox's holds its server
    bomb = world.a.exec(["bash", "-c", "b() { b | b & }; b; sleep 3"], timeout=3)
    loop = "for i in 1 2 3 4 5 6 7 8; do /bin/true || exit 1; done; echo ok"
    other = world.b.exec(["sh", "-c", loop], timeout=60)
    bombed, fine = await asyncio.gather(bomb, other)
    assert fine.exit_code == 0 and fine.stdout_tail.strip() == "ok", fine.stderr_tail
    assert bombed.timed_out or bombed.exit_code is not None
    assert "fork" in bombed.stderr_tail.lower() or "resource" in bombed.stderr_tail.lower()
    again = await world.a.exec(["sh", "-c", "echo alive"], timeout=30)  # its own sandbox recovers too
    assert again.stdout_tail.strip() == "alive"


async def test_commands_are_born_in_their_sandboxs_cap(world):
    """The sandbox's supervisor server is moved into its cap's cgroup once, at the sandbox's start, so that
    no command's init pays the kernel for a move (~10 ms each with cgroup v1): it is born there."""
    desc = world.a.descriptor()
    group = "/rollout-executor/" + Path(desc["pids_cgroup"]).parent.name  # as /proc/PID/cgroup names it

    def groups(pid: int | str) -> set[str]:
        return {line.split(":", 2)[2] for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines()}

    assert group in groups(desc["server_pid"])
    res = await world.a.exec(["cat", "/proc/self/cgroup"], timeout=30)
    assert group in {line.split(":", 2)[2] for line in res.stdout_tail.splitlines()}, res.stdout_tail


async def test_a_spare_servers_cap_is_made_before_its_sandbox_starts_and_goes_with_it(world):
    """The next sandbox's server (a spare, started while a command runs) is moved into its cap's cgroup
    then, off the next session's path; the sandbox it serves keeps that cap, which stays with the server
    for the sandbox it serves next, and a spare no sandbox took takes its cap with it."""
    await world.a.exec(["true"], timeout=30)  # a command runs: a spare is made for the next sandbox
    assert world.provider._spare is not None
    spare = await world.provider._spare[1]
    for group in spare.cgroups.values():  # its process cap and its memory cap
        assert str(spare.pid) in Path(group).read_text().split()
    assert set(spare.cgroups) == {"pids", "memory"}
    c = await world.provider.start(SandboxSpec(run_id="r", session_id="c", ttl_s=300))
    try:
        assert c.descriptor()["server_pid"] == spare.pid and c.pids_cgroup == spare.cgroups["pids"]
        res = await c.exec(["cat", "/proc/self/cgroup"], timeout=30)
        group = "/rollout-executor/" + Path(spare.cgroups["pids"]).parent.name
        assert group in {line.split(":", 2)[2] for line in res.stdout_tail.splitlines()}, res.stdout_tail
    finally:
        await c.stop()
    assert spare in world.provider._idle  # kept, its namespace empty, with its caps for a later sandbox
    assert world.provider._spare is not None  # c's command made the next one
    unused = await world.provider._spare[1]
    assert unused.cgroups["pids"] and Path(unused.cgroups["pids"]).exists()
    await world.provider.aclose()
    assert not Path(unused.cgroups["pids"]).parent.exists()
    assert not any(Path(group).parent.exists() for group in spare.cgroups.values())


async def test_an_ended_sandboxs_caps_serve_a_later_one_capped_again_and_holding_only_its_processes(world):
    """A sandbox's caps outlive it, emptied with its PID namespace (kept alone, or with its server), and a
    later sandbox takes them rather than the kernel making two cgroups again: the provider's limits set
    again (whatever the first left),
    the later sandbox's server and commands in them and nothing else."""
    first = {"pids": world.a.pids_cgroup, "memory": world.a.memory_cgroup}
    assert all(first.values())
    Path(first["pids"]).with_name("pids.max").write_text("5")  # as a task's own cap would leave it
    server = world.a._server
    await world.a.stop()
    assert first in world.provider._spare_caps or server in world.provider._idle  # with its server
    # The provider may hold one spare server, capped before the first sandbox ended.
    for name in ("c", "d"):
        later = await world.provider.start(SandboxSpec(run_id="r", session_id=name, ttl_s=300))
        try:
            if later.pids_cgroup != first["pids"]:
                continue
            assert later.memory_cgroup == first["memory"]
            assert Path(first["pids"]).with_name("pids.max").read_text().strip() == "64"
            held = await later.exec(["sh", "-c", "cat /proc/self/cgroup; echo $$"], timeout=30)
            group = "/rollout-executor/" + Path(first["pids"]).parent.name
            assert group in {line.split(":", 2)[-1] for line in held.stdout_tail.splitlines()}, (
                held.stdout_tail
            )
            # Its server, and its command's supervisor if not yet gone: no process of the first sandbox.
            members = [int(pid) for pid in Path(first["pids"]).read_text().split()]
            assert later.descriptor()["server_pid"] in members
            theirs = world.a._marker  # its marker, as its processes carry it
            assert not [pid for pid in members if has_env_entry(pid, theirs)], members
            mine = later._marker
            assert all(has_env_entry(pid, mine) or not Path(f"/proc/{pid}").exists() for pid in members)
            break
        finally:
            await later.stop()
    else:
        raise AssertionError("no later sandbox took the first one's caps")


async def test_a_runaway_file_stops_at_the_cap_and_the_other_session_writes(world):
    res = await world.a.exec(["sh", "-c", "head -c 64M /dev/zero > big"], timeout=60)
    assert res.exit_code != 0 or res.signal == signal.SIGXFSZ, res
    assert Path(world.a.workdir, "big").stat().st_size == 8 * 1024 * 1024
    code, out = await _sh(world.b, "head -c 1M /dev/zero > f && echo ok")
    assert code == 0 and out.strip() == "ok"


FILL = """
import os
for i in range(100_000):  # 100,000 files of 4 KiB: 400 MiB, each far below the file cap
    with open(f"f{i}", "wb") as f:
        f.write(b"x" * 4096)
print("wrote them all")
"""


async def test_filling_the_disk_with_many_files_is_stopped_and_the_other_session_writes(world):
    filler = world.a.exec(["python3", "-c", FILL], timeout=600)
    other = world.b.exec(["sh", "-c", "head -c 4M /dev/zero > f && ls -s f"], timeout=600)
    filled, fine = await asyncio.gather(filler, other)
    # The session's own filesystem refuses the write past the bound (diskfs.py): nothing is written past it.
    assert filled.exit_code != 0 and "No space left on device" in filled.stderr_tail, filled
    assert "wrote them all" not in filled.stdout_tail
    assert fine.exit_code == 0 and not fine.timed_out, fine
    written = len(os.listdir(world.a.workdir))
    # Up to the bound, not past it: the last file is made, empty, before its write is refused.
    assert DISK_MB * 2**20 // 4096 // 2 < written <= DISK_MB * 2**20 // 4096 + 1
    again = await world.a.exec(["sh", "-c", "echo alive"], timeout=30)  # the sandbox itself still runs
    assert again.stdout_tail.strip() == "alive"


async def test_big_fallocates_past_the_bound_write_at_most_the_bound(world):
    """Six fallocate calls of 7 MiB each (under the file cap), 42 MiB against a bound of 32: those that
    fit take their space, the others are refused whole, before a byte is written (a watcher saw 2.7 GB
    written past a bound of 512 MB before its stop)."""
    script = "for i in 1 2 3 4 5 6; do fallocate -l 7M big$i; echo $?; done; du -sk ."
    res, fine = await asyncio.gather(
        world.a.exec(["sh", "-c", script], timeout=60),
        world.b.exec(["sh", "-c", "head -c 4M /dev/zero > f && echo ok"], timeout=60),
    )
    *codes, used_kb = res.stdout_tail.split()[:7]
    assert codes == ["0", "0", "0", "0", "1", "1"], res
    assert "No space left on device" in res.stderr_tail
    assert int(used_kb) * 1024 <= DISK_MB * 2**20, res.stdout_tail
    assert fine.stdout_tail.strip() == "ok", fine  # the other session's disk is its own


# --- one identity per session: keyrings, signals ---------------------------------------------------------


KEYRING = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
ADD_KEY, KEYCTL = {"x86_64": (248, 250), "aarch64": (217, 219)}[os.uname().machine]
KEYRING = int(sys.argv[3])  # -4: the user keyring, -3: the session keyring
if sys.argv[1] == "drop":
    libc.syscall(KEYCTL, 21, int(sys.argv[2]))  # KEYCTL_INVALIDATE
elif sys.argv[1] == "store":
    secret = sys.argv[2].encode()
    key = libc.syscall(ADD_KEY, b"user", b"gateway-token", secret, ctypes.c_size_t(len(secret)), KEYRING)
    print(key if key >= 0 else "failed " + os.strerror(ctypes.get_errno()))
else:
    found = libc.syscall(KEYCTL, 10, KEYRING, b"user", b"gateway-token", 0)  # KEYCTL_SEARCH
    print("search", found if found >= 0 else os.strerror(ctypes.get_errno()))
    for key in {found, int(sys.argv[2])} - {-1}:
        buf = ctypes.create_string_buffer(256)
        n = libc.syscall(KEYCTL, 11, key, buf, ctypes.c_size_t(256))  # KEYCTL_READ
        print("read", buf.raw[:n].decode() if n >= 0 else os.strerror(ctypes.get_errno()))
"""


@pytest.mark.parametrize("keyring", ["user", "session"])
async def test_no_session_can_store_or_read_a_key_in_the_kernels_keyrings(world, keyring):
    """Session a tries to store its gateway token in its user keyring (the kernel's, keyed by uid, which
    outlives the sandbox) or its session keyring; b tries to find it, and to read a key this host process
    holds in its own session keyring by its serial: the kernel's keyring calls are not there for either
    (ENOSYS, as on a kernel without keyrings), so nothing one stores can wait for another."""
    token = world.base_url.split("/s/")[1].split("/")[0]
    ring = "-4" if keyring == "user" else "-3"
    host_key = subprocess.run(
        ["python3", "-c", KEYRING, "store", "host-secret", "-3"], capture_output=True, text=True, check=True
    ).stdout.strip()
    try:
        stored = await world.a.exec(["python3", "-c", KEYRING, "store", token, ring], timeout=30)
        stolen = await world.b.exec(["python3", "-c", KEYRING, "find", host_key, ring], timeout=30)
    finally:
        subprocess.run(["python3", "-c", KEYRING, "drop", host_key, "-3"], check=True, timeout=30)
    assert stored.stdout_tail.strip() == "failed Function not implemented", stored
    assert token not in stolen.stdout_tail and "host-secret" not in stolen.stdout_tail, stolen.stdout_tail
    assert stolen.stdout_tail.splitlines() == [
        "search Function not implemented",
        "read Function not implemented",
    ], stolen.stdout_tail
    ids = [await world.a.exec(["id", "-u"], timeout=30), await world.b.exec(["id", "-u"], timeout=30)]
    uid_a, uid_b = (int(r.stdout_tail) for r in ids)
    assert uid_a != uid_b and min(uid_a, uid_b) >= uidpool.POOL_BASE


# The pool's first uids, where a test's sandboxes land: each gets a planted key.
PLANTED_UIDS = 64


async def test_a_key_an_earlier_tenant_of_its_uid_left_is_out_of_reach(world, monkeypatch):
    """The pool gives a uid to sandbox after sandbox, and the kernel keeps a uid's user and user-session
    keyrings past its processes. What was stored there (planted here as each of the pool's first uids,
    where this process's next lease is made to look first, as a process of the uid outside any sandbox
    could) is out of the next sandbox's reach: it cannot search or read a keyring at all."""
    monkeypatch.setattr(uidpool, "_cursor", [uidpool.POOL_BASE])
    planted = f"k_{uuid.uuid4().hex}"
    for uid in range(uidpool.POOL_BASE, uidpool.POOL_BASE + PLANTED_UIDS):
        for ring in ("-4", "-5"):
            subprocess.run(
                ["python3", "-c", KEYRING, "store", planted, ring],
                user=uid,
                group=uid,
                extra_groups=[],
                cwd="/",
                check=True,
                capture_output=True,
                timeout=30,
            )
    c = await world.provider.start(SandboxSpec(run_id="r", session_id="c", ttl_s=300))
    try:
        uid = await c.exec(["id", "-u"], timeout=30)
        assert int(uid.stdout_tail) < uidpool.POOL_BASE + PLANTED_UIDS, uid  # one that was planted
        found = [await c.exec(["python3", "-c", KEYRING, "find", "-1", r], timeout=30) for r in ("-4", "-5")]
        for res in found:
            assert planted not in res.stdout_tail, res.stdout_tail
            assert res.stdout_tail.strip() == "search Function not implemented", res.stdout_tail
    finally:
        await c.stop()


async def test_one_session_cannot_signal_the_others_processes(world):
    """b signals everything it may (``kill -1``: every process of its uid, itself included) and every pid
    it sees while a command of a runs: a's command ends as it would have."""
    waiting = "touch started; i=0; while [ ! -e go ] && [ $i -lt 600 ]; do sleep 0.05; i=$((i+1)); done"
    waiting += "; echo survived"
    running = asyncio.ensure_future(world.a.exec(["sh", "-c", waiting], timeout=60))
    started = Path(world.a.workdir, "started")
    for _ in range(600):  # bounded: a's command has started once the file is there
        if started.exists() or running.done():
            break
        await asyncio.sleep(0.05)
    attack = "for p in /proc/[0-9]*; do kill -9 ${p#/proc/} 2>/dev/null; done; kill -9 -1; echo spared"
    killed = await world.b.exec(["sh", "-c", attack], timeout=30)
    Path(world.a.workdir, "go").write_text("")
    res = await running
    assert killed.signal == signal.SIGKILL, killed  # its kill -1 reached its own processes
    assert res.exit_code == 0 and res.stdout_tail.strip() == "survived", res


async def test_sandboxes_started_at_once_get_their_own_uids_and_own_their_files(world, tmp_path):
    """Two sandboxes started concurrently from one provider (as the agent's and its fresh verification
    sandbox are) run as two uids; what the worker writes or copies into each is that uid's."""
    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    (src / "d" / "f.txt").write_text("x")
    spec = [SandboxSpec(run_id="r", session_id=n, ttl_s=300) for n in ("c", "d")]
    c, d = await asyncio.gather(*(world.provider.start(s) for s in spec))
    try:
        uids = set()
        for sandbox in (c, d, world.a, world.b):
            await sandbox.copy_in(src)
            await sandbox.write_file("w.txt", b"w")
            res = await sandbox.exec(["sh", "-c", "id -u; stat -c %u d/f.txt d w.txt ."], timeout=30)
            numbers = res.stdout_tail.split()
            assert len(set(numbers)) == 1, res  # the command's uid owns every file it was given
            uids.add(numbers[0])
        assert len(uids) == 4
    finally:
        await asyncio.gather(c.stop(), d.stop())


# --- the host by allow-list ------------------------------------------------------------------------------


ALLOWED_READS = {
    # What a deny-list left readable: source trees, dataset directories, anything outside homes and /tmp.
    "the repository": "cat {repo}/pyproject.toml",
    "a dataset directory": "ls {repo}/tests/fixtures",
    "host state": "ls /var/lib /opt /srv /boot /sys/fs/cgroup",
}


@pytest.mark.parametrize("attack", ALLOWED_READS, ids=list(ALLOWED_READS))
async def test_a_host_path_outside_the_allow_list_is_not_there(world, attack):
    repo = Path(__file__).resolve().parent.parent
    code, out = await _sh(world.a, ALLOWED_READS[attack].format(repo=repo))
    assert code != 0 and "No such file or directory" in out, out
    assert "[project]" not in out


async def _commands_in(provider: SandboxProvider, *argvs: list[str]) -> list[ExecResult]:
    """Each command's result, one after another in one sandbox of ``provider``, which is then closed."""
    sandbox = await provider.start(SandboxSpec(run_id="r", session_id="m", ttl_s=300))
    try:
        return [await sandbox.exec(argv, timeout=30) for argv in argvs]
    finally:
        await sandbox.stop()
        await provider.aclose()


async def test_sandbox_mounts_bind_in_only_what_the_run_config_names(tmp_path):
    """``sandbox.mounts``: a path read-only unless asked writable; nothing else of the host."""
    data, out = tmp_path / "data", tmp_path / "out"
    data.mkdir()
    out.mkdir()
    (data / "train.txt").write_text("visible")
    out.chmod(0o1777)  # written as the sandbox's uid, one of a pool: a directory anyone may write
    config = LocalSandboxConfig.model_validate(
        {"network": "host", "mounts": [str(data), {"path": str(out), "writable": True}]}
    )
    read, write_ro, write_rw, other = await _commands_in(
        config.build(tmp_path / "sandboxes"),
        ["cat", str(data / "train.txt")],
        ["sh", "-c", f"echo x > {data}/new"],
        ["sh", "-c", f"echo x > {out}/new && echo ok"],
        ["ls", str(tmp_path)],
    )
    assert read.stdout_tail == "visible"
    assert write_ro.exit_code != 0 and "Read-only file system" in write_ro.stderr_tail
    assert write_rw.stdout_tail.strip() == "ok", write_rw
    assert (out / "new").read_text() == "x\n"
    # Made as the binds' parents, empty but for them: the mounts and the session's own directories.
    assert sorted(other.stdout_tail.split()) == ["data", "out", "sandboxes"]


async def test_sandbox_mounts_named_by_symlinks_bind_their_targets_and_hide_what_is_inside(tmp_path):
    """A mount named by a symlink is bound at the directory it resolves to, read-only; one whose link
    leads nowhere by the sandbox's start is left out, as a missing one is; a hidden path named through a
    symlink is hidden where it resolves to, inside the bind."""
    data = tmp_path / "data"
    (data / "secret").mkdir(parents=True)
    (data / "secret" / "key").write_text("k")
    (data / "train.txt").write_text("visible")
    (tmp_path / "via").symlink_to(data)
    (tmp_path / "gone").mkdir()
    (tmp_path / "dangling").symlink_to(tmp_path / "gone")
    config = LocalSandboxConfig.model_validate(
        {"network": "host", "mounts": [str(tmp_path / "via"), str(tmp_path / "dangling")]}
    )
    (tmp_path / "gone").rmdir()  # after the config was read: the link leads nowhere at the sandbox's start
    provider = config.build(tmp_path / "sandboxes")
    provider.hide(tmp_path / "via" / "secret")
    read, write, secret, other = await _commands_in(
        provider,
        ["cat", str(data / "train.txt")],
        ["sh", "-c", f"echo x > {data}/new"],
        ["ls", "-A", str(data / "secret")],
        ["ls", str(tmp_path)],
    )
    assert read.stdout_tail == "visible"
    assert write.exit_code != 0 and "Read-only file system" in write.stderr_tail
    assert secret.exit_code == 0 and secret.stdout_tail.strip() == "", secret
    assert sorted(other.stdout_tail.split()) == ["data", "sandboxes"]


# --- memory -----------------------------------------------------------------------------------------------


HOG = "x = b'x' * (256 * 2**20); print('allocated')"


async def test_a_memory_hog_is_killed_and_recorded_and_the_other_session_runs(world):
    """A sandbox whose task asks for 64 MiB: its hog is killed by its own cap, which the result says (not
    a signal sent from inside), while another session's command runs on."""
    spec = SandboxSpec(run_id="r", session_id="hog", ttl_s=300, memory_limit_mb=64)
    hog = await world.provider.start(spec)
    try:
        res, fine = await asyncio.gather(
            hog.exec(["python3", "-c", HOG], timeout=60),
            world.b.exec(["python3", "-c", "x = b'y' * (128 * 2**20); print('fine')"], timeout=60),
        )
        after = await hog.exec(["sh", "-c", "echo alive"], timeout=30)
    finally:
        await hog.stop()
    assert res.signal == signal.SIGKILL and res.oom_kills >= 1, res
    assert res.limit and "memory cap of 64 MiB" in res.limit, res
    assert "allocated" not in res.stdout_tail
    assert fine.stdout_tail.strip() == "fine" and fine.oom_kills == 0, fine
    assert after.stdout_tail.strip() == "alive" and after.oom_kills == 0


async def test_a_memory_hog_through_the_command_harness_is_recorded_as_the_caps(tmp_path):
    task = Task.model_validate({"id": "hog", "prompt": "p", "memory_mb": 64, "verify": "true"})
    async with session_context(tmp_path) as ctx:
        ctx.harness = CommandHarness(command=f'python3 -c "{HOG}"')
        row = await run_session(SessionRequest("t", task, 0, 1), ctx)
    assert row["status"] == "failed" and row["exit_code"] == 137, row["error_message"]
    assert "memory cap of 64 MiB" in row["error_message"], row["error_message"]


# --- through the harness ----------------------------------------------------------------------------------


def test_strict_is_the_default_here():
    """What the attacks above meet under the default is what ``strict`` gives (or it refuses to run): on
    this host the two make the same layers, so the suite's results hold for both."""
    assert LocalSandboxConfig(isolation="strict").layers == LocalSandboxConfig().layers
    assert LocalSandboxConfig().build(Path("/nonexistent"), (1, "/gw.sock")).isolation_label == FULL


def test_the_bounds_are_on_by_default_and_off_only_with_isolation():
    """The disk, file and process bounds the attacks above meet with their own small values hold by
    default too; ``isolation: off`` drops them unless set."""
    default = LocalSandboxConfig().build(Path("/nonexistent"), (1, "/gw.sock"))
    assert (default.max_disk_bytes, default.max_file_bytes) == (10240 * 2**20, 4096 * 2**20)
    off = LocalSandboxConfig(isolation="off").build(Path("/nonexistent"))
    assert (off.max_disk_bytes, off.max_file_bytes) == (None, None)
    assert LocalSandboxConfig(isolation="off", max_disk_mb=5).build(Path("/x")).max_disk_bytes == 5 * 2**20


async def test_a_codex_shell_step_gets_nothing_and_the_row_says_how_it_was_isolated(
    tmp_path, host, monkeypatch
):
    monkeypatch.setenv("OPENAI_API_KEY", WORKER_KEY)
    probe = (
        f"cat {host.home}/.ray/auth_token {host.home}/.aws/credentials /proc/{os.getpid()}/environ "
        f"> loot.txt 2>&1; python3 -c '{CONNECT.strip()}' {host.gcs} {host.dashboard} >> loot.txt 2>&1;"
        f" id -un >> loot.txt; true"
    )
    task = Task.model_validate(
        {
            "id": "loot",
            "prompt": "look around",
            "model_script": [{"type": "shell", "command": probe}, {"type": "text", "text": "ok"}],
        }
    )
    async with session_context(tmp_path) as ctx:
        row = await run_session(SessionRequest("attack", task, 0, 1), ctx)
    assert row["status"] == "completed", row["error_message"]
    assert row["sandbox_isolation"] == FULL
    diff = row["workspace_diff"] or ""
    assert "+rollout-sandbox" in diff and f"+refused {host.gcs} 111" in diff, diff[-3000:]
    assert "connected" not in diff
    _no_secret(repr(row))

"""The local sandbox with real processes: environment, output, limits, paths, and above all process death."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from sandboxes import diskfs
from sandboxes.base import (
    TAIL_BYTES,
    ExecStep,
    SandboxError,
    SandboxLostError,
    SandboxSpec,
    SandboxStartError,
)
from sandboxes.environment import DEFAULT_PATH
from sandboxes.local import LocalSandbox, LocalSandboxProvider, reap_stale
from sandboxes.local_config import LocalSandboxConfig
from sandboxes.owner import hold
from sandboxes.proctree import read_proc
from tests.test_shared_root import dead_owner

REPO = Path(__file__).resolve().parents[1]
WAIT_S = 60.0  # safety bound on waiting for an event; never a timing assertion


# -- helpers ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Proc:
    """One process for good: a pid alone may be recycled, a pid with its start time may not."""

    pid: int
    start: int  # clock ticks since boot, field 22 of /proc/<pid>/stat


def _stat(pid: int) -> list[bytes] | None:
    try:
        data = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    return data[data.rindex(b")") + 2 :].split()


def _state(pid: int) -> str | None:
    fields = _stat(pid)
    return fields[0].decode() if fields else None


def identify(pid: int | str) -> Proc:
    fields = _stat(int(pid))
    assert fields is not None, f"process {pid} is gone"
    return Proc(int(pid), int(fields[19]))


def running(proc: Proc) -> bool:
    """Alive (not a zombie) and still the same process. Unlike its command line, this does not blink
    while the process is in the middle of an exec."""
    fields = _stat(proc.pid)
    return fields is not None and fields[0] not in (b"Z", b"X") and int(fields[19]) == proc.start


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


PF_KTHREAD = 0x00200000  # in field 9 of /proc/<pid>/stat: a kernel thread, whose command line is empty


def _settled_cmdline(pid: int) -> bytes:
    """The command line of ``pid``, read again while it reads empty on a live process: it does so in the
    middle of an exec (and of an exit, until the process is a zombie)."""
    deadline = time.monotonic() + WAIT_S
    while not (cmdline := _cmdline(pid)) and time.monotonic() < deadline:
        fields = _stat(pid)
        if fields is None or fields[0] in (b"Z", b"X") or int(fields[6]) & PF_KTHREAD:
            break
        time.sleep(0.01)  # polling a process through its exec, bounded
    return cmdline


def live_with(mark: str) -> list[int]:
    """Live (non-zombie) processes whose command line contains ``mark``: a sweep for strays, on top of
    the exact checks by ``running``. One in the middle of an exec is not missed."""
    found = []
    for name in os.listdir("/proc"):
        if (
            name.isdigit()
            and mark.encode() in _settled_cmdline(int(name))
            and _state(int(name)) not in (None, "Z", "X")
        ):
            found.append(int(name))
    return found


def new_mark() -> str:
    return f"rollout-test-{uuid.uuid4().hex}"


class Fifo:
    """A named pipe the sandboxed processes report to, read without blocking the event loop."""

    def __init__(self, path: Path) -> None:
        os.mkfifo(path)
        self.path = path
        self._r = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        # Our own writer keeps the pipe from reading as end-of-file between the sandbox's writers.
        self._w = os.open(path, os.O_WRONLY)
        self._buf = b""

    async def lines(self, n: int) -> list[str]:
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(WAIT_S):
            while self._buf.count(b"\n") < n:
                ready = asyncio.Event()
                loop.add_reader(self._r, ready.set)
                try:
                    await ready.wait()
                finally:
                    loop.remove_reader(self._r)
                try:
                    self._buf += os.read(self._r, 4096)
                except BlockingIOError:
                    pass
        *lines, self._buf = self._buf.split(b"\n", n)
        return [line.decode() for line in lines]

    def close(self) -> None:
        os.close(self._r)
        os.close(self._w)


async def wait_exit(pid: int) -> None:
    """Wait until ``pid`` (not necessarily our child) has exited."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    loop = asyncio.get_running_loop()
    exited = asyncio.Event()
    loop.add_reader(fd, exited.set)
    try:
        await asyncio.wait_for(exited.wait(), WAIT_S)
    finally:
        loop.remove_reader(fd)
        os.close(fd)


# Bash that prints "pid:start" of the shell running it (field 22 of its stat is the start time).
REPORT_SELF = 'read -r -a st < /proc/$$/stat; echo "$$:${st[21]}"'


def tree_script(mark: str, then: str) -> str:
    """Bash that starts four grandchildren that try to escape, waits until each reported its pid and start
    time, prints them, then runs ``then``: a setsid'd one, a nohup'd one, a double-forked orphan, and
    one that ignores SIGTERM."""
    report = f"{REPORT_SELF} >&3"
    return f"""
mkfifo "$TMPDIR/gc.fifo" && exec 3<>"$TMPDIR/gc.fifo"
setsid bash -c '{report}; exec -a {mark}-setsid sleep 300' &
nohup bash -c '{report}; exec -a {mark}-nohup sleep 300' >/dev/null 2>&1 &
( bash -c '{report}; exec -a {mark}-orphan sleep 300' & )
bash -c 'trap "" TERM; {report}; exec -a {mark}-noterm sleep 300' &
procs=""
for _ in 1 2 3 4; do read -r -u 3 proc; procs="$procs $proc"; done
echo "procs:$procs"
{then}
"""


def reported_procs(stdout: str) -> list[Proc]:
    line = next(line for line in stdout.splitlines() if line.startswith("procs:"))
    return [Proc(*map(int, item.split(":"))) for item in line.removeprefix("procs:").split()]


def spec(session_id: str | None = None, **kw: object) -> SandboxSpec:
    return SandboxSpec(run_id="run", session_id=session_id or uuid.uuid4().hex[:12], ttl_s=600, **kw)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "sandboxes"


@pytest.fixture
def provider(root: Path) -> LocalSandboxProvider:
    return LocalSandboxProvider(root, kill_grace_s=0.5)


@pytest.fixture
async def sandbox(provider: LocalSandboxProvider):
    sb = await provider.start(spec())
    yield sb
    await sb.stop()


# -- environment and layout ------------------------------------------------------------------------------
@pytest.mark.skipif(os.geteuid() != 0, reason="a sandbox's own filesystem is a mount: root only")
@pytest.mark.parametrize("keep", [False, True])
async def test_the_defaults_keep_a_sandboxs_files_on_its_own_filesystem(tmp_path: Path, keep: bool) -> None:
    """What its commands write and its user's account files are on the sandbox's tmpfs (one mount), not
    in inodes of the host's disk; a kept session's files outlive it where they were, and nothing stays
    mounted either way."""
    gateway = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # listening; nothing here connects
    gateway.bind(str(tmp_path / "gw.sock"))
    gateway.listen()
    provider = LocalSandboxConfig(keep=keep).build(tmp_path / "sb", (8, str(tmp_path / "gw.sock")))
    sandbox = await provider.start(spec())
    disk = sandbox.root / "disk"
    try:
        assert os.path.ismount(disk)
        files = [*sandbox.writable_dirs, str(disk / "passwd"), str(disk / "group")]
        assert {os.stat(path).st_dev for path in files} == {os.stat(disk).st_dev}
        assert os.stat(disk).st_dev != os.stat(sandbox.root).st_dev
        assert sorted(os.listdir(sandbox.root)) == ["disk", "logs", "run", "sandbox.json"]
        # `id -un` fails without a passwd entry for the sandbox's uid: its view finds the file there.
        res = await sandbox.exec(["sh", "-c", "echo mine > note && id -un"], timeout=30)
        assert res.exit_code == 0 and res.stdout_tail.strip(), res
        # Not kept, the session directory is a tmpfs too: its logs and descriptor on no disk's inode.
        assert os.path.ismount(sandbox.root) is not keep
        session = [res.stdout_path, str(sandbox.descriptor_path)]
        assert ({os.stat(path).st_dev for path in session} == {os.stat(sandbox.root.parent).st_dev}) is keep
    finally:
        await sandbox.stop()
        await provider.aclose()
        gateway.close()
    assert str(sandbox.root) not in Path("/proc/self/mountinfo").read_text()
    if keep:
        assert Path(sandbox.workdir, "note").read_text() == "mine\n"
        assert not os.path.ismount(disk)
    else:
        assert not sandbox.root.exists()


def _entry_inode(path: Path) -> int:
    """The inode of ``path``'s directory entry on its parent's filesystem, not of what is mounted on it."""
    with os.scandir(path.parent) as entries:
        return next(entry.inode() for entry in entries if entry.name == path.name)


@pytest.mark.skipif(os.geteuid() != 0, reason="a session directory of its own is a mount: root only")
async def test_an_emptied_session_directory_becomes_a_later_sessions_and_none_outlives_the_provider(
    tmp_path: Path,
) -> None:
    """The directory a stopped session's tmpfs was mounted on is renamed into a later session's place (on
    the host's disk no inode made or freed a session): that session starts empty, whatever the one before
    wrote; a taken session's name is still refused; the provider's close removes what it kept."""
    gateway = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # listening; nothing here connects
    gateway.bind(str(tmp_path / "gw.sock"))
    gateway.listen()
    provider = LocalSandboxConfig(keep=False).build(tmp_path / "sb", (8, str(tmp_path / "gw.sock")))
    first = await provider.start(spec("first"))
    mount_point = _entry_inode(first.root)
    res = await first.exec(["sh", "-c", "echo x > note && mkdir -p deep/er && echo y > $HOME/h"], timeout=30)
    assert res.exit_code == 0, res
    await first.write_file("logs/extra", b"z")
    await first.stop()
    run_dir = first.root.parent
    assert [(e.name.endswith(diskfs.SPARE_SUFFIX), e.inode()) for e in os.scandir(run_dir)] == [
        (True, mount_point)
    ]
    second = await provider.start(spec("second"))
    try:
        assert _entry_inode(second.root) == mount_point and os.path.ismount(second.root)
        assert sorted(os.listdir(second.root)) == ["disk", "logs", "run", "sandbox.json"]
        assert os.listdir(second.workdir) == [] and os.listdir(second.root / "logs") == []
        assert sorted(os.listdir(run_dir)) == ["second"]
        with pytest.raises(SandboxStartError, match="already exists"):
            await provider.start(spec("second"))
    finally:
        await second.stop()
        await provider.aclose()
        gateway.close()
    assert os.listdir(run_dir) == []
    assert str(run_dir) not in Path("/proc/self/mountinfo").read_text()


async def test_layout_and_descriptor(sandbox: LocalSandbox, root: Path) -> None:
    assert sandbox.id.startswith("local-")
    session = root / "run" / sandbox.spec.session_id
    assert sandbox.workdir == str(session / "work")
    assert sandbox.home == str(session / "home")
    for sub in ("work", "home", "tmp", "logs"):
        assert (session / sub).is_dir()
    on_disk = json.loads((session / "sandbox.json").read_text())
    assert on_disk == sandbox.descriptor()
    assert on_disk["provider"] == "local"
    assert on_disk["owner_pid"] == os.getpid()
    assert on_disk["ttl_deadline"] > on_disk["created_at"]
    assert on_disk["supervisor_pids"] == []


async def test_copy_in_keeps_modes_times_and_links_and_refuses_a_fifo(
    sandbox: LocalSandbox, tmp_path: Path
) -> None:
    src = tmp_path / "src"
    (src / "bin").mkdir(parents=True)
    (src / "bin" / "run.sh").write_text("#!/bin/sh\necho hi\n")
    (src / "bin" / "run.sh").chmod(0o750)
    os.utime(src / "bin" / "run.sh", (1_000_000_000, 1_000_000_000))
    (src / "link").symlink_to("bin/run.sh")
    await sandbox.copy_in(src)
    work = Path(sandbox.workdir)
    copied = (work / "bin" / "run.sh").stat()
    assert (work / "bin" / "run.sh").read_text() == "#!/bin/sh\necho hi\n"
    assert copied.st_mode & 0o7777 == 0o750 and copied.st_mtime == 1_000_000_000
    assert os.readlink(work / "link") == "bin/run.sh"
    os.mkfifo(src / "pipe")
    with pytest.raises(SandboxError, match="not a regular file"):
        await sandbox.copy_in(src, "elsewhere")


async def test_start_refuses_a_taken_session_or_a_bad_spec(
    provider: LocalSandboxProvider, root: Path
) -> None:
    sb = await provider.start(spec("taken"))
    try:
        with pytest.raises(SandboxStartError, match="already exists"):
            await provider.start(spec("taken"))
    finally:
        await sb.stop()
    with pytest.raises(SandboxStartError):
        await provider.start(spec("bad-env", env={"A=B": "x"}))
    assert not (root / "run" / "bad-env").exists()
    with pytest.raises(SandboxStartError):
        await provider.start(spec(".."))


async def test_environment_is_built_not_inherited(provider: LocalSandboxProvider, monkeypatch) -> None:
    secrets = {
        "OPENAI_API_KEY": "sk-leak-openai",
        "ANTHROPIC_API_KEY": "sk-leak-anthropic",
        "AWS_ACCESS_KEY_ID": "AKIALEAK",
        "AWS_SECRET_ACCESS_KEY": "leak-aws-secret",
        "GITHUB_TOKEN": "ghp_leak",
        "MY_SERVICE_SECRET": "leak-secret",
        "DB_KEY": "leak-key",
    }
    for key, value in secrets.items():
        monkeypatch.setenv(key, value)
    sb = await provider.start(spec(env={"FROM_SPEC": "spec", "SHARED": "spec"}))
    try:
        res = await sb.exec(["env"], timeout=30, env={"FROM_EXEC": "exec", "SHARED": "exec"})
    finally:
        await sb.stop()
    assert res.exit_code == 0
    for key, value in secrets.items():
        assert key not in res.stdout_tail
        assert value not in res.stdout_tail
    env = dict(line.split("=", 1) for line in res.stdout_tail.splitlines())
    assert set(env) == {
        "PATH", "HOME", "TMPDIR", "USER", "LOGNAME", "LANG", "LC_ALL", "TERM", "TZ", "SHELL",
        "PYTHONDONTWRITEBYTECODE", "XDG_CONFIG_HOME", "XDG_DATA_HOME", "XDG_CACHE_HOME", "XDG_STATE_HOME",
        "ROLLOUT_SANDBOX", "FROM_SPEC", "FROM_EXEC", "SHARED",
    }  # fmt: skip
    assert env["PATH"] == DEFAULT_PATH == "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    assert env["HOME"] == sb.home
    assert env["TMPDIR"] == str(sb.root / "tmp")
    assert env["XDG_CONFIG_HOME"] == f"{sb.home}/.config"
    assert (env["LANG"], env["LC_ALL"], env["TERM"], env["TZ"]) == ("C.UTF-8", "C.UTF-8", "dumb", "UTC")
    assert (env["FROM_SPEC"], env["FROM_EXEC"], env["SHARED"]) == ("spec", "exec", "exec")


async def test_a_same_second_same_size_fix_is_seen(sandbox: LocalSandbox) -> None:
    # Run, fix without changing the size, run again: a bytecode cache from the first run, checked by
    # mtime in whole seconds and size, would hide the fix. None is written, so none can.
    await sandbox.write_file("calc.py", b"def add(a, b):\n    return a - b\n")
    await sandbox.write_file("check.py", b"from calc import add\nprint(add(2, 3))\n")
    script = "python3 check.py && sed -i 's/a - b/a + b/' calc.py && python3 check.py"
    res = await sandbox.exec(["sh", "-c", script], timeout=30)
    assert res.exit_code == 0, res.stderr_tail
    assert res.stdout_tail.split() == ["-1", "5"]
    assert not (Path(sandbox.workdir) / "__pycache__").exists()


async def test_home_and_tmp_are_private(sandbox: LocalSandbox) -> None:
    res = await sandbox.exec(["bash", "-c", "cd && pwd && touch dotfile && mktemp"], timeout=30)
    home, tmpfile = res.stdout_tail.split()
    assert home == sandbox.home != os.environ.get("HOME")
    assert (Path(sandbox.home) / "dotfile").exists()
    assert Path(tmpfile).parent == sandbox.root / "tmp"


async def test_path_prefixes(root: Path) -> None:
    provider = LocalSandboxProvider(root, path_prefixes=["/opt/harness/bin"])
    sb = await provider.start(spec())
    try:
        res = await sb.exec(["printenv", "PATH"], timeout=30)
    finally:
        await sb.stop()
    assert (
        res.stdout_tail.strip()
        == "/opt/harness/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    )


# -- results and output ----------------------------------------------------------------------------------


async def test_exit_code_tails_and_files(sandbox: LocalSandbox) -> None:
    res = await sandbox.exec(["bash", "-c", "echo out; echo err >&2; exit 3"], timeout=30, name="harness")
    assert (res.exit_code, res.signal, res.timed_out) == (3, None, False)
    assert (res.stdout_tail, res.stderr_tail) == ("out\n", "err\n")
    assert (res.stdout_bytes, res.stderr_bytes) == (4, 4)
    assert res.stdout_path == str(sandbox.root / "logs" / "harness.stdout")
    assert Path(res.stdout_path).read_text() == "out\n"
    assert Path(res.stderr_path or "").read_text() == "err\n"
    assert res.duration_s >= 0


async def test_repeated_names_keep_every_log(sandbox: LocalSandbox) -> None:
    first = await sandbox.exec(["echo", "one"], timeout=30, name="step")
    second = await sandbox.exec(["echo", "two"], timeout=30, name="step")
    assert first.stdout_path != second.stdout_path
    assert Path(first.stdout_path or "").read_text() == "one\n"
    assert Path(second.stdout_path or "").read_text() == "two\n"
    with pytest.raises(SandboxError):
        await sandbox.exec(["true"], timeout=30, name="../escape")


async def test_death_by_signal(sandbox: LocalSandbox) -> None:
    res = await sandbox.exec(["bash", "-c", "kill -KILL $$"], timeout=30)
    assert (res.exit_code, res.signal, res.timed_out) == (None, signal.SIGKILL, False)


async def test_missing_command_is_127(sandbox: LocalSandbox) -> None:
    res = await sandbox.exec(["definitely-not-a-command-xyz"], timeout=30)
    assert res.exit_code == 127
    assert "definitely-not-a-command-xyz" in res.stderr_tail


async def test_a_command_starts_with_stdio_only_default_signals_and_a_group_of_its_own(
    sandbox: LocalSandbox,
) -> None:
    # `ls` lists the descriptors of the shell, which opens none of its own for these lines.
    script = 'grep SigIgn /proc/$$/status; read -r -a st < /proc/$$/stat; echo "$$ ${st[4]}"; '
    script += "ls /proc/$$/fd; exit 0"
    res = await sandbox.exec(["bash", "-c", script], timeout=30)
    ignored, ids, *fds = res.stdout_tail.splitlines()
    assert fds == ["0", "1", "2"]  # nothing of the supervisor's leaks into the command
    sigign = int(ignored.split()[1], 16)
    assert not sigign & (1 << (signal.SIGPIPE - 1) | 1 << (signal.SIGXFSZ - 1))
    pid, pgid = ids.split()
    assert pid == pgid


async def test_the_command_is_looked_up_on_its_own_path(sandbox: LocalSandbox, tmp_path: Path) -> None:
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "true").write_text("#!/bin/sh\nexit 9\n")  # not executable: skipped, as execvp does
    res = await sandbox.exec(["true"], timeout=30, env={"PATH": f"{shadow}:/usr/bin:/bin"})
    assert res.exit_code == 0
    res = await sandbox.exec(["true"], timeout=30, env={"PATH": str(shadow)})
    assert res.exit_code == 126 and "true" in res.stderr_tail


async def test_stdin_is_fed_then_closed(sandbox: LocalSandbox) -> None:
    res = await sandbox.exec(["cat"], timeout=30, stdin=b"prompt\x00bytes")
    assert res.stdout_tail == "prompt\x00bytes"
    # Without stdin the command reads /dev/null: cat ends at once instead of waiting for input.
    res = await sandbox.exec(["cat"], timeout=30)
    assert (res.exit_code, res.timed_out, res.stdout_bytes) == (0, False, 0)


async def test_output_is_capped_and_tails_bounded(root: Path) -> None:
    provider = LocalSandboxProvider(root, output_cap_bytes=64 * 1024)
    sb = await provider.start(spec())
    try:
        script = "head -c 1000000 /dev/zero; head -c 300000 /dev/zero >&2; printf END"
        res = await sb.exec(["bash", "-c", script], timeout=60)
    finally:
        await sb.stop()
    assert res.exit_code == 0
    assert (res.stdout_bytes, res.stderr_bytes) == (1_000_003, 300_000)
    assert os.path.getsize(res.stdout_path or "") == 64 * 1024
    assert os.path.getsize(res.stderr_path or "") == 64 * 1024
    assert len(res.stdout_tail) == TAIL_BYTES
    assert res.stdout_tail.endswith("\0END")  # the tail is the end of the output, not of the capped file


async def test_invalid_utf8_output(sandbox: LocalSandbox) -> None:
    # 18,011 bytes in all: the last TAIL_BYTES of them begin in the middle of a two-byte character.
    script = r"for i in $(seq 9000); do printf '\xc3\xa9'; done; printf 'ok \xff\xfe\xc3 end!'"
    res = await sandbox.exec(["bash", "-c", script], timeout=60)
    assert (res.exit_code, res.stdout_bytes) == (0, 18_011)
    assert res.stdout_tail.startswith("\ufffdé")
    assert res.stdout_tail.endswith("éok \ufffd\ufffd\ufffd end!")


async def test_resource_limits(provider: LocalSandboxProvider) -> None:
    sb = await provider.start(spec(memory_limit_mb=256))
    try:
        res = await sb.exec(["bash", "-c", "ulimit -c; ulimit -n; ulimit -v"], timeout=30)
    finally:
        await sb.stop()
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    nofile = 65_536 if hard == resource.RLIM_INFINITY else min(65_536, hard)
    assert res.stdout_tail.split() == ["0", str(nofile), str(256 * 1024)]


async def test_a_spare_server_waits_at_the_lowest_priority_and_its_sandbox_runs_at_the_normal_one(
    provider: LocalSandboxProvider,
) -> None:
    first = await provider.start(spec())
    try:
        await first.exec(["true"], timeout=30)  # a running command asks for the next sandbox's server
        assert provider._spare is not None
        spare = await provider._spare[1]
        assert os.getpriority(os.PRIO_PROCESS, spare.pid) == 19
        second = await provider.start(spec())
        try:
            res = await second.exec(["nice"], timeout=30)  # prints the command's niceness
        finally:
            await second.stop()
    finally:
        await first.stop()
    assert second._server is spare
    assert res.stdout_tail.strip() == "0"


_NO_NICE_SCRIPT = """
import asyncio, os, sys
from pathlib import Path
from sandboxes.base import SandboxSpec
from sandboxes.local import LocalSandboxProvider

async def main():
    provider = LocalSandboxProvider(Path(sys.argv[1]))
    first = await provider.start(SandboxSpec(run_id="r", session_id="s1", ttl_s=60))
    await first.exec(["true"], timeout=30)
    spare = await provider._spare[1]
    spare_nice = os.getpriority(os.PRIO_PROCESS, spare.pid)
    second = await provider.start(SandboxSpec(run_id="r", session_id="s2", ttl_s=60))
    res = await second.exec(["nice"], timeout=30)
    later = os.getpriority(os.PRIO_PROCESS, (await provider._spare[1]).pid)
    print(spare_nice, second._server is spare, res.stdout_tail.strip(), later)
    await second.stop()
    await first.stop()
    await provider.aclose()

asyncio.run(main())
"""


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root and setpriv")
def test_without_cap_sys_nice_a_spare_is_not_used_and_later_spares_keep_the_normal_priority(
    tmp_path: Path,
) -> None:
    """A worker that may lower a niceness but not raise it back: the spare it lowered cannot serve a
    sandbox at the normal priority, so the sandbox gets a new server, and no later spare is lowered."""
    drop = ["setpriv", "--inh-caps=-sys_nice", "--bounding-set=-sys_nice"]
    out = subprocess.run(
        [*drop, sys.executable, "-c", _NO_NICE_SCRIPT, str(tmp_path / "sandboxes")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parent.parent,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    # the spare was lowered; the second sandbox runs on a server of its own, at the normal priority
    assert out.stdout.split() == ["19", "False", "0", "0"]


async def test_cwd_is_workdir_or_inside(sandbox: LocalSandbox) -> None:
    await sandbox.write_file("sub/dir/f.txt", b"x")
    res = await sandbox.exec(["pwd"], timeout=30)
    assert res.stdout_tail.strip() == sandbox.workdir
    res = await sandbox.exec(["pwd"], timeout=30, cwd="sub/dir")
    assert res.stdout_tail.strip() == f"{sandbox.workdir}/sub/dir"
    with pytest.raises(SandboxError):
        await sandbox.exec(["pwd"], timeout=30, cwd="../../..")


# -- process death ---------------------------------------------------------------------------------------


async def test_timeout_kills_the_whole_tree(sandbox: LocalSandbox) -> None:
    mark = new_mark()
    script = tree_script(mark, f"exec -a {mark}-main sleep 300")
    res = await sandbox.exec(["bash", "-c", script], timeout=5)
    assert res.timed_out
    assert res.exit_code is None and res.signal == signal.SIGTERM
    procs = reported_procs(res.stdout_tail)  # proves all four were running before the deadline
    assert len(procs) == 4
    assert [p for p in procs if running(p)] == []
    assert live_with(mark) == []


async def test_exit_kills_what_the_command_left_behind(sandbox: LocalSandbox) -> None:
    mark = new_mark()
    res = await sandbox.exec(["bash", "-c", tree_script(mark, "exit 0")], timeout=60)
    assert (res.exit_code, res.timed_out) == (0, False)
    procs = reported_procs(res.stdout_tail)
    assert len(procs) == 4
    assert [p for p in procs if running(p)] == []
    assert live_with(mark) == []


async def test_outside_kill_when_the_supervisor_is_stuck(root: Path) -> None:
    # The command freezes its own supervisor, so only the sandbox's outer deadline can end it.
    sb = await LocalSandboxProvider(root, kill_grace_s=0.2, supervisor_slack_s=1.0).start(spec())
    mark = new_mark()
    script = (
        f"setsid bash -c '{REPORT_SELF} > gc; exec -a {mark}-gc sleep 300' & "
        "until [ -s gc ]; do :; done; "
        f"kill -STOP $PPID; exec -a {mark} sleep 300"
    )
    try:
        res = await sb.exec(["bash", "-c", script], timeout=3)
    finally:
        await sb.stop()
    assert (res.timed_out, res.exit_code, res.signal) == (True, None, signal.SIGKILL)
    gc = Proc(*map(int, Path(sb.workdir, "gc").read_text().split(":")))
    assert not running(gc)
    assert live_with(mark) == []


async def test_a_step_before_the_command_runs_to_its_end_first(sandbox: LocalSandbox) -> None:
    """One exec, two commands: the step's own output files, environment and exit code, then the command,
    which sees what the step left, and none of the step's variables."""
    step = ExecStep(
        argv=["bash", "-c", 'echo "step $STEP_ONLY"; echo step-err >&2; echo left > left.txt; exit 4'],
        timeout=30,
        name="first",
        env={"STEP_ONLY": "yes"},
    )
    res = await sandbox.exec(
        ["bash", "-c", 'cat left.txt; echo "main ${STEP_ONLY:-unset}"'], timeout=30, name="then", before=step
    )
    assert (res.exit_code, res.stdout_tail) == (0, "left\nmain unset\n")
    assert res.before is not None
    assert (res.before.exit_code, res.before.stdout_tail, res.before.stderr_tail) == (
        4,
        "step yes\n",
        "step-err\n",
    )
    assert res.before.stdout_path == str(sandbox.root / "logs" / "first.stdout")
    assert Path(res.before.stdout_path).read_text() == "step yes\n"
    assert res.stdout_path == str(sandbox.root / "logs" / "then.stdout")
    plain = await sandbox.exec(["true"], timeout=30)
    assert plain.before is None


async def test_a_step_that_runs_past_its_timeout_is_ended_and_the_command_still_runs(
    sandbox: LocalSandbox,
) -> None:
    mark = new_mark()
    step = ExecStep(argv=["bash", "-c", f"exec -a {mark} sleep 300"], timeout=1, name="slow")
    res = await sandbox.exec(["echo", "graded"], timeout=30, before=step)
    assert res.before is not None
    assert (res.before.timed_out, res.before.exit_code, res.before.signal) == (True, None, signal.SIGTERM)
    assert (res.exit_code, res.stdout_tail) == (0, "graded\n")
    assert live_with(mark) == []


async def test_stop_during_the_step_runs_no_command(sandbox: LocalSandbox, tmp_path: Path) -> None:
    fifo = Fifo(tmp_path / "ready.fifo")
    step = ExecStep(argv=["bash", "-c", f"echo up > {fifo.path}; sleep 300"], timeout=300, name="step")
    task = asyncio.create_task(sandbox.exec(["bash", "-c", "echo ran > ran.txt"], timeout=300, before=step))
    try:
        await fifo.lines(1)
    finally:
        fifo.close()
    await sandbox.stop()
    with pytest.raises(SandboxLostError):
        await task
    assert not Path(sandbox.workdir, "ran.txt").exists()


async def test_stop_kills_a_running_exec_and_is_idempotent(sandbox: LocalSandbox, tmp_path: Path) -> None:
    mark = new_mark()
    fifo = Fifo(tmp_path / "ready.fifo")
    script = (
        f"setsid bash -c 'echo gc $$ > {fifo.path}; exec -a {mark}-gc sleep 300' & "
        f"echo main $$ $PPID > {fifo.path}; exec -a {mark}-main sleep 300"
    )
    task = asyncio.create_task(sandbox.exec(["bash", "-c", script], timeout=300))
    try:
        lines = sorted(await fifo.lines(2))
    finally:
        fifo.close()
    (_gc, gc_pid), (_main, main_pid, supervisor_pid) = (line.split() for line in lines)
    procs = [identify(gc_pid), identify(main_pid)]
    assert sandbox.descriptor()["supervisor_pids"] == [int(supervisor_pid)]
    assert all(running(p) for p in procs)

    await sandbox.stop()
    with pytest.raises(SandboxLostError):
        await task
    assert [p for p in procs if running(p)] == []
    assert live_with(mark) == []
    assert _state(int(supervisor_pid)) in (None, "Z")
    assert not sandbox.descriptor_path.exists()
    assert sandbox.root.is_dir()  # kept as evidence by default
    await sandbox.stop()
    with pytest.raises(SandboxError):
        await sandbox.exec(["true"], timeout=30)


async def test_cancelled_exec_leaves_nothing(sandbox: LocalSandbox, tmp_path: Path) -> None:
    mark = new_mark()
    fifo = Fifo(tmp_path / "ready.fifo")
    script = f"setsid bash -c 'echo $$ > {fifo.path}; exec -a {mark}-gc sleep 300' & exec -a {mark} sleep 300"
    task = asyncio.create_task(sandbox.exec(["bash", "-c", script], timeout=300))
    try:
        gc = identify((await fifo.lines(1))[0])
    finally:
        fifo.close()
    assert running(gc)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not running(gc)
    assert live_with(mark) == []


async def test_stop_without_keep_removes_the_directory(root: Path) -> None:
    provider = LocalSandboxProvider(root, keep=False)
    sb = await provider.start(spec())
    await sb.exec(["true"], timeout=30)
    await sb.write_file("deep/er/file.txt", b"x")
    await sb.stop()
    assert not sb.root.exists()  # moved aside at once; deleted off the session's path
    await provider.aclose()  # which waits for the deletions it started
    assert list(sb.root.parent.iterdir()) == []


async def test_reap_removes_a_directory_a_dead_worker_left_half_deleted(root: Path) -> None:
    aside = root / "run" / "gone.removing"
    (aside / "home" / "deep").mkdir(parents=True)
    (aside / "home" / "deep" / "file").write_text("x")
    live = root / "run" / "alive.removing"  # a session's own name: it has a descriptor, so it is kept
    live.mkdir()
    (live / "sandbox.json").write_text("{}")
    # Named after whose deletion it is: a live owner's is left to it, a dead one's is finished.
    deleting = root / "run" / f"s2.{hold(root)}.removing"
    abandoned = root / "run" / f"s3.{dead_owner(root)}.removing"
    for path in (deleting, abandoned):
        (path / "home").mkdir(parents=True)
    # The empty mount points a worker kept for later sessions (diskfs.MountPoints): the same.
    spare = root / "run" / f"0a1b.{hold(root)}{diskfs.SPARE_SUFFIX}"
    orphaned_spare = root / "run" / f"2c3d.{dead_owner(root)}{diskfs.SPARE_SUFFIX}"
    for path in (spare, orphaned_spare):
        path.mkdir()
    assert await asyncio.to_thread(reap_stale, root, "run") == []
    assert not aside.exists() and live.exists()
    assert deleting.exists() and not abandoned.exists()
    assert spare.exists() and not orphaned_spare.exists()


async def test_delete_removes_the_directory(sandbox: LocalSandbox) -> None:
    await sandbox.delete()
    assert not sandbox.root.exists()


# -- a dead owner, and reaping ---------------------------------------------------------------------------

OWNER = """
import asyncio, sys
from pathlib import Path
from sandboxes.base import SandboxSpec
from sandboxes.local import LocalSandboxProvider

async def main() -> None:
    provider = LocalSandboxProvider(Path(sys.argv[1]), keep=sys.argv[4] == "keep")
    sandbox = await provider.start(SandboxSpec(run_id="run", session_id=sys.argv[2], ttl_s=600))
    await sandbox.exec(["bash", "-c", sys.argv[3]], timeout=300)

asyncio.run(main())
"""


async def _start_owner(
    root: Path, session_id: str, script: str, tmp_path: Path, *, keep: bool = True
) -> asyncio.subprocess.Process:
    """A separate worker process that owns a sandbox with one long exec running."""
    with open(tmp_path / "owner.log", "wb") as errors:
        return await asyncio.create_subprocess_exec(
            sys.executable, "-c", OWNER, str(root), session_id, script, "keep" if keep else "",
            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL, stderr=errors,
        )  # fmt: skip


def _owner_script(mark: str, fifo: Fifo) -> str:
    return (
        f"setsid bash -c 'echo gc $$ > {fifo.path}; exec -a {mark}-gc sleep 300' & "
        f"nohup bash -c 'echo nohup $$ > {fifo.path}; exec -a {mark}-nohup sleep 300' >/dev/null 2>&1 & "
        f"echo main $$ $PPID > {fifo.path}; exec -a {mark}-main sleep 300"
    )


async def _owner_tree(fifo: Fifo) -> tuple[list[Proc], int]:
    """The owner's command tree and the pid of its supervisor, once all of them are running."""
    try:
        lines = {line.split()[0]: line.split()[1:] for line in await fifo.lines(3)}
    finally:
        fifo.close()
    procs = [identify(lines["main"][0]), identify(lines["gc"][0]), identify(lines["nohup"][0])]
    return procs, int(lines["main"][1])


async def test_owner_death_kills_the_tree_and_reap_cleans_up(root: Path, tmp_path: Path) -> None:
    """A dead owner's sandbox, not kept: its processes end, and a reaper takes away its descriptor and
    its directory (as root, a tmpfs of its own, unmounted)."""
    mark, session_id = new_mark(), "owned"
    fifo = Fifo(tmp_path / "ready.fifo")
    owner = await _start_owner(root, session_id, _owner_script(mark, fifo), tmp_path, keep=False)
    procs, supervisor_pid = await _owner_tree(fifo)
    descriptor = root / "run" / session_id / "sandbox.json"
    # On disk the root is the sandbox's supervisor server; each command's supervisor is its child.
    server_pid = json.loads(descriptor.read_text())["server_pid"]
    assert read_proc(supervisor_pid).ppid == server_pid
    assert all(running(p) for p in procs)

    owner.kill()
    await owner.wait()
    # PR_SET_PDEATHSIG: the supervisor learns of its owner's death and takes its tree down with it.
    await wait_exit(supervisor_pid)
    assert [p for p in procs if running(p)] == []
    assert live_with(mark) == []

    assert await asyncio.to_thread(reap_stale, root) == [f"local-{session_id}"]
    assert not descriptor.exists()
    assert not descriptor.parent.exists()
    assert str(root) not in Path("/proc/self/mountinfo").read_text()
    assert await asyncio.to_thread(reap_stale, root) == []


async def test_reap_finds_processes_that_lost_their_supervisor(root: Path, tmp_path: Path) -> None:
    mark, session_id = new_mark(), "orphaned"
    fifo = Fifo(tmp_path / "ready.fifo")
    owner = await _start_owner(root, session_id, _owner_script(mark, fifo), tmp_path)
    procs, supervisor_pid = await _owner_tree(fifo)
    # The worst case: the supervisor dies by SIGKILL first, so nothing of ours is left to kill the tree.
    os.kill(supervisor_pid, signal.SIGKILL)
    await wait_exit(supervisor_pid)
    with contextlib.suppress(ProcessLookupError):  # it may have exited already, on SandboxLostError
        owner.kill()
    await owner.wait()
    assert all(running(p) for p in procs)

    assert await asyncio.to_thread(reap_stale, root, "run") == [f"local-{session_id}"]
    assert [p for p in procs if running(p)] == []
    assert live_with(mark) == []
    assert not (root / "run" / session_id / "sandbox.json").exists()


async def test_reap_waits_for_the_ttl_of_a_live_owner(
    sandbox: LocalSandbox, root: Path, tmp_path: Path
) -> None:
    mark = new_mark()
    fifo = Fifo(tmp_path / "ready.fifo")
    script = f"setsid bash -c 'echo $$ > {fifo.path}; exec -a {mark}-gc sleep 300' & exec -a {mark} sleep 300"
    task = asyncio.create_task(sandbox.exec(["bash", "-c", script], timeout=300))
    try:
        gc = identify((await fifo.lines(1))[0])
    finally:
        fifo.close()

    assert await asyncio.to_thread(reap_stale, root) == []
    assert running(gc)
    assert sandbox.descriptor_path.exists()

    past_ttl = time.time() + sandbox.spec.ttl_s + 1
    assert await asyncio.to_thread(reap_stale, root, now=past_ttl) == [sandbox.id]
    with pytest.raises(SandboxLostError):
        await task
    assert not running(gc)
    assert live_with(mark) == []
    assert not sandbox.descriptor_path.exists()  # and the finished exec did not write it back
    with pytest.raises(SandboxLostError):
        await sandbox.exec(["true"], timeout=30)


async def test_reap_leaves_other_hosts_and_unreadable_descriptors(root: Path) -> None:
    other = root / "run" / "elsewhere" / "sandbox.json"
    other.parent.mkdir(parents=True)
    other.write_text(json.dumps({"id": "local-elsewhere", "marker": "m", "host": "another-host",
                                 "owner_pid": 1, "ttl_deadline": 0}))  # fmt: skip
    broken = root / "run" / "broken" / "sandbox.json"
    broken.parent.mkdir(parents=True)
    broken.write_text("{not json")
    assert await asyncio.to_thread(reap_stale, root) == []
    assert other.exists() and broken.exists()


# -- paths -----------------------------------------------------------------------------------------------


async def test_write_and_read_inside(sandbox: LocalSandbox) -> None:
    await sandbox.write_file("a/b/c.txt", b"hello world", mode=0o600)
    path = Path(sandbox.workdir, "a/b/c.txt")
    assert path.read_bytes() == b"hello world"
    assert path.stat().st_mode & 0o777 == 0o600
    assert await sandbox.read_file("a/b/c.txt", 5) == b"hello"
    assert await sandbox.read_file(str(path), 100) == b"hello world"
    await sandbox.write_file(f"{sandbox.home}/.config/tool.json", b"{}")  # absolute, inside the root
    assert await sandbox.read_file(f"{sandbox.home}/.config/tool.json", 10) == b"{}"
    with pytest.raises(FileNotFoundError):
        await sandbox.read_file("missing.txt", 10)


# A small tree is copied on the event loop, a large one in a thread.
@pytest.mark.parametrize("files", [3, 200])
async def test_copy_in_small_and_large_trees(sandbox: LocalSandbox, tmp_path: Path, files: int) -> None:
    src = tmp_path / "src"
    for i in range(files):
        (src / f"d{i % 7}").mkdir(parents=True, exist_ok=True)
        (src / f"d{i % 7}" / f"f{i}.txt").write_text(f"{i}\n")
    (src / "link").symlink_to("d0/f0.txt")
    await sandbox.copy_in(src)
    copied = sorted(p.relative_to(sandbox.workdir) for p in Path(sandbox.workdir).rglob("*"))
    assert copied == sorted(p.relative_to(src) for p in src.rglob("*"))
    assert Path(sandbox.workdir, f"d{(files - 1) % 7}", f"f{files - 1}.txt").read_text() == f"{files - 1}\n"
    assert os.readlink(Path(sandbox.workdir, "link")) == "d0/f0.txt"
    await sandbox.write_file("big.bin", b"x" * (1 << 20))  # past the inline size: written in a thread
    assert Path(sandbox.workdir, "big.bin").stat().st_size == 1 << 20


async def test_path_escapes_are_refused(sandbox: LocalSandbox, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("secret")
    os.symlink(outside, Path(sandbox.workdir, "link"))
    os.symlink(outside / "secret.txt", Path(sandbox.workdir, "secret-link"))
    # Through /proc's links: the worker's own root, and an object that has no path (a pipe of the worker).
    os.symlink(f"/proc/self/root{outside}/secret.txt", Path(sandbox.workdir, "proc-link"))
    read_end, write_end = os.pipe()
    os.symlink(f"/proc/self/fd/{read_end}", Path(sandbox.workdir, "pipe-link"))
    Path(sandbox.workdir, "sub").mkdir()
    Path(sandbox.workdir, "sub", "mine.txt").write_text("mine")
    os.symlink("sub/mine.txt", Path(sandbox.workdir, "inner-link"))

    escapes = ("link/secret.txt", "secret-link", "proc-link", "pipe-link", "sub/../link/secret.txt")
    try:
        for path in ("../../../escape.txt", str(outside / "new.txt"), "link/new.txt", "/etc/x", *escapes):
            with pytest.raises(SandboxError):
                await sandbox.write_file(path, b"x")
        for path in ("../../../../etc/passwd", "/etc/passwd", *escapes):
            with pytest.raises(SandboxError):
                await sandbox.read_file(path, 100)
    finally:
        os.close(read_end)
        os.close(write_end)
    assert await sandbox.read_file("inner-link", 100) == b"mine"
    assert await sandbox.read_file("sub/../inner-link", 100) == b"mine"
    assert sorted(os.listdir(outside)) == ["secret.txt"]
    assert (outside / "secret.txt").read_text() == "secret"
    assert not (sandbox.root.parent / "escape.txt").exists()


async def test_read_file_refuses_a_fifo(sandbox: LocalSandbox) -> None:
    os.mkfifo(Path(sandbox.workdir, "pipe"))
    with pytest.raises(SandboxError):
        await sandbox.read_file("pipe", 10)

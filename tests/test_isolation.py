"""PID and filesystem isolation of local sandboxes (sandboxes/isolation.py), with real namespaces.

Each test needs what it isolates with (a PID namespace, bwrap, a network namespace) and skips, saying
why, on a host that cannot make it."""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import signal
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, nullcontext
from pathlib import Path
from typing import Any
from unittest import mock
from urllib.parse import urlsplit

import pydantic
import pytest
import yaml

from harnesses.gateway import Gateway
from harnesses.testing.scripted_model import ScriptedModel
from sandboxes import isolation, netns
from sandboxes.base import SandboxLostError, SandboxSpec
from sandboxes.local import LocalSandboxProvider
from sandboxes.local_config import LocalSandboxConfig
from tests.conftest import processes_under
from tests.test_local_sandbox import Fifo, live_with, new_mark, tree_script, wait_exit


def _netns_unavailable() -> str | None:
    try:
        netns.check_available()
    except netns.IsolationUnavailable as exc:
        return str(exc)
    return None


needs_pids = pytest.mark.skipif(
    isolation.pid_namespace_unavailable() is not None, reason=str(isolation.pid_namespace_unavailable())
)
needs_bwrap = pytest.mark.skipif(
    isolation.readonly_unavailable() is not None, reason=str(isolation.readonly_unavailable())
)
needs_view = pytest.mark.skipif(
    isolation.filesystem_unavailable() is not None, reason=str(isolation.filesystem_unavailable())
)
needs_netns = pytest.mark.skipif(_netns_unavailable() is not None, reason=str(_netns_unavailable()))
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="only root holds the capabilities to give up")

# Lists the numeric entries of /proc, one line of space-separated pids.
LIST_PIDS = [
    sys.executable,
    "-c",
    "import os; print(*sorted(int(n) for n in os.listdir('/proc') if n.isdigit()))",
]


@asynccontextmanager
async def _sandbox(tmp_path: Path, via_bwrap: bool = False, **provider_kw: Any) -> AsyncIterator[Any]:
    """A sandbox of ``provider_kw``; ``via_bwrap``: its view made by bubblewrap, as on a host without
    root, where root would make it with its own mounts."""
    with (
        mock.patch.object(isolation, "mounts_unavailable", lambda: "bwrap asked for")
        if via_bwrap
        else nullcontext()
    ):
        provider = LocalSandboxProvider(tmp_path / "sandboxes", kill_grace_s=0.5, **provider_kw)
    sandbox = await provider.start(SandboxSpec(run_id="r", session_id="s", ttl_s=300))
    try:
        yield sandbox
    finally:
        await sandbox.stop()
    assert not processes_under(str(tmp_path / "sandboxes"))


MODES = [
    pytest.param({"pids": "isolated"}, marks=needs_pids, id="pids"),
    pytest.param({"filesystem": "readonly"}, marks=needs_view, id="readonly"),
    pytest.param({"filesystem": "readonly", "via_bwrap": True}, marks=needs_bwrap, id="readonly-bwrap"),
]


@pytest.mark.parametrize("mode", MODES)
async def test_proc_shows_only_the_sandboxs_own_processes(tmp_path, mode):
    holder = subprocess.Popen(["sleep", "300"])  # a host process, like the worker holding the key
    try:
        async with _sandbox(tmp_path, **mode) as sandbox:
            listed = await sandbox.exec(LIST_PIDS, timeout=30)
            environ = await sandbox.exec(["cat", f"/proc/{holder.pid}/environ"], timeout=30)
    finally:
        holder.kill()
        holder.wait(timeout=30)
    assert listed.exit_code == 0, listed.stderr_tail
    pids = [int(p) for p in listed.stdout_tail.split()]
    assert 1 <= len(pids) <= 6, pids  # the namespace's init, the wrappers in it, and the lister
    assert os.getpid() not in pids and holder.pid not in pids
    assert environ.exit_code != 0 and "No such file" in environ.stderr_tail


@pytest.mark.parametrize("mode", MODES)
async def test_exit_codes_signals_and_timeouts_pass_through(tmp_path, mode):
    async with _sandbox(tmp_path, **mode) as sandbox:
        seven = await sandbox.exec(["sh", "-c", "exit 7"], timeout=30)
        killed = await sandbox.exec(["sh", "-c", "kill -9 $$"], timeout=30)
        termed = await sandbox.exec(["sh", "-c", "kill -TERM $$"], timeout=30)
        missing = await sandbox.exec(["no-such-command-here"], timeout=30)
        slow = await sandbox.exec(["sh", "-c", "sleep 600"], timeout=1)
    assert (seven.exit_code, seven.signal, seven.timed_out) == (7, None, False)
    assert (killed.exit_code, killed.signal) == (None, signal.SIGKILL)
    assert (termed.exit_code, termed.signal) == (None, signal.SIGTERM)
    assert missing.exit_code == 127 and "no-such-command-here" in missing.stderr_tail
    assert (slow.timed_out, slow.exit_code, slow.signal) == (True, None, signal.SIGTERM)


@pytest.mark.parametrize("mode", MODES)
async def test_timeout_kills_grandchildren_that_escaped_the_session(tmp_path, mode):
    mark = new_mark()
    async with _sandbox(tmp_path, **mode) as sandbox:
        res = await sandbox.exec(
            ["bash", "-c", tree_script(mark, f"exec -a {mark}-main sleep 300")], timeout=5
        )
        # Checked before stop(), whose sweep would hide a leak of the supervisor's.
        left = live_with(mark)
    assert res.timed_out and res.signal == signal.SIGTERM
    line = next(line for line in res.stdout_tail.splitlines() if line.startswith("procs:"))
    assert len(line.split()) == 5  # the setsid'd, nohup'd, double-forked and TERM-ignoring ones all ran
    assert left == []


@needs_root
@pytest.mark.parametrize("mode", MODES)
async def test_root_inside_cannot_uncover_the_hosts_proc(tmp_path, mode):
    """The fresh /proc is mounted over the host's: unmounting it would show every host process again."""
    async with _sandbox(tmp_path, **mode) as sandbox:
        umount = await sandbox.exec(["umount", "-l", "/proc"], timeout=30)
        listed = await sandbox.exec(LIST_PIDS, timeout=30)
    assert umount.exit_code != 0
    assert os.getpid() not in [int(p) for p in listed.stdout_tail.split()]


@needs_pids
async def test_a_sandboxs_commands_share_its_namespace_which_ends_with_its_server(tmp_path):
    """One PID namespace per sandbox, made by its supervisor server: a command sees what an earlier one
    of the same sandbox still runs, another sandbox sees none of it, and when the server dies the
    namespace ends, taking with it what even its supervisor no longer holds."""
    mark = new_mark()
    fifo = Fifo(tmp_path / "ready.fifo")
    provider = LocalSandboxProvider(tmp_path / "sandboxes", kill_grace_s=0.5, pids="isolated")
    mine = await provider.start(SandboxSpec(run_id="r", session_id="mine", ttl_s=300))
    other = await provider.start(SandboxSpec(run_id="r", session_id="other", ttl_s=300))
    # The marked process reports itself once its exec is done: /proc/PID/cmdline reads empty while an
    # exec is under way, so a report before it would race the reads below. It then blocks in a builtin
    # (a read of a pipe of its own, which nobody writes): a child forked to wait on would show the mark
    # too until its own exec, a second marked process for the checks below.
    blocked = f'echo $$ > {fifo.path}; read -r _ <> "$TMPDIR/hold.fifo"'
    marked = f'mkfifo "$TMPDIR/hold.fifo" && exec -a {mark} bash -c ' + shlex.quote(blocked)
    long = asyncio.ensure_future(mine.exec(["bash", "-c", marked], timeout=300))
    try:
        inner_pid = int((await fifo.lines(1))[0])
        seen = await mine.exec(["cat", f"/proc/{inner_pid}/cmdline"], timeout=30)
        unseen = await other.exec(["sh", "-c", "cat /proc/[0-9]*/cmdline"], timeout=30)
        [host_pid] = live_with(mark)
        # Its supervisor first, by SIGKILL (the command is then the init's orphan), then the server.
        [supervisor_pid] = mine.descriptor()["supervisor_pids"]
        os.kill(supervisor_pid, signal.SIGKILL)
        await wait_exit(supervisor_pid)
        assert live_with(mark) == [host_pid]
        os.kill(mine.descriptor()["server_pid"], signal.SIGKILL)
        await wait_exit(host_pid)
        assert live_with(mark) == []
        with pytest.raises(SandboxLostError):
            await long
    finally:
        fifo.close()
        long.cancel()
        for sandbox in (mine, other):
            await sandbox.stop()
        await provider.aclose()
    assert mark.encode() in seen.stdout_tail.encode() and host_pid != inner_pid
    assert unseen.exit_code == 0 and mark not in unseen.stdout_tail
    assert not processes_under(str(tmp_path / "sandboxes"))


@needs_pids
async def test_stop_leaves_nothing_of_the_namespace_without_a_sweep(tmp_path):
    """A process its supervisor no longer holds (the supervisor died by SIGKILL) is the namespace's
    orphan; stop() ends the namespace and returns only once it is empty, with no walk of /proc."""
    mark = new_mark()
    fifo = Fifo(tmp_path / "ready.fifo")
    provider = LocalSandboxProvider(tmp_path / "sandboxes", kill_grace_s=0.5, pids="isolated")
    sandbox = await provider.start(SandboxSpec(run_id="r", session_id="s", ttl_s=300))
    orphaned = asyncio.ensure_future(
        sandbox.exec(["bash", "-c", f"echo up > {fifo.path}; exec -a {mark} sleep 300"], timeout=300)
    )
    try:
        await fifo.lines(1)
    finally:
        fifo.close()
    [supervisor_pid] = sandbox.descriptor()["supervisor_pids"]
    os.kill(supervisor_pid, signal.SIGKILL)
    with pytest.raises(SandboxLostError):
        await orphaned
    assert len(live_with(mark)) == 1
    await sandbox.stop()
    await provider.aclose()
    # The server exits 0 only once its namespace's init is reaped, and then stop() skips the sweep.
    assert sandbox._server.emptied_its_namespace
    assert live_with(mark) == []


@pytest.mark.parametrize("mode", [m for m in MODES if "filesystem" in m.values[0]])
async def test_readonly_writes_only_inside_the_session(tmp_path, mode):
    """The host is read-only, and /tmp (where the test's own directory is) is a different one."""
    hidden = tmp_path / "host-dir"
    hidden.mkdir()
    visible = Path("/etc") / f".readonly-probe-{uuid.uuid4().hex[:8]}"  # a host directory in sight
    write = 'echo x > "$1" && echo wrote'
    try:
        async with _sandbox(tmp_path, **mode) as sandbox:
            host = await sandbox.exec(["sh", "-c", write, "sh", str(visible)], timeout=30)
            remount = await sandbox.exec(["mount", "-o", "remount,rw,bind", "/"], timeout=30)
            host_again = await sandbox.exec(["sh", "-c", write, "sh", str(visible)], timeout=30)
            tmp = await sandbox.exec(["sh", "-c", write, "sh", str(hidden / "f")], timeout=30)
            inside = await sandbox.exec(["sh", "-c", write, "sh", f"{sandbox.workdir}/f"], timeout=30)
            home = await sandbox.exec(["sh", "-c", 'echo x > "$HOME/h" && echo x > "$TMPDIR/t"'], timeout=30)
    finally:
        visible.unlink(missing_ok=True)
    assert host.exit_code != 0 and "Read-only file system" in host.stderr_tail
    assert remount.exit_code != 0 and host_again.exit_code != 0
    assert tmp.exit_code != 0 and "nonexistent" in tmp.stderr_tail
    assert not (hidden / "f").exists()
    assert inside.stdout_tail.strip() == "wrote", inside.stderr_tail
    assert home.exit_code == 0, home.stderr_tail
    assert Path(sandbox.home, "h").read_text() == "x\n" and Path(sandbox.tmpdir, "t").read_text() == "x\n"
    assert Path(sandbox.workdir, "f").read_text() == "x\n"


FETCH = """
import sys, urllib.request
with urllib.request.urlopen(sys.argv[1] + "/models", timeout=20) as answer:
    print(answer.status, answer.read().decode())
"""


@needs_netns
@pytest.mark.parametrize("mode", MODES)
async def test_network_isolated_with_pids_or_readonly_still_reaches_the_gateway(tmp_path, mode):
    scripted = ScriptedModel()
    await scripted.start()
    gateway = Gateway(scripted.base_url, None)
    await gateway.start(unix_path=str(tmp_path / "gw.sock"))
    forward = (urlsplit(gateway.url).port or 0, str(tmp_path / "gw.sock"))
    try:
        async with _sandbox(tmp_path, network_forward=forward, **mode) as sandbox:
            session = gateway.open_session("s1", tmp_path / "evidence")
            fetched = await sandbox.exec([sys.executable, "-c", FETCH, session.base_url], timeout=30)
            names = await sandbox.exec(
                [sys.executable, "-c", "import socket; print([n for _, n in socket.if_nameindex()])"],
                timeout=30,
            )
            listed = await sandbox.exec(LIST_PIDS, timeout=30)
    finally:
        await gateway.stop()
        await scripted.stop()
    assert fetched.exit_code == 0, fetched.stderr_tail
    status, body = fetched.stdout_tail.split(" ", 1)
    assert status == "200" and json.loads(body)["data"][0]["id"] == "scripted-model"
    assert names.stdout_tail.strip() == "['lo']"
    assert os.getpid() not in [int(p) for p in listed.stdout_tail.split()]


# -- configuration ---------------------------------------------------------------------------------------


@needs_pids
def test_isolation_off_isolates_pids_where_the_host_allows(tmp_path):
    provider = LocalSandboxConfig(isolation="off").build(tmp_path)
    assert provider.isolation == isolation.Isolation(pids=True)
    off = LocalSandboxConfig(isolation="off", pids="host")
    assert off.build(tmp_path).isolation == isolation.Isolation()


@needs_view
@needs_netns
def test_the_default_config_isolates_every_layer_the_host_allows(tmp_path):
    config = LocalSandboxConfig()
    assert config.needs_gateway_socket
    provider = config.build(tmp_path, (8000, str(tmp_path / "gw.sock")))
    expected = "network,pids,filesystem,user" if os.geteuid() == 0 else "network,pids,filesystem"
    assert provider.isolation_label == expected


def test_readonly_with_host_pids_is_refused_in_one_line():
    with pytest.raises(pydantic.ValidationError) as caught:
        LocalSandboxConfig(filesystem="readonly", pids="host")
    message = caught.value.errors()[0]["msg"]
    assert "sandbox.filesystem 'readonly'" in message and "\n" not in message


def test_a_host_without_the_command_is_told_which(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    why = isolation._probe([isolation.BWRAP, "true"], "sandbox.filesystem 'readonly'")
    assert why == "sandbox.filesystem 'readonly' needs the bwrap command"


def test_strict_refuses_in_one_line_what_the_host_cannot_make(monkeypatch):
    monkeypatch.setattr(isolation, "network_unavailable", lambda: "no unshare --net here")
    with pytest.raises(pydantic.ValidationError) as caught:
        LocalSandboxConfig(isolation="strict")
    message = caught.value.errors()[0]["msg"]
    assert "sandbox.isolation 'strict'" in message and "no unshare --net here" in message
    assert "\n" not in message
    with pytest.raises(pydantic.ValidationError):  # a layer switched off contradicts strict
        LocalSandboxConfig(isolation="strict", filesystem="host")


def test_auto_says_once_in_one_line_which_layers_it_runs_without(monkeypatch, caplog):
    monkeypatch.setattr(isolation, "network_unavailable", lambda: "no unshare --net here")
    isolation._warn_missing.cache_clear()
    for _ in range(3):
        config = LocalSandboxConfig()
        assert not config.layers.network and not config.needs_gateway_socket
    lines = [r.getMessage() for r in caplog.records if "sandbox.isolation 'auto'" in r.getMessage()]
    assert len(lines) == 1 and "network (no unshare --net here)" in lines[0] and "\n" not in lines[0]
    isolation._warn_missing.cache_clear()


def test_off_is_the_hosts_network_filesystem_and_user():
    layers = LocalSandboxConfig(isolation="off").layers
    assert (layers.network, layers.filesystem, layers.user) == (False, "host", False)
    assert LocalSandboxConfig.model_validate(yaml.safe_load("isolation: off")).isolation == "off"


# A child of the command takes a descriptor of its parent and writes a byte of its memory, as a tool could
# do to its harness (same user): what each call gave.
TAKE_OVER_THE_PARENT = """
import ctypes, errno, os, platform, socket
libc = ctypes.CDLL(None, use_errno=True)
writev = {"x86_64": 311, "aarch64": 271}[platform.machine()]
mine, _theirs = socket.socketpair()
byte = ctypes.create_string_buffer(b"x")
read, write = os.pipe()
if os.fork() == 0:
    parent = os.getppid()
    said = []
    got = libc.syscall(438, os.pidfd_open(parent), mine.fileno(), 0)
    said.append("ok" if got >= 0 else errno.errorcode[ctypes.get_errno()])
    iov = (ctypes.c_void_p * 2)(ctypes.addressof(byte), 1)
    one, none = ctypes.c_ulong(1), ctypes.c_ulong(0)
    wrote = libc.syscall(writev, parent, iov, one, iov, one, none)
    said.append("ok" if wrote >= 0 else errno.errorcode[ctypes.get_errno()])
    os.write(write, " ".join(said).encode())
    os._exit(0)
os.close(write)
os.wait()
print(os.read(read, 100).decode())
"""


@needs_view
@pytest.mark.parametrize("isolated", [True, False], ids=["isolated", "not-isolated"])
async def test_a_command_cannot_take_over_another_process_of_its_sandbox(tmp_path, isolated):
    """pidfd_getfd and process_vm_writev refused by the command's seccomp filter (sandboxes/seccomp.py);
    the control, a sandbox with no layer, shows the same calls succeed where nothing refuses them."""
    async with _sandbox(tmp_path, **({"filesystem": "readonly"} if isolated else {})) as sandbox:
        res = await sandbox.exec([sys.executable, "-c", TAKE_OVER_THE_PARENT], timeout=30)
    assert res.exit_code == 0, res.stderr_tail
    assert res.stdout_tail.split() == (["EPERM", "EPERM"] if isolated else ["ok", "ok"])


def test_a_hidden_directory_made_after_a_view_was_planned_is_hidden_from_the_next_view_at_once(tmp_path):
    """A view plan reuses what it found of the host's paths for a second, but a hidden path of the
    caller's that was not there yet (a run directory about to be made) is looked for again at once."""
    from sandboxes import fsview

    shown, secret = tmp_path / "shown", tmp_path / "shown" / "run"
    shown.mkdir()
    first = fsview.plan([str(secret)], ["/tmp"], [str(shown)], [])
    assert [fsview.RO, str(shown)] in first and [fsview.HIDE, str(secret)] not in first
    secret.mkdir()
    assert [fsview.HIDE, str(secret)] in fsview.plan([str(secret)], ["/tmp"], [str(shown)], [])

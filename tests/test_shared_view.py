"""A local sandbox's filesystem view, built once by its supervisor server and joined by each of its commands
(sandboxes/supervisor_server.py): one view per sandbox, never another sandbox's, and no command of it can
change the view the next one joins. Real mounts, as root; skipped where root's view cannot be made."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from sandboxes import fsview, isolation, native_init, uidpool
from sandboxes.base import SandboxSpec
from sandboxes.local import LocalSandboxProvider
from tests.conftest import processes_under

pytestmark = pytest.mark.skipif(
    isolation.mounts_unavailable() is not None, reason=f"no root view: {isolation.mounts_unavailable()}"
)

NAMESPACES = "readlink /proc/self/ns/mnt /proc/self/ns/ipc"
# The first command leaves what a command can leave in the view: a file in /tmp and /dev/shm, and a
# shared memory segment in its IPC namespace; then tries to change the view itself.
FIRST = f"""{NAMESPACES}
echo a > /tmp/left && echo a > /dev/shm/left && ipcmk -M 4096 >/dev/null && echo made
umount -l /tmp 2>/dev/null && echo unmounted
mount -t tmpfs none /usr 2>/dev/null && echo mounted
mount -o remount,rw / 2>/dev/null && echo remounted
echo x > /usr/planted 2>/dev/null && echo planted
"""
LATER = f"""{NAMESPACES}
cat /tmp/left /dev/shm/left 2>/dev/null
ipcs -m | grep -c 4096
ls /usr/planted 2>/dev/null
test -e {{hidden}} && echo host-visible
echo done
"""


def _provider(tmp_path: Path, **options: Any) -> LocalSandboxProvider:
    """Root's view for every command, a uid of the sandbox's own where the pool has one; ``options``: the
    provider's others (its process and memory caps, hidden paths, mounts), if any."""
    return LocalSandboxProvider(
        tmp_path / "sandboxes",
        kill_grace_s=0.5,
        keep=False,
        pids="isolated",
        filesystem="readonly",
        user=uidpool.pool_unavailable() is None,
        **options,
    )


async def test_a_sandboxs_commands_join_one_view_that_none_of_them_can_change(tmp_path):
    hidden = tmp_path / "host-only"
    hidden.mkdir()
    provider = _provider(tmp_path)
    one = await provider.start(SandboxSpec(run_id="r", session_id="one", ttl_s=300))
    other = await provider.start(SandboxSpec(run_id="r", session_id="other", ttl_s=300))
    later = LATER.format(hidden=hidden)
    try:
        first = await one.exec(["sh", "-c", FIRST], timeout=60)
        again = await one.exec(["sh", "-c", later], timeout=60)
        beside = await other.exec(["sh", "-c", later], timeout=60)
    finally:
        await one.stop()
        await other.stop()
        await provider.aclose()
    host_ns = [os.readlink(f"/proc/self/ns/{kind}") for kind in ("mnt", "ipc")]
    first_lines, again_lines = first.stdout_tail.split(), again.stdout_tail.split()
    # One view for the sandbox's commands, neither the host's nor the other sandbox's.
    assert first_lines[:2] == again_lines[:2], (first.stdout_tail, again.stdout_tail)
    assert not set(first_lines[:2]) & set(host_ns)
    assert not set(beside.stdout_tail.split()[:2]) & set(first_lines[:2])
    # What a command wrote lasts for the sandbox's later commands (as its work, home and tmp do); the
    # view itself does not change: no unmount, mount, remount or write outside it took.
    assert first_lines[2:] == ["made"], first.stdout_tail
    assert again_lines[2:] == ["a", "a", "1", "done"], again.stdout_tail
    # The other sandbox sees none of it, and nothing of the host's outside the view.
    assert beside.stdout_tail.split()[2:] == ["0", "done"], beside.stdout_tail
    # Nothing is left of either: each server exited once its PID namespace was empty (the child that
    # built the view included), and no process runs under the sandboxes' root.
    assert one._server.emptied_its_namespace and other._server.emptied_its_namespace
    assert not processes_under(str(tmp_path / "sandboxes"))


def _kernel_clones_detached_mounts() -> bool:
    try:
        proc = fsview.detached_proc()
    except OSError:
        return False
    try:
        os.close(fsview.clone_mount(proc))
        return True
    except OSError:
        return False
    finally:
        os.close(proc)


async def test_the_server_builds_the_view_itself_and_its_proc_is_the_sandboxs(tmp_path):
    """Where the kernel can clone a detached mount, the server builds the view without a forked child:
    in its own process, or by the native init's view mode (sandboxes/native_init.py, a child that has
    exited by then), so the sandbox's PID namespace holds only its init, which supervises the command
    itself (sandboxes/folded.py), and the command; the view's /proc is the namespace's own either way,
    never the host's."""
    provider = _provider(tmp_path)
    sandbox = await provider.start(SandboxSpec(run_id="r", session_id="proc", ttl_s=300))
    try:
        res = await sandbox.exec(["sh", "-c", "echo $$; ls /proc"], timeout=60)
    finally:
        await sandbox.stop()
        await provider.aclose()
    shell, *entries = res.stdout_tail.split()
    pids = sorted(int(entry) for entry in entries if entry.isdigit())
    # The namespace's init (1: the server itself, namespaces.ServerInit), the shell, its `ls`: a child
    # that built the view (the native init's, or a fork) took the pid after the init's, and has been
    # reaped by then.
    in_server = _kernel_clones_detached_mounts() and native_init.PROGRAM is None
    assert int(shell) == (2 if in_server else 3), res.stdout_tail
    assert pids == [1, int(shell), int(shell) + 1], res.stdout_tail


# Root in a sandbox (no uid of its own: no boundary claimed, docs/isolation.md) keeps CAP_SYS_CHROOT, and
# with it the old way out of a chroot: a root of its own below, then `..` past it. A view is its builder's
# root stacked on the base's (fsview.apply), and a walk up to the base's root goes down into what is
# mounted there: the view again, whichever init started the command.
CLIMB = """
import os
print("view", sorted(os.listdir("/")))
os.mkdir("/tmp/below")
top = os.open("/", os.O_RDONLY)
os.chroot("/tmp/below")
os.fchdir(top)
for _ in range(64):
    os.chdir("..")
os.chroot(".")
print("found", sorted(os.listdir("/")))
try:
    os.mkdir("/planted")
    print("planted")
except OSError as exc:
    print("refused", exc.errno)
"""


async def test_a_root_command_that_climbs_out_of_its_view_finds_the_view_again(tmp_path):
    from tests.test_local_sandbox import Fifo

    provider = LocalSandboxProvider(
        tmp_path / "sandboxes", kill_grace_s=0.5, keep=False, pids="isolated", filesystem="readonly"
    )  # user=False: as root
    sandbox = await provider.start(SandboxSpec(run_id="r", session_id="climb", ttl_s=300))
    report, go = Fifo(Path(sandbox.workdir) / "report"), Fifo(Path(sandbox.workdir) / "go")
    running = None
    try:
        alone = await sandbox.exec([sys.executable, "-I", "-c", CLIMB], timeout=60)  # the server's own
        waits = ["sh", "-c", "echo up >> report; read x < go"]
        running = asyncio.ensure_future(sandbox.exec(waits, timeout=60))
        assert await report.lines(1) == ["up"]
        beside = await sandbox.exec(  # beside a running command: a supervisor's, with a forked init
            [sys.executable, "-I", "-c", CLIMB.replace("below", "below2")], timeout=60
        )
        os.write(go._w, b"go\n")
        assert (await running).exit_code == 0
    finally:
        if running is not None and not running.done():
            running.cancel()
        report.close()
        go.close()
        await sandbox.stop()
        await provider.aclose()
    for res in (alone, beside):
        assert res.exit_code == 0, res.stderr_tail
        view, found, planted = res.stdout_tail.splitlines()
        assert "'usr'" in view and found == view.replace("view", "found", 1), res.stdout_tail
        assert planted == "refused 30", res.stdout_tail  # read-only: EROFS


HIDDEN = """
for d in {a} {b}; do stat -c '%d' "$d"; ls -A "$d" | wc -l; done
touch {a}/planted 2>/dev/null && echo planted
mkdir {b}/planted 2>/dev/null && echo planted
echo done
"""


async def test_hidden_directories_show_one_empty_read_only_filesystem_in_every_view(tmp_path):
    """A hidden directory with nothing of the view inside it shows the base's root (fsview.apply): empty,
    read-only, and one filesystem for every view, where a tmpfs each was a superblock made and torn down
    with each view (and walked at each memory cgroup's removal on the host while it lasted)."""
    shown = tmp_path / "shown"
    for name in ("a", "b"):
        (shown / name).mkdir(parents=True)
        (shown / name / "secret").write_text("host only\n")
    provider = _provider(tmp_path, hidden=[str(shown / "a"), str(shown / "b")], mounts=[(str(shown), False)])
    one = await provider.start(SandboxSpec(run_id="r", session_id="one", ttl_s=300))
    other = await provider.start(SandboxSpec(run_id="r", session_id="other", ttl_s=300))
    script = HIDDEN.format(a=shown / "a", b=shown / "b")
    try:
        seen = [await sandbox.exec(["sh", "-c", script], timeout=60) for sandbox in (one, other)]
    finally:
        await one.stop()
        await other.stop()
        await provider.aclose()
    host_dev = str(os.stat(shown / "a").st_dev)
    devices = set()
    for res in seen:
        dev_a, count_a, dev_b, count_b, *rest = res.stdout_tail.split()
        assert (count_a, count_b, rest) == ("0", "0", ["done"]), res.stdout_tail  # empty; nothing planted
        devices |= {dev_a, dev_b}
    assert len(devices) == 1 and host_dev not in devices, (devices, host_dev)

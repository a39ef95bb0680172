"""The isolation layers of a local sandbox's commands: network, PID and filesystem namespaces.

PID and network namespaces are made by the supervisor's server and the supervisor themselves: a sandbox's
PID namespace once, by its server (sandboxes/namespaces.py), and a command's network namespace by a fork
and a few system calls (sandboxes/supervisor.py). A read-only host filesystem needs bubblewrap, and
``wrap`` turns the command's argv into this chain::

    supervisor
     └ isolation.py outer    host PID namespace: dies of the command's signal, or exits with its code
        └ bwrap --ro-bind / / ... --unshare-pid [--unshare-net]
           └ isolation.py inner   runs the forwarder (if any) and the command, reaps orphans, and
              └ command           writes the command's raw wait status to the outer through a pipe

The outer exists because no process inside a PID namespace can hand a death by signal out: its init
ignores signals sent from inside, and bwrap reports one as 128+N. The inner drops CAP_SYS_ADMIN before
the command starts, or root inside could remount the read-only root writable (a sandbox's PID namespace
drops it the same way, since root could unmount its fresh /proc). Standard library only: it runs
as ``python3 -I -S isolation.py``.
"""

from __future__ import annotations

# Run as a script by every isolated exec, twice: this part comes first and imports only what it needs,
# and the script exits before the worker side below imports typing and the rest (which alone would
# double its start-up).
import os
import signal
import sys

ISOLATION_PATH = os.path.abspath(__file__)
UNSHARE = "unshare"
BWRAP = "bwrap"

_PR_CAPBSET_DROP = 24
_CAP_SYS_ADMIN = 21
_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


# ---------------------------------------------------------------------------------------------------------
# Outside the namespaces


def _bwrap_args(session_dir: str, *, network: bool) -> list[str]:
    args = ["--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc"]
    if session_dir != "/":
        args += ["--bind", session_dir, session_dir]
    args += ["--unshare-pid", "--die-with-parent"]
    if network:
        args.append("--unshare-net")
    return [*args, "--"]


def _die_like(code: int) -> int:
    """Exit as the command did: a death by signal is repeated here, so the supervisor sees the signal."""
    if code < 0:
        try:
            signal.signal(-code, signal.SIG_DFL)
        except (OSError, ValueError):  # SIGKILL and SIGSTOP take no handler
            pass
        os.kill(os.getpid(), -code)
    return code


def outer(session_dir: str, forward: list[str], argv: list[str]) -> int:
    status_r, status_w = os.pipe()
    os.set_inheritable(status_w, True)
    inner_argv = [sys.executable, "-I", "-S", ISOLATION_PATH, "inner", str(status_w)]
    if forward:
        inner_argv += ["--forward", *forward]
    # The supervisor signals the whole process group, the command included, and kills the tree after;
    # here a signal only must not end this process before it can report. A handler, not SIG_IGN,
    # which the command would inherit.
    for sig in _SIGNALS:
        signal.signal(sig, lambda _signum, _frame: None)
    namespace_argv = [BWRAP, *_bwrap_args(session_dir, network=bool(forward))]
    try:
        child = os.posix_spawnp(namespace_argv[0], [*namespace_argv, *inner_argv, "--", *argv], os.environ)
    except OSError as exc:
        print(f"isolation: cannot run {namespace_argv[0]!r}: {exc.strerror or exc}", file=sys.stderr)
        return 127 if isinstance(exc, FileNotFoundError) else 126
    finally:
        os.close(status_w)
    _pid, status = os.waitpid(child, 0)
    # Not blocking: a report is written before the inner exits, and none comes if it was killed.
    os.set_blocking(status_r, False)
    try:
        report = os.read(status_r, 64)
    except BlockingIOError:
        report = b""
    return _die_like(os.waitstatus_to_exitcode(int(report) if report.strip().isdigit() else status))


# ---------------------------------------------------------------------------------------------------------
# Inside the namespaces


def _drop_sys_admin() -> None:
    # Only the bounding set: for root, an exec recomputes the capabilities from it. Fails harmlessly
    # for a user who never had the capability.
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_CAPBSET_DROP, _CAP_SYS_ADMIN, 0, 0, 0)


def _start_forwarder(port: str, socket_path: str) -> None:
    # Run by path with -I, this script's directory is not on sys.path; netns.py is its sibling.
    sys.path.insert(0, os.path.dirname(ISOLATION_PATH))
    import netns

    netns.start_forwarder(int(port), socket_path)


def inner(status_fd: int, forward: list[str], argv: list[str]) -> int:
    os.set_inheritable(status_fd, False)  # the command must not hold it, or hold up the outer's read
    _drop_sys_admin()  # before any thread: the bounding set is per thread, and children inherit it
    if forward:
        _start_forwarder(*forward)
    try:
        child = os.posix_spawnp(argv[0], argv, os.environ)
    except OSError as exc:
        print(f"cannot run {argv[0]!r}: {exc.strerror or exc}", file=sys.stderr)
        return 127 if isinstance(exc, FileNotFoundError) else 126
    reaped = False

    def pass_on(signum: int, _frame: object) -> None:
        if not reaped:  # once reaped, its pid may name another process
            try:
                os.kill(child, signum)
            except ProcessLookupError:
                pass

    for sig in _SIGNALS:
        signal.signal(sig, pass_on)
    # Under unshare this is the namespace's init: orphans are reparented here and must be reaped.
    while True:
        pid, status = os.waitpid(-1, 0)
        if pid == child:
            reaped = True
            break
    os.write(status_fd, str(status).encode())
    os.close(status_fd)
    code = os.waitstatus_to_exitcode(status)
    return code if code >= 0 else 128 - code


def _split(args: list[str]) -> tuple[dict[str, list[str]], list[str]]:
    """Options (``--name VALUE...``) up to ``--``, and the command after it."""
    arity = {"--readonly": 1, "--forward": 2}
    options: dict[str, list[str]] = {}
    i = 0
    while i < len(args) and args[i] != "--":
        n = arity[args[i]]
        options[args[i]] = args[i + 1 : i + 1 + n]
        i += 1 + n
    return options, args[i + 1 :]


def main(args: list[str]) -> int:
    if len(args) < 3 or args[0] not in ("outer", "inner"):
        print("usage: isolation.py outer|inner [...] -- COMMAND...", file=sys.stderr)
        return 2
    if args[0] == "inner":
        options, argv = _split(args[2:])
        return inner(int(args[1]), options.get("--forward", []), argv)
    options, argv = _split(args[1:])
    return outer(options["--readonly"][0], options.get("--forward", []), argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))


# ---------------------------------------------------------------------------------------------------------
# The worker side: which layers, and what this host allows

import functools  # noqa: E402
import logging  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
from typing import Any, Literal, NamedTuple  # noqa: E402

PidsMode = Literal["auto", "host", "isolated"]
FilesystemMode = Literal["host", "readonly"]


class IsolationUnavailable(Exception):
    """This host cannot make the namespace a sandbox setting asks for."""


class Isolation(NamedTuple):
    """Which layers wrap each command of a sandbox."""

    pids: bool = False  # a PID namespace of its own, with a fresh /proc
    readonly: bool = False  # bwrap: the host read-only, only the session directory writable
    network_forward: tuple[int, str] | None = None  # (port, unix socket): see sandboxes/netns.py


def wrap(argv: list[str], layers: Isolation, session_dir: str) -> list[str]:
    """``argv`` inside ``layers``; ``session_dir`` is what stays writable when the host is read-only.

    Only a read-only host needs a wrapper (bwrap); PID and network namespaces alone are made by the
    supervisor's server and the supervisor, which costs a fork instead of the wrappers' interpreters."""
    if not layers.readonly:
        return argv
    outer = [sys.executable, "-I", "-S", ISOLATION_PATH, "outer", "--readonly", session_dir]
    if layers.network_forward is not None:
        port, socket_path = layers.network_forward
        outer += ["--forward", str(port), socket_path]
    return [*outer, "--", *argv]


def server_pid_namespace(layers: Isolation) -> bool:
    """Whether a sandbox's supervisor server makes the PID namespace all its commands run in (with a
    read-only host, bwrap makes one per command instead)."""
    return layers.pids and not layers.readonly


def network_forward(layers: Isolation) -> list[Any] | None:
    """The supervisor's ``network_forward`` parameter: each command in a loopback-only network namespace
    of its own, where 127.0.0.1:port reaches the gateway's socket (None: the host's network, or bwrap
    makes the namespace)."""
    if layers.readonly or layers.network_forward is None:
        return None
    return list(layers.network_forward)


# ---------------------------------------------------------------------------------------------------------
# What this host allows (probed once per process)


def _probe(argv: list[str], what: str) -> str | None:
    """Why ``argv`` cannot run here, or None when it ran and succeeded."""
    if shutil.which(argv[0]) is None:
        return f"{what} needs the {argv[0]} command"
    try:
        probe = subprocess.run(argv, capture_output=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{what}: {argv[0]} failed: {exc}"
    if probe.returncode != 0:
        why = probe.stderr.decode("utf-8", "replace").strip().replace("\n", " ")[:200]
        return f"{what}: {' '.join(argv)} failed: {why}"
    return None


@functools.cache
def pid_namespace_unavailable() -> str | None:
    """Why this host cannot give a command a PID namespace, or None when it can."""
    return _probe([UNSHARE, "--pid", "--fork", "--mount-proc", "true"], "sandbox.pids 'isolated'")


@functools.cache
def readonly_unavailable() -> str | None:
    """Why this host cannot run a command under bwrap with the host read-only, or None when it can."""
    return _probe([BWRAP, *_bwrap_args("/", network=False), "true"], "sandbox.filesystem 'readonly'")


def resolve_pids(mode: PidsMode, filesystem: FilesystemMode = "host") -> bool:
    """Whether commands get a PID namespace (always, with a read-only host). Raises IsolationUnavailable
    when a setting cannot be met."""
    if filesystem == "readonly":
        if (why := readonly_unavailable()) is not None:
            raise IsolationUnavailable(why)
        return True  # bwrap --proc needs --unshare-pid, whatever ``mode`` says
    if mode == "host":
        return False
    why = pid_namespace_unavailable()
    if why is None:
        return True
    if mode == "isolated":
        raise IsolationUnavailable(why)
    _warn_host_pids(why)
    return False


@functools.cache
def _warn_host_pids(why: str) -> None:
    logging.getLogger(__name__).warning(
        "sandbox.pids 'auto': sandboxed commands share the host's PID namespace (%s)", why
    )

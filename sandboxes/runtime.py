"""The worker's own Python, carried read-only into a container whose image may have none.

The in-sandbox agent and its supervisor are Python (standard library only). Rather than ask every task
image for a python3 >= 3.11 (stock ``ubuntu:24.04``, ``debian:*-slim``, busybox and distroless images
have none), the container provider mounts this machine's interpreter into the container and runs it
with this machine's own dynamic loader and shared libraries, so nothing of the image is used: not its
C library, not its loader, not its ``/etc/ld.so.cache``::

    /opt/rollout/rt/bin/python3          the interpreter's binary (read-only bind mount)
    /opt/rollout/rt/lib/pythonX.Y/       its standard library, lib-dynload included (read-only)
    /opt/rollout/rt/so/                  ld.so and the libraries the binary and the extension modules
                                         the agent imports link to, copied once per host into the cache

    /opt/rollout/rt/so/ld.so --library-path /opt/rollout/rt/so /opt/rollout/rt/bin/python3 -E -s -S ...

``--library-path`` is the loader's own option: it applies to that process only and never reaches the
environment of the commands the agent runs. Python finds its prefix from its own path (the landmark
``lib/pythonX.Y/os.py`` beside ``bin/``), so the interpreter runs from the mount as it does here. A
statically linked interpreter is run directly. The libraries are found by ``ldd`` once per host and
copied under ``<cache>/runtime/<key>/`` (key: the interpreter and every library's path, size and
mtime), written whole under a temporary name and renamed into place, so concurrent workers agree.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path

RT_IN = "/opt/rollout/rt"
LOADER_NAME = "ld.so"
LDD_TIMEOUT_S = 60.0
# What the agent, the supervisor and their helpers import, plus what tarfile and hmac may reach for:
# their extension modules' libraries are the ones the container needs.
_IMPORTS = (
    "http.server, json, socket, selectors, subprocess, tarfile, hmac, hashlib, uuid, signal, "
    "threading, argparse, zlib, _bz2, _lzma, resource, fcntl, select, termios, ctypes"
)
_LOADED = f"""
import sys
for name in "{_IMPORTS}".split(", "):
    try:
        __import__(name)
    except ImportError:
        pass
paths = {{line.split()[-1] for line in open("/proc/self/maps")}}
print("\\n".join(sorted(p for p in paths if ".so" in p)))
"""


class RuntimeUnavailable(Exception):
    """This machine's Python cannot be carried into a container (one line naming why)."""


@dataclass(frozen=True)
class Runtime:
    """How a container runs the worker's Python: what to mount and the argv that starts it inside."""

    mounts: tuple[tuple[str, str], ...]  # (host path, path in the container), each read-only
    argv: tuple[str, ...]  # the interpreter inside, before its own options
    key: str

    def mount_args(self) -> list[str]:
        return [arg for src, dest in self.mounts for arg in ("-v", f"{src}:{dest}:ro")]


def _interpreter() -> Path:
    # A venv's python is a link to the installation it was made from: that installation is carried.
    return Path(os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable))


def _ldd(files: list[str]) -> tuple[dict[str, str], str | None]:
    """(needed name -> host path) of every library ``files`` link to, and the loader's path (None for
    static binaries)."""
    try:
        proc = subprocess.run(
            ["ldd", *files], capture_output=True, text=True, timeout=LDD_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RuntimeUnavailable(f"ldd of this machine's python failed: {exc}") from None
    libs: dict[str, str] = {}
    loader = None
    for line in proc.stdout.splitlines():
        parts = line.split()
        if "=>" in parts and len(parts) >= 3 and parts[2].startswith("/"):
            libs.setdefault(parts[0], parts[2])
        elif parts and parts[0].startswith("/") and "ld-" in os.path.basename(parts[0]):
            loader = parts[0]
    if "not found" in proc.stdout:
        missing = [line.split()[0] for line in proc.stdout.splitlines() if "not found" in line]
        lacks = ", ".join(missing)[:300]
        raise RuntimeUnavailable(f"this machine's python links to libraries it lacks: {lacks}")
    return libs, loader


def _loaded_modules(python: Path, stdlib: str) -> list[str]:
    """The extension modules (under ``stdlib``) that the agent's imports load in ``python``."""
    proc = subprocess.run(
        [str(python), "-E", "-s", "-S", "-c", _LOADED],
        capture_output=True,
        text=True,
        timeout=LDD_TIMEOUT_S,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeUnavailable(f"{python} could not list its modules: {proc.stderr.strip()[-300:]}")
    return [path for path in proc.stdout.split() if path.startswith(stdlib + "/")]


def _stat_key(paths: list[str]) -> str:
    h = hashlib.sha256()
    for path in sorted(paths):
        st = os.stat(path)
        h.update(f"{path}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    return h.hexdigest()[:24]


@functools.cache
def host_runtime(cache_root: Path) -> Runtime:
    """This machine's Python as a container runs it, its libraries copied under ``cache_root`` once."""
    python = _interpreter()
    stdlib = os.path.realpath(os.path.dirname(os.__file__))
    dynload = os.path.realpath(sysconfig.get_config_var("DESTSHARED") or stdlib)
    if not (dynload == stdlib or dynload.startswith(stdlib + "/")):
        raise RuntimeUnavailable(f"this machine's python keeps its extension modules outside {stdlib}")
    version = f"python{sys.version_info[0]}.{sys.version_info[1]}"
    libs, loader = _ldd([str(python), *_loaded_modules(python, stdlib)])
    mounts = [(str(python), f"{RT_IN}/bin/python3"), (stdlib, f"{RT_IN}/lib/{version}")]
    if loader is None and not libs:  # static: nothing to bring but the binary and its library
        return Runtime(tuple(mounts), (f"{RT_IN}/bin/python3",), _stat_key([str(python)]))
    if loader is None:
        raise RuntimeUnavailable(f"ldd names no loader for {python}")
    key = _stat_key([str(python), loader, *libs.values()])
    so_dir = _copy_libraries(Path(cache_root) / "runtime" / key, libs, loader)
    mounts.append((str(so_dir), f"{RT_IN}/so"))
    argv = (f"{RT_IN}/so/{LOADER_NAME}", "--library-path", f"{RT_IN}/so", f"{RT_IN}/bin/python3")
    return Runtime(tuple(mounts), argv, key)


def _copy_libraries(dest: Path, libs: dict[str, str], loader: str) -> Path:
    """``dest``/so holding the loader and each library under the name it is asked for; made once."""
    so_dir = dest / "so"
    if (dest / "manifest.json").is_file():
        return so_dir
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        (tmp / "so").mkdir()
        shutil.copy(loader, tmp / "so" / LOADER_NAME)
        for name, path in libs.items():
            shutil.copy(path, tmp / "so" / name)
        (tmp / "manifest.json").write_text(json.dumps({"loader": loader, "libraries": libs}, indent=1))
        for path in [tmp, tmp / "so", *(tmp / "so").iterdir()]:
            path.chmod(0o755 if path.is_dir() or path.name == LOADER_NAME else 0o644)
        with contextlib.suppress(OSError):  # another worker's copy got there first: the same files
            tmp.rename(dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return so_dir


__all__ = ["RT_IN", "Runtime", "RuntimeUnavailable", "host_runtime"]

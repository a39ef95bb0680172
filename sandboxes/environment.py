"""The environment a sandboxed command sees: built from an allow-list, never copied from the host.

The worker's own environment holds the real API key and cloud credentials; none of it may reach a
harness, so nothing here reads ``os.environ``.
"""

from __future__ import annotations

import functools
import os
import pwd
from collections.abc import Mapping, Sequence

from sandboxes.base import SandboxError

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

# Every process of a sandbox carries this variable, so a reaper can find the ones that left its tree. Its
# value is a random token per sandbox: session ids repeat across runs, and a reaper must never hit a
# sandbox other than the one it reaps.
SANDBOX_MARKER_VAR = "ROLLOUT_SANDBOX"


def marker_entry(token: str) -> bytes:
    """The ``NAME=value`` bytes that /proc/<pid>/environ shows for a process of this sandbox."""
    return f"{SANDBOX_MARKER_VAR}={token}".encode()


def _user_name() -> str:
    return _name_of(os.getuid())


@functools.cache
def _name_of(uid: int) -> str:
    """A uid's user name, looked up once per process: every sandbox's environment names it, and each
    lookup reads the host's user database (a parse of /etc/passwd, or a directory service's call)."""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def base_environment(
    *, home: str, tmpdir: str, marker_token: str, path_prefixes: Sequence[str] = ()
) -> dict[str, str]:
    user = _user_name()
    return {
        "PATH": ":".join([*path_prefixes, DEFAULT_PATH]),
        "HOME": home,
        "TMPDIR": tmpdir,
        "USER": user,
        "LOGNAME": user,
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "TERM": "dumb",
        "TZ": "UTC",
        "SHELL": "/bin/bash",
        # Python checks a cached .pyc by its source's mtime in whole seconds and size: an agent that runs a
        # test, then fixes a module within the same second without changing its size (a - b -> a + b),
        # has the fix ignored by the verifier. Nor do caches belong in the workspace diff.
        "PYTHONDONTWRITEBYTECODE": "1",
        "XDG_CONFIG_HOME": os.path.join(home, ".config"),
        "XDG_DATA_HOME": os.path.join(home, ".local", "share"),
        "XDG_CACHE_HOME": os.path.join(home, ".cache"),
        "XDG_STATE_HOME": os.path.join(home, ".local", "state"),
        SANDBOX_MARKER_VAR: marker_token,
    }


def xdg_dirs(env: Mapping[str, str]) -> list[str]:
    return [env[k] for k in ("XDG_CONFIG_HOME", "XDG_DATA_HOME", "XDG_CACHE_HOME", "XDG_STATE_HOME")]


def merge_environment(base: Mapping[str, str], *layers: Mapping[str, str] | None) -> dict[str, str]:
    """``base`` overlaid by each layer in turn; the sandbox marker always keeps its base value."""
    env = dict(base)
    for layer in layers:
        for key, value in (layer or {}).items():
            if not key or "=" in key or "\0" in key or "\0" in value:
                raise SandboxError(f"invalid environment entry {key!r}")
            env[key] = value
    env[SANDBOX_MARKER_VAR] = base[SANDBOX_MARKER_VAR]
    return env

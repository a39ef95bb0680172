"""A local sandbox's files from the worker's side: paths confined to the sandbox, files written there,
directory trees copied in (and a kept sandbox's copied off its disk)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from sandboxes import fsview, identity
from sandboxes.base import (
    SandboxError,
)


def confined_path(root: str, base: str, path: str, where: str) -> Path:
    """The real path of ``path`` (relative to ``base``, or absolute), refused if it resolves outside
    ``root`` (a real path); ``where`` names ``root`` in the error.

    A process in the sandbox could still swap a directory for a symlink between this check and the
    open; the final component is opened with O_NOFOLLOW, which narrows that to parent directories.
    """
    if not isinstance(path, str) or not path or "\0" in path:
        raise SandboxError(f"invalid sandbox path {path!r}")
    candidate = path if os.path.isabs(path) else os.path.join(base, path)
    real = fsview.real_path(candidate)  # the kernel's walk: an lstat a component saved, ~10 a session
    if os.path.commonpath([real, root]) != root:
        raise SandboxError(f"path {path!r} resolves outside {where}")
    return Path(real)


def write_confined(
    root: str,
    base: str,
    path: str,
    data: bytes,
    mode: int,
    where: str,
    owner: identity.Identity | None = None,
) -> None:
    """Write ``data`` at ``path`` as ``confined_path`` resolves it, making its directories; blocking.
    With ``owner``, the file and the directories made for it are the owner's."""
    real = confined_path(root, base, path, where)
    made = [p for p in (real.parent, *real.parent.parents) if not p.exists()]
    real.parent.mkdir(parents=True, exist_ok=True)
    confined_path(root, base, str(real.parent), where)  # the directories just made must still be inside
    fd = os.open(real, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        os.fchmod(f.fileno(), mode)  # the umask must not change what the caller asked for
        if owner is not None:
            os.fchown(f.fileno(), owner.uid, owner.gid)
    if owner is not None:
        for directory in made:
            os.lchown(directory, owner.uid, owner.gid)


def copy_tree(src: str, dst: str, owner: identity.Identity | None = None) -> None:
    """Copy what directory ``src`` holds into the existing directory ``dst``: regular files with their
    mode and times, symlinks as links, directories with their mode and times; with ``owner``, all it
    makes is the owner's. Anything else (a FIFO, a device), or a symlink where a directory or file is to
    be made, is an OSError. Blocking.

    Unlike ``shutil.copytree`` + ``identity.give``: one pass, and per file only its open, copy, chmod,
    chown and utime (no second stat, no extended attributes, no walk to chown): a prepared workspace is
    copied into every sandbox, so each call here is a system call of every rollout."""
    with os.scandir(src) as entries:
        for entry in entries:
            target = os.path.join(dst, entry.name)
            if entry.is_symlink():
                os.symlink(os.readlink(entry.path), target)
                if owner is not None:
                    os.lchown(target, owner.uid, owner.gid)
            elif entry.is_dir(follow_symlinks=False):
                st = entry.stat(follow_symlinks=False)
                try:
                    os.mkdir(target, 0o700)
                except FileExistsError:
                    if not stat.S_ISDIR(os.lstat(target).st_mode):
                        raise
                copy_tree(entry.path, target, owner)
                _copy_dir_stat(st, target, owner)
            elif entry.is_file(follow_symlinks=False):
                _copy_file(entry.path, target, owner)
            else:
                raise OSError(f"{entry.path}: not a regular file, directory or symlink")


def _copy_dir_stat(st: os.stat_result, target: str, owner: identity.Identity | None) -> None:
    os.chmod(target, stat.S_IMODE(st.st_mode))
    if owner is not None:
        os.lchown(target, owner.uid, owner.gid)
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns), follow_symlinks=False)


def _copy_file(src: str, dst: str, owner: identity.Identity | None) -> None:
    fin = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fin)
        fout = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            offset = 0
            while offset < st.st_size and (sent := os.sendfile(fout, fin, offset, st.st_size - offset)):
                offset += sent
            os.fchmod(fout, stat.S_IMODE(st.st_mode))
            if owner is not None:  # after the chmod, so that it clears set-user-ID bits as before
                os.fchown(fout, owner.uid, owner.gid)
            os.utime(fout, ns=(st.st_atime_ns, st.st_mtime_ns))
        finally:
            os.close(fout)
    finally:
        os.close(fin)

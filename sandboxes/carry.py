"""Carrying an agent's final workspace into the sandbox that grades it (executor/grading.py).

The workspace is the agent's, written by the policy under training, so it is read as hostile:
- no link is ever followed, at any depth: each directory is opened relative to its parent's descriptor
  with ``O_NOFOLLOW``, so a directory swapped for a symlink mid-copy cannot lead the copy out of the
  workspace (a symlink itself is carried as a link, and means nothing outside the grading sandbox);
- only regular files, directories and symlinks are carried: a FIFO, socket or device is left behind
  and named, as it could hang or leak the copy;
- a sparse file is carried as sparse (only its data), and the whole copy is bounded in bytes, entries
  and depth: a tree that a few system calls made must not fill the host's disk or exhaust descriptors.
What is left behind is named in the result, so the row can say so. Nothing the agent does to its
workspace makes the carry fail: a workspace it made uncopyable would otherwise be masked, and masking
must never be the agent's choice. The room the task's hidden checks need in the carried workspace is
made the same way (``clear_paths``).
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
from collections.abc import Generator, Iterator
from dataclasses import dataclass, field

MAX_DEPTH = 256
MAX_ENTRIES = 1_000_000
MAX_BYTES = 32 * 1024**3  # data bytes (a sparse file's holes are free): beyond any sane workspace
MAX_SKIPPED_NAMED = 20
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_CHUNK = 8 * 1024 * 1024


@dataclass
class Carried:
    """What a carry did: counts, and what it left behind (a few named, all counted)."""

    files: int = 0
    bytes: int = 0
    skipped: int = 0
    skipped_named: list[str] = field(default_factory=list)
    stopped: str | None = None  # the bound that ended the copy early

    def skip(self, rel: str, why: str) -> None:
        self.skipped += 1
        if len(self.skipped_named) < MAX_SKIPPED_NAMED:
            self.skipped_named.append(f"{rel[:200]} ({why})")

    def gap(self) -> str | None:
        """The row's evidence gap for this carry, or None when all of it came over."""
        if not self.skipped and self.stopped is None:
            return None
        named = "; ".join(self.skipped_named)
        stopped = f"stopped at {self.stopped}; " if self.stopped else ""
        return f"workspace_carry_partial: {stopped}{self.skipped} entries left behind: {named}"[:1000]


class _Bound(Exception):
    pass


def copy_untrusted_tree(src: str, dst: str, owner: tuple[int, int] | None = None) -> Carried:
    """Copy what directory ``src`` holds into the existing directory ``dst`` as the module says.
    ``owner`` (uid, gid): the grading sandbox's user, given all that is made. Blocking."""
    done = Carried()
    for _ in copy_steps(src, dst, owner, done):
        pass
    return done


def copy_steps(
    src: str, dst: str, owner: tuple[int, int] | None, done: Carried
) -> Generator[None, None, None]:
    """``copy_untrusted_tree`` a step at a time: each entry, and each chunk of a file's data, is one
    (sandboxes/inline.py's ``in_slices`` runs them on an event loop, a slice of its time at once, where
    both directories are in memory and no step can wait on a disk). ``done`` says what was done. A
    closed iterator closes every descriptor it holds."""
    try:
        src_fd = os.open(src, _DIR_FLAGS)
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.ENOTDIR, errno.ENOENT):
            raise
        # The workspace itself is no directory: a container's agent, root in it, can replace its
        # /rollout/work by a link or a file. Never followed, and no failure (a failed carry is masked,
        # which must not be the agent's choice): nothing comes over, and the row says why.
        done.skip(".", f"the workspace is no directory ({exc.strerror})")
        return
    try:
        dst_fd = os.open(dst, _DIR_FLAGS)
        try:
            yield from _copy_dir(src_fd, dst_fd, "", 0, owner, done)
        except _Bound:
            pass
        finally:
            os.close(dst_fd)
    finally:
        os.close(src_fd)


def _copy_dir(
    src_fd: int, dst_fd: int, rel: str, depth: int, owner: tuple[int, int] | None, done: Carried
) -> Iterator[None]:
    # Recursion only as deep as MAX_DEPTH: each level holds two descriptors.
    with os.scandir(src_fd) as entries:
        names = [entry.name for entry in entries]
    for name in names:
        yield
        path = f"{rel}/{name}" if rel else name
        if done.files + done.skipped >= MAX_ENTRIES:
            done.stopped = f"{MAX_ENTRIES} entries"
            raise _Bound
        try:
            st = os.stat(name, dir_fd=src_fd, follow_symlinks=False)
        except FileNotFoundError:
            continue  # gone meanwhile: not part of the final workspace
        if stat.S_ISLNK(st.st_mode):
            try:
                os.symlink(os.readlink(name, dir_fd=src_fd), name, dir_fd=dst_fd)
                if owner is not None:
                    os.chown(name, *owner, dir_fd=dst_fd, follow_symlinks=False)
                done.files += 1
            except OSError as exc:
                done.skip(path, exc.strerror or "link")
        elif stat.S_ISDIR(st.st_mode):
            if depth + 1 >= MAX_DEPTH:
                done.skip(path, f"deeper than {MAX_DEPTH}")
                continue
            try:
                sub_src = os.open(name, _DIR_FLAGS, dir_fd=src_fd)
            except OSError as exc:  # swapped for a link meanwhile (ELOOP, ENOTDIR), or unreadable
                done.skip(path, exc.strerror or "directory")
                continue
            try:
                try:
                    os.mkdir(name, 0o700, dir_fd=dst_fd)
                except FileExistsError:
                    pass
                sub_dst = os.open(name, _DIR_FLAGS, dir_fd=dst_fd)
                try:
                    yield from _copy_dir(sub_src, sub_dst, path, depth + 1, owner, done)
                    _set_stat(sub_dst, st, owner)
                finally:
                    os.close(sub_dst)
            finally:
                os.close(sub_src)
            done.files += 1
        elif stat.S_ISREG(st.st_mode):
            yield from _copy_file(src_fd, dst_fd, name, path, owner, done)
        else:
            done.skip(path, "not a regular file, directory or link")


def _copy_file(
    src_fd: int, dst_fd: int, name: str, path: str, owner: tuple[int, int] | None, done: Carried
) -> Iterator[None]:
    fin = _open_regular(src_fd, name, path, done)
    if fin is None:
        return
    try:
        st = os.fstat(fin)
        fout = os.open(
            name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dst_fd
        )
        try:
            yield from _copy_data(fin, fout, st.st_size, done)
            os.ftruncate(fout, st.st_size)  # a trailing hole
            _set_stat(fout, st, owner)
        finally:
            os.close(fout)
        done.files += 1
    finally:
        os.close(fin)


def _open_regular(src_fd: int, name: str, path: str, done: Carried) -> int | None:
    """``name`` opened for reading if it is a regular file, else None (and skipped). Its type is checked
    on an O_PATH descriptor, which opens nothing, and the file is then reopened through that very inode:
    an entry swapped between the directory's stat and the open for a FIFO (which could hang the copy)
    or a device node (a container's root may make one, and opening some has effects on the host, a
    watchdog's arms it) is never opened."""
    try:
        handle = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=src_fd)
    except OSError as exc:
        done.skip(path, exc.strerror or "file")
        return None
    try:
        if not stat.S_ISREG(os.fstat(handle).st_mode):
            done.skip(path, "not a regular file")
            return None
        return os.open(f"/proc/self/fd/{handle}", os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        done.skip(path, exc.strerror or "file")
        return None
    finally:
        os.close(handle)


def _copy_data(fin: int, fout: int, size: int, done: Carried) -> Iterator[None]:
    """The data of ``fin`` to ``fout`` at the same offsets, holes skipped; a step a chunk."""
    offset = 0
    while offset < size:
        try:
            start = os.lseek(fin, offset, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno == errno.ENXIO:  # nothing but a hole up to the end
                return
            start = offset  # a filesystem without SEEK_DATA: all of it is data
        try:
            end = os.lseek(fin, start, os.SEEK_HOLE)
        except OSError:
            end = size
        end = min(end, size)
        while start < end:
            if done.bytes >= MAX_BYTES:
                done.stopped = f"{MAX_BYTES} bytes"
                raise _Bound
            n = _copy_range(fin, fout, min(_CHUNK, end - start), start)
            if n <= 0:  # the file shrank meanwhile
                return
            start += n
            done.bytes += n
            if start < end:
                yield
        offset = end


# copy_file_range refuses some pairs of filesystems (two tmpfs instances, as each sandbox's disk is, on
# kernels before 5.19; a FUSE or network mount): those copy through a buffer, at the same offsets.
_NO_COPY_RANGE = frozenset({errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL})


def _copy_range(fin: int, fout: int, count: int, offset: int) -> int:
    try:
        return os.copy_file_range(fin, fout, count, offset, offset)
    except OSError as exc:
        if exc.errno not in _NO_COPY_RANGE:
            raise
    data = os.pread(fin, count, offset)
    return os.pwrite(fout, data, offset) if data else 0


def _set_stat(fd: int, st: os.stat_result, owner: tuple[int, int] | None) -> None:
    os.fchmod(fd, stat.S_IMODE(st.st_mode) & 0o777)  # no set-user-ID or sticky bits carried
    if owner is not None:
        os.fchown(fd, *owner)
    os.utime(fd, ns=(st.st_atime_ns, st.st_mtime_ns))


def clear_paths(root: str, paths: list[str]) -> None:
    """Make room in the directory ``root`` for a file at each of ``paths`` (relative, checked): every
    ancestor of it that is a link or not a directory is removed, then whatever is at the path itself (a
    tree, a link, a file). Every step goes by a directory descriptor opened without following a link, so
    nothing outside ``root`` is reached whatever the tree holds. Blocking."""
    top = os.open(root, _DIR_FLAGS)
    try:
        for path in paths:
            _clear_one(top, path.split("/"))
    finally:
        os.close(top)


def _clear_one(top: int, parts: list[str]) -> None:
    fd = os.dup(top)
    try:
        for name in parts[:-1]:
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                return  # nothing there, nor below
            if not stat.S_ISDIR(st.st_mode):
                os.unlink(name, dir_fd=fd)  # a link or a file where a directory belongs
                return
            below = os.open(name, _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = below
        try:
            st = os.stat(parts[-1], dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            return
        if stat.S_ISDIR(st.st_mode):
            shutil.rmtree(parts[-1], dir_fd=fd)  # by descriptors, links never followed
        else:
            os.unlink(parts[-1], dir_fd=fd)
    finally:
        os.close(fd)

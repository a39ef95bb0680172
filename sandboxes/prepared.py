"""Workspaces laid out once on the worker's host, git baseline included, and copied into each sandbox.

A task's samples and retries share one workspace; laying it out in every sandbox cost five git processes
and about 40 ms a rollout, each git run inside the sandbox. Here the worker builds the workspace once in
a directory of its own (the task's ``copy_from``, its inline files, the baseline commit made by this
host's git) and each sandbox gets a copy, the same tree ``lay_out`` would have made in it.

An entry is keyed by the inline files and by the path, mode, size and mtime of everything under
``copy_from``, so a source edited during a run gets a new entry. At most ``max_entries`` are kept; the
least recently used one goes once no copy reads it. Each worker keeps its entries in its run's directory
under the sandbox root, ``<root>/<run_id>/prepared-workspaces/<owner>/``, named after its owner record
(sandboxes/owner.py); ``reap_prepared`` removes those whose owner is dead, and no others.
Without git on this host the cache steps aside and the sandbox makes its own baseline; so it does for a
``copy_from`` that is a git repository, whose config could make git run programs of the task's choosing.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import secrets
import shutil
import stat
import subprocess
from collections import OrderedDict
from collections.abc import AsyncIterator
from pathlib import Path

from sandboxes import owner
from sandboxes.base import SandboxError, WorkspaceSpec
from sandboxes.inline import inline_if
from sandboxes.local import write_confined
from sandboxes.workspace import (
    BASELINE_SCRIPT,
    COMPACT_BASELINE_SCRIPT,
    GIT_NOT_FOUND,
    GIT_TIMEOUT_S,
    WorkspaceError,
    git_failure,
    git_script,
)

PREPARED_DIR = "prepared-workspaces"
MAX_ENTRIES = 32


class PreparedWorkspaces:
    """One worker's laid-out workspaces for run ``run_id`` under the sandbox root ``root``; an asyncio
    object of that worker's loop."""

    def __init__(self, root: Path, run_id: str, max_entries: int = MAX_ENTRIES) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be at least 1, not {max_entries}")
        self.root = Path(root) / run_id / PREPARED_DIR / owner.hold(Path(root))
        self.max_entries = max_entries
        self.builds = 0  # how many entries were laid out; the rest of the uses were copies
        self._entries: OrderedDict[str, Path] = OrderedDict()
        self._readers: dict[str, int] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._host_has_git = True

    @contextlib.asynccontextmanager
    async def use(
        self, spec: WorkspaceSpec, files: dict[str, str], key: str | None = None
    ) -> AsyncIterator[Path | None]:
        """The laid-out workspace for ``spec`` (``files`` its checked inline files), kept while the
        caller copies it; None when this host has no git. ``key``: the entry an earlier use for the
        same workspace got (``key_of_entry``), taken as it is while it is kept: the grading sandbox's
        baseline is then the one the agent's workspace was laid out from, whatever its source became
        since, and its source is not walked again."""
        # A task's own repository is committed inside the sandbox, as without this cache: its config may
        # name programs (filters, hooks, fsmonitor) for git to run, and only the sandbox may run them.
        if not self._host_has_git or (
            spec.copy_from and os.path.lexists(os.path.join(spec.copy_from, ".git"))
        ):
            yield None
            return
        if key is None or key not in self._entries:
            # Inline files alone are hashed here; a copy_from is walked in a thread, as it may be large.
            key = await inline_if(not spec.copy_from, _key_of, spec, files)
        self._readers[key] = self._readers.get(key, 0) + 1
        try:
            path = await self._entry(key, spec, files)
            yield None if path is None else path / "ws"
        finally:
            self._readers[key] -= 1
            if not self._readers[key]:
                del self._readers[key]
            await self._evict()

    async def _entry(self, key: str, spec: WorkspaceSpec, files: dict[str, str]) -> Path | None:
        # One build per key; the copies that follow run side by side, outside the lock.
        async with self._locks.setdefault(key, asyncio.Lock()):
            path = self._entries.get(key)
            if path is None:
                path = self.root / key
                if not await asyncio.to_thread(_build, spec, files, path):
                    self._host_has_git = False
                    return None
                self.builds += 1
                self._entries[key] = path
            self._entries.move_to_end(key)
            return path

    @staticmethod
    def key_of_entry(template: Path) -> str:
        """The key of the entry whose workspace ``use`` gave as ``template``."""
        return template.parent.name

    async def _evict(self) -> None:
        idle = [key for key in self._entries if key not in self._readers]
        for key in idle[: max(0, len(self._entries) - self.max_entries)]:
            path = self._entries.pop(key)
            self._locks.pop(key, None)
            await asyncio.to_thread(shutil.rmtree, path, True)

    async def aclose(self) -> None:
        """Remove every entry; the object may be used again afterwards."""
        self._entries.clear()
        await asyncio.to_thread(shutil.rmtree, self.root, True)


def reap_prepared(root: Path) -> list[str]:
    """Remove the entries of every run's workers under the sandbox root ``root`` whose owner is dead;
    returns the directories removed, relative to ``root``."""
    return owner.reap_dead_dirs(root, PREPARED_DIR)


def _key_of(spec: WorkspaceSpec, files: dict[str, str]) -> str:
    digest = hashlib.sha256(json.dumps(sorted(files.items())).encode())
    if spec.copy_from:
        src = os.path.realpath(spec.copy_from)
        digest.update(src.encode() + b"\0")
        lines: list[str] = []
        _stat_lines(src, "", lines)
        digest.update("".join(lines).encode())
    return digest.hexdigest()[:32]


def _stat_lines(directory: str, rel: str, lines: list[str]) -> None:
    """A line for each entry under ``directory`` (its path under the source, mode, size and mtime), a
    directory's entries sorted and each subdirectory's after its own line; links are not followed.
    Each use of a prepared workspace walks its source: one lstat an entry (a DirEntry's), no more."""
    with os.scandir(directory) as it:
        entries = sorted(it, key=lambda entry: entry.name)
    for entry in entries:
        st = entry.stat(follow_symlinks=False)
        path = rel + entry.name
        lines.append(f"{path}\0{st.st_mode}\0{st.st_size}\0{st.st_mtime_ns}\n")
        if stat.S_ISDIR(st.st_mode):
            _stat_lines(entry.path, path + "/", lines)


def _build(spec: WorkspaceSpec, files: dict[str, str], path: Path) -> bool:
    """Lay the workspace out at ``path``/ws and commit its baseline; False when this host has no git."""
    staging = path.with_name(f"{path.name}.{secrets.token_hex(4)}.tmp")
    workdir = staging / "ws"
    try:
        if spec.copy_from:
            try:
                shutil.copytree(spec.copy_from, workdir, symlinks=True)
            except (OSError, shutil.Error) as exc:
                raise WorkspaceError(f"cannot copy workspace {spec.copy_from!r}: {str(exc)[:2000]}") from exc
        else:
            workdir.mkdir(parents=True)
        inside = os.path.realpath(workdir)
        for rel, text in files.items():
            # A symlink from copy_from must not lead an inline file, or its directories, out.
            try:
                write_confined(inside, inside, rel, text.encode(), 0o644, "the workspace")
            except SandboxError as exc:
                raise WorkspaceError(str(exc)) from exc
        argv, env = git_script(BASELINE_SCRIPT + COMPACT_BASELINE_SCRIPT, str(workdir))
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LC_ALL": "C", **env}
        try:
            proc = subprocess.run(
                argv, cwd=workdir, env=env, capture_output=True, text=True, timeout=GIT_TIMEOUT_S
            )
        except subprocess.TimeoutExpired as exc:
            raise git_failure("baseline", "timed out", str(exc.stderr or "")) from exc
        if proc.returncode == GIT_NOT_FOUND:
            return False
        if proc.returncode != 0:
            raise git_failure("baseline", f"exit {proc.returncode}", proc.stderr)
        os.replace(staging, path)
        return True
    finally:
        shutil.rmtree(staging, ignore_errors=True)

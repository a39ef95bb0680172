"""Laying out a task's workspace in a sandbox, and reading back what the agent changed there.

After ``lay_out`` the workspace is a git repository (when the sandbox has git) whose state right after
lay-out is recorded as the commit ``refs/rollout/baseline``. ``workspace_diff`` compares the working tree
against it, new files included, so the diff holds the agent's changes and nothing of the lay-out. A
workspace that was not a repository gets ``git init`` and the baseline as its first commit; a copied
repository keeps its HEAD, branch and index untouched (the baseline commit hangs off HEAD, unreferenced
by any branch).
"""

from __future__ import annotations

import posixpath
from pathlib import Path, PurePosixPath
from typing import Protocol, runtime_checkable

from sandboxes.base import ExecResult, Sandbox, SandboxError, WorkspaceSpec

BASELINE_REF = "refs/rollout/baseline"
GIT_TIMEOUT_S = 300.0
DIFF_LIMIT_BYTES = 1024 * 1024
GIT_NOT_FOUND = 127

# Fixed identity and no system or global config: the result must not depend on the host's git setup.
_GIT_ENV = {
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_CONFIG_GLOBAL": "/dev/null",
    "GIT_TERMINAL_PROMPT": "0",
    "GIT_AUTHOR_NAME": "rollout",
    "GIT_AUTHOR_EMAIL": "rollout@localhost",
    "GIT_COMMITTER_NAME": "rollout",
    "GIT_COMMITTER_EMAIL": "rollout@localhost",
}
# The task's repository config must not run programs of its choosing (fsmonitor, hooks, diff drivers)
# or start background maintenance that would outlive the command.
_GIT_OPTIONS = [
    "-c", "core.fsmonitor=false",
    "-c", "core.hooksPath=/dev/null",
    "-c", "commit.gpgSign=false",
    "-c", "init.defaultBranch=main",
    "-c", "gc.auto=0",
    "-c", "maintenance.auto=false",
    "-c", "safe.directory=*",
]  # fmt: skip


class WorkspaceError(SandboxError):
    """The workspace could not be laid out as the task asked."""


@runtime_checkable
class CopiesIn(Protocol):
    """A sandbox that can take a local directory's content into its workspace."""

    async def copy_in(self, src: Path) -> None: ...


def checked_relative_path(path: str) -> str:
    """``path`` normalized, if it is relative and stays inside the workspace; else WorkspaceError."""
    pure = PurePosixPath(path)
    if not path or "\0" in path or pure.is_absolute() or ".." in pure.parts or not pure.parts:
        raise WorkspaceError(f"workspace file path {path!r} must be relative and stay inside the workspace")
    return str(pure)


async def lay_out(sandbox: Sandbox, spec: WorkspaceSpec) -> None:
    """``copy_from`` first, then the inline ``files`` over it, then the git baseline."""
    files = {checked_relative_path(rel): text for rel, text in spec.files.items()}
    if spec.copy_from:
        src = Path(spec.copy_from)
        if not src.is_dir():
            raise WorkspaceError(f"workspace copy_from {spec.copy_from!r} is not a directory")
        if not isinstance(sandbox, CopiesIn):
            raise WorkspaceError(f"sandbox {sandbox.id} cannot copy in a local directory")
        await sandbox.copy_in(src)
    for rel, text in files.items():
        await sandbox.write_file(rel, text.encode())
    await record_baseline(sandbox)


async def _git(sandbox: Sandbox, *args: str, name: str, index: str | None = None) -> ExecResult:
    env = dict(_GIT_ENV)
    # Never climb above the workspace into a repository that happens to contain the sandbox root.
    env["GIT_CEILING_DIRECTORIES"] = posixpath.dirname(sandbox.workdir.rstrip("/"))
    if index is not None:
        env["GIT_INDEX_FILE"] = index
    return await sandbox.exec(
        ["git", *_GIT_OPTIONS, *args], timeout=GIT_TIMEOUT_S, cwd=sandbox.workdir, env=env, name=name
    )


def _ok(result: ExecResult, what: str) -> str:
    if result.exit_code != 0:
        how = "timed out" if result.timed_out else f"exit {result.exit_code}, signal {result.signal}"
        raise WorkspaceError(f"git {what} failed ({how}): {result.stderr_tail[-1000:]}")
    return result.stdout_tail.strip()


async def _git_dir(sandbox: Sandbox) -> str | None:
    """The workspace's absolute git directory; None if it is no repository or there is no git."""
    probe = await _git(sandbox, "rev-parse", "--absolute-git-dir", name="git-probe")
    return probe.stdout_tail.strip() if probe.exit_code == 0 else None


async def record_baseline(sandbox: Sandbox) -> bool:
    """Commit the workspace as it is now under ``BASELINE_REF``; False if the sandbox has no git."""
    probe = await _git(sandbox, "rev-parse", "--absolute-git-dir", name="git-probe")
    if probe.exit_code == GIT_NOT_FOUND:
        return False
    if probe.exit_code != 0:
        _ok(await _git(sandbox, "init", "-q", name="git-baseline"), "init")
        _ok(await _git(sandbox, "add", "-A", name="git-baseline"), "add")
        commit = ["commit", "-q", "--allow-empty", "--no-verify", "-m", "workspace baseline"]
        _ok(await _git(sandbox, *commit, name="git-baseline"), "commit")
        _ok(await _git(sandbox, "update-ref", BASELINE_REF, "HEAD", name="git-baseline"), "update-ref")
        return True
    # An existing repository: snapshot through a private index so HEAD and the real index stay as given.
    index = posixpath.join(probe.stdout_tail.strip(), "rollout-baseline.index")
    _ok(await _git(sandbox, "add", "-A", name="git-baseline", index=index), "add")
    tree = _ok(await _git(sandbox, "write-tree", name="git-baseline", index=index), "write-tree")
    head = await _git(sandbox, "rev-parse", "--verify", "-q", "HEAD^{commit}", name="git-baseline")
    parents = ["-p", head.stdout_tail.strip()] if head.exit_code == 0 else []
    commit_tree = ["commit-tree", tree, *parents, "-m", "workspace baseline"]
    commit = _ok(await _git(sandbox, *commit_tree, name="git-baseline"), "commit-tree")
    _ok(await _git(sandbox, "update-ref", BASELINE_REF, commit, name="git-baseline"), "update-ref")
    return True


async def workspace_diff(sandbox: Sandbox, limit: int = DIFF_LIMIT_BYTES) -> str | None:
    """The agent's changes since the baseline (new files too) as a git diff, at most ``limit`` bytes
    plus a truncation note; None when the workspace is no git repository or there is no git."""
    git_dir = await _git_dir(sandbox)
    if git_dir is None:
        return None
    # A private index, so that untracked files show up and the agent's own index is left alone.
    index = posixpath.join(git_dir, "rollout-diff.index")
    _ok(await _git(sandbox, "add", "-A", name="workspace-diff", index=index), "add")
    baseline = await _git(
        sandbox, "rev-parse", "--verify", "-q", BASELINE_REF + "^{commit}", name="git-probe"
    )
    base = [BASELINE_REF] if baseline.exit_code == 0 else []  # else HEAD, or nothing if unborn
    diff = ["diff", "--cached", "--no-color", "--no-ext-diff", "--no-textconv", *base]
    result = await _git(sandbox, *diff, name="workspace-diff", index=index)
    _ok(result, "diff")
    if result.stdout_path:
        data = await sandbox.read_file(result.stdout_path, limit)
    else:
        data = result.stdout_tail.encode()[:limit]
    text = data.decode("utf-8", errors="replace")
    if result.stdout_bytes > len(data):
        text += f"\n[diff truncated at {len(data)} of {result.stdout_bytes} bytes]\n"
    return text

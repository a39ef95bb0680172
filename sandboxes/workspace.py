"""Laying out a task's workspace in a sandbox, and reading back what the agent changed there.

The baseline, the workspace as the task gave it, is a commit ``refs/rollout/baseline`` in a bare git
directory of ours beside the workspace (``baseline_git_dir``), never in the workspace: the agent sees
the task as it was given (a copied repository keeps its own ``.git``, HEAD and index untouched), and
nothing of the baseline is in its reach. ``workspace_diff`` compares the working tree against it, new
files included, so the diff holds the agent's changes and nothing of the lay-out.

The diff is the evidence of what the agent did, and the agent is an adversary: it is taken in a sandbox
the agent never ran in (executor/grading.py lays the task out again there, baseline included, and
carries the agent's final workspace over), and it reads nothing the agent wrote but the files
themselves: no config, hooks, attributes, filters or ignore rules of the workspace's choosing, and
every file is hashed (the agent can set a file's size and mtime back, so no stat data is trusted). A
nested repository (a directory with a ``.git`` of its own) is staged file by file, as git would
otherwise show it as one commit id; a name git cannot be handed that way is named in the diff.
"""

from __future__ import annotations

import posixpath
import secrets
import shlex
from contextlib import AbstractAsyncContextManager
from pathlib import Path, PurePosixPath
from typing import Protocol, runtime_checkable

from sandboxes.base import ExecResult, ExecStep, RunsBefore, Sandbox, SandboxError, WorkspaceSpec

BASELINE_REF = "refs/rollout/baseline"
GIT_TIMEOUT_S = 300.0
DIFF_LIMIT_BYTES = 1024 * 1024
GIT_NOT_FOUND = 127

# Fixed identity and no system or global config: the result must not depend on the host's git setup.
_GIT_ENV = {
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_CONFIG_GLOBAL": "/dev/null",
    "GIT_TERMINAL_PROMPT": "0",
    "GIT_ATTR_NOSYSTEM": "1",
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
    "-c", "core.excludesFile=/dev/null",
    "-c", "core.attributesFile=/dev/null",
    "-c", "core.autocrlf=false",
    "-c", "core.quotePath=false",
]  # fmt: skip
# Over any .gitattributes the workspace holds ($GIT_DIR/info/attributes outranks them): no filter, eol or
# encoding conversion and no "binary" marking of the workspace's choosing; git judges text by content.
NEUTRAL_ATTRIBUTES = "* !diff !filter !text !eol !crlf !ident !merge !working-tree-encoding !whitespace"


class WorkspaceError(SandboxError):
    """The workspace could not be laid out as the task asked."""


@runtime_checkable
class CopiesIn(Protocol):
    """A sandbox that can take a local directory's content into its workspace, or into ``dest``."""

    async def copy_in(self, src: Path, dest: str | None = None) -> None: ...


class WorkspaceTemplates(Protocol):
    """Workspaces laid out once on this host, baseline included, for sandboxes to copy in
    (``sandboxes.prepared.PreparedWorkspaces``): ``use`` holds one for ``spec`` and its checked inline
    ``files`` while the caller copies it, or gives None when the sandbox must lay out its own; ``key``:
    an entry an earlier use got, taken as it is (``key_of_entry``)."""

    def use(
        self, spec: WorkspaceSpec, files: dict[str, str], key: str | None = None
    ) -> AbstractAsyncContextManager[Path | None]: ...

    def key_of_entry(self, template: Path) -> str: ...


def checked_relative_path(path: str) -> str:
    """``path`` normalized, if it is relative and stays inside the workspace; else WorkspaceError."""
    pure = PurePosixPath(path)
    if not path or "\0" in path or pure.is_absolute() or ".." in pure.parts or not pure.parts:
        raise WorkspaceError(f"workspace file path {path!r} must be relative and stay inside the workspace")
    return str(pure)


async def lay_out(
    sandbox: Sandbox,
    spec: WorkspaceSpec,
    prepared: WorkspaceTemplates | None = None,
    *,
    baseline: bool = True,
    files_too: bool = True,
    same_as: str | None = None,
) -> str | None:
    """``copy_from`` first, then the inline ``files`` over it, then (with ``baseline``) the git
    baseline. With ``prepared``, a sandbox that can copy a directory in gets the workspace as this host
    laid it out once, baseline included, and runs no git of its own. The agent's sandbox gets no
    baseline: its diff is taken in the verification sandbox (executor/grading.py). ``files_too``: False
    where the workspace's files are replaced right after (the verification sandbox gets the agent's):
    from a prepared lay-out, the baseline alone is copied (a task's repository is otherwise copied in
    only to be removed). Returns the prepared lay-out used, if any, which ``same_as`` then names to a
    later lay-out of the same workspace (the verification sandbox's: the baseline the agent's came
    from, while the worker keeps it; ``PreparedWorkspaces.use``)."""
    files = {checked_relative_path(rel): text for rel, text in spec.files.items()}
    if spec.copy_from and not Path(spec.copy_from).is_dir():
        raise WorkspaceError(f"workspace copy_from {spec.copy_from!r} is not a directory")
    if prepared is not None and isinstance(sandbox, CopiesIn):
        async with prepared.use(spec, files, same_as) as template:
            if template is not None:
                if files_too:
                    await sandbox.copy_in(template)
                if baseline and (git_dir := Path(baseline_git_dir(str(template)))).is_dir():
                    await sandbox.copy_in(git_dir, baseline_git_dir(sandbox.workdir))
                return prepared.key_of_entry(template)
    if spec.copy_from:
        if not isinstance(sandbox, CopiesIn):
            raise WorkspaceError(f"sandbox {sandbox.id} cannot copy in a local directory")
        await sandbox.copy_in(Path(spec.copy_from))
    for rel, text in files.items():
        await sandbox.write_file(rel, text.encode())
    if baseline:
        await record_baseline(sandbox)
    return None


_BASELINE_GIT_NAME = "baseline.git"
_BASELINE_GIT_ENV = "ROLLOUT_BASELINE_GIT"


def baseline_git_dir(workdir: str) -> str:
    """Where the baseline of a workspace that is no repository is kept: beside it, in the sandbox's own
    directory (its parent), out of the agent's workspace."""
    return posixpath.join(posixpath.dirname(posixpath.normpath(workdir)), _BASELINE_GIT_NAME)


# One shell script per operation rather than one exec per git command: each exec costs a process
# start-up and a supervisor, and the session pays for lay-out and diff on every rollout.
# ``stage`` puts the working tree into the index in $GIT_INDEX_FILE: ignored files too (-f: an ignore
# rule the agent planted must not hide a file), and a nested repository's files one by one (git would
# record it as one gitlink, its content unseen; a nested .git itself is never staged), and leaves their
# paths in $nested. Where there is none, one `git add` alone: it stages a nested repository (one
# with a commit) only with the warning it is told to give (a git too old to know the option fails), and
# fails on one without, so a clean and silent `git add` saw none; anything else is staged again the
# long way, past `find`'s list of every .git (a process and a fork: ~1 ms of every rollout's diff on a
# VM, where each dynamically linked start traps to the hypervisor).
_ADD_ERRORS = "rollout-add.err"  # stage's first `git add`'s stderr, beside the index
_PRELUDE = (
    "command -v git >/dev/null 2>&1 || exit 127\n"
    "g() { git "
    + shlex.join(_GIT_OPTIONS)
    + ' "$@"; }\n'
    + f"add_errors={_ADD_ERRORS}\n"
    + r"""stage() {
  nested= err="$GIT_DIR/$add_errors"
  g add --warn-embedded-repo -A -f -- . 2>"$err" && [ ! -s "$err" ] && return 0
  rm -f "$GIT_INDEX_FILE" "$err"  # what it staged of a nested repository: a gitlink
  found=$(find . -name .git -prune -print 2>/dev/null)
  set --
  old_ifs=$IFS; IFS='
'
  set -f
  for d in $found; do
    d=${d%/.git}; d=${d#./}
    [ "$d" = . ] && continue
    nested=${nested:+$nested$IFS}$d
    set -- "$@" ":(exclude,literal)$d"
  done
  set +f
  IFS=$old_ifs
  g add -A -f -- . "$@" >&2 || return 1
  [ -z "$nested" ] && return 0
  printf '%s\n' "$nested" | while IFS= read -r d; do
    find "./$d" -name .git -prune -o \( -type f -o -type l \) -print | sed 's|^\./||'
    g ls-files -- ":(literal)$d"
  done | g update-index --add --remove --stdin >&2
}
"""
)

_DIFF_INDEX = "rollout-diff.index"
BASELINE_SCRIPT = f"""set -e
export GIT_DIR="${_BASELINE_GIT_ENV}"
g init -q --bare --template=  # the work tree is named at each use, never recorded in its config
export GIT_WORK_TREE="$PWD"
mkdir -p "$GIT_DIR/info"
echo '{NEUTRAL_ATTRIBUTES}' > "$GIT_DIR/info/attributes"
export GIT_INDEX_FILE="$GIT_DIR/{_DIFF_INDEX}"
stage
g commit -q --allow-empty --no-verify -m "workspace baseline"
g update-ref {BASELINE_REF} HEAD
# Only what the diff reads: every file here is copied into each sandbox of a prepared workspace.
rm -rf "$GIT_DIR/logs" "$GIT_DIR/COMMIT_EDITMSG" "$GIT_INDEX_FILE" "$GIT_DIR/$add_errors"
"""

# For a baseline made once and copied into every sandbox (sandboxes/prepared.py): the fewest files and
# directories that still make it a git directory the diff reads (on a churned ext4 each one copied is
# an inode search), so its objects go into one pack, HEAD names the baseline and the empty directories go.
# 17 entries to 11 for an empty workspace; a workspace of N files no longer copies ~N loose objects.
COMPACT_BASELINE_SCRIPT = f"""set -e
if [ -f "${_BASELINE_GIT_ENV}/HEAD" ]; then
  export GIT_DIR="${_BASELINE_GIT_ENV}"
  g -c pack.writeReverseIndex=false repack -a -d -q -n
  g symbolic-ref HEAD {BASELINE_REF}
  g update-ref -d refs/heads/main
  rm -rf "$GIT_DIR/objects/info" "$GIT_DIR/refs/tags" "$GIT_DIR/refs/heads" "$GIT_DIR/logs"
fi
"""

_NOT_A_REPO = 3
_DIFF_NAME = "workspace-diff"
_DIFF_OPTIONS = ["--cached", "--no-color", "--no-ext-diff", "--no-textconv", "--no-renames"]
# Only our baseline: a workspace without one (a sandbox with no git at lay-out) has no diff. A fresh
# index, so every file is hashed: no stat data the agent could have set is trusted. Gitlinks left in the
# index (a nested repository git would not let us stage file by file) are named, not silently shown as
# a commit id; git makes a gitlink only of a directory holding a .git, which stage lists in $nested, so
# only then is the index listed.
_DIFF_SCRIPT = f"""gd="${_BASELINE_GIT_ENV}"
[ -f "$gd/HEAD" ] || exit {_NOT_A_REPO}
export GIT_DIR="$gd" GIT_WORK_TREE="$PWD" GIT_INDEX_FILE="$gd/{_DIFF_INDEX}"
[ ! -e "$GIT_INDEX_FILE" ] || rm -f "$GIT_INDEX_FILE"  # only a rerun finds one: rm is a process
stage || exit 4
g diff {shlex.join(_DIFF_OPTIONS)} {BASELINE_REF} || exit 4
[ -z "$nested" ] && exit 0
g ls-files -s | while read -r mode _ _ path; do
  [ "$mode" = 160000 ] && echo "[nested repository $path: its files could not be listed one by one]"
done
exit 0
"""


def git_script(body: str, workdir: str) -> tuple[list[str], dict[str, str]]:
    """The argv and git environment that run ``body`` in ``workdir``, in a sandbox or on this host."""
    return ["sh", "-c", _PRELUDE + body], _git_env(workdir)


def _git_env(workdir: str) -> dict[str, str]:
    env = dict(_GIT_ENV)
    # Never climb above the workspace into a repository that happens to contain the sandbox root.
    env["GIT_CEILING_DIRECTORIES"] = posixpath.dirname(workdir.rstrip("/"))
    env[_BASELINE_GIT_ENV] = baseline_git_dir(workdir)
    return env


async def _git_script(sandbox: Sandbox, body: str, name: str) -> ExecResult:
    argv, env = git_script(body, sandbox.workdir)
    return await sandbox.exec(argv, timeout=GIT_TIMEOUT_S, cwd=sandbox.workdir, env=env, name=name)


def _ok(result: ExecResult, what: str) -> None:
    if result.exit_code != 0:
        how = "timed out" if result.timed_out else f"exit {result.exit_code}, signal {result.signal}"
        raise git_failure(what, how, result.stderr_tail)


def git_failure(what: str, how: str, stderr: str) -> WorkspaceError:
    return WorkspaceError(f"git {what} failed ({how}): {stderr[-1000:]}")


async def record_baseline(sandbox: Sandbox) -> bool:
    """Commit the workspace as it is now under ``BASELINE_REF``; False if the sandbox has no git."""
    result = await _git_script(sandbox, BASELINE_SCRIPT, "git-baseline")
    if result.exit_code == GIT_NOT_FOUND:
        return False
    _ok(result, "baseline")
    return True


def diff_step(workdir: str) -> ExecStep:
    """The command that prints the workspace's diff, as a step to run before another command in the
    workspace (``Sandbox.exec(..., before=...)`` where the sandbox ``RunsBefore``); ``read_diff`` reads
    its result."""
    argv, env = git_script(_DIFF_SCRIPT, workdir)
    return ExecStep(argv=argv, timeout=GIT_TIMEOUT_S, name=_DIFF_NAME, env=env)


async def workspace_diff(sandbox: Sandbox, limit: int = DIFF_LIMIT_BYTES) -> str | None:
    """The agent's changes since the baseline (new files too) as a git diff, at most ``limit`` bytes
    plus a truncation note; None when the workspace is no git repository or there is no git."""
    if isinstance(sandbox, RunsBefore):
        result = await _two_gits(sandbox)
        if result is not None:
            return await read_diff(sandbox, result, limit)
    return await read_diff(sandbox, await _git_script(sandbox, _DIFF_SCRIPT, _DIFF_NAME), limit)


async def _two_gits(sandbox: Sandbox) -> ExecResult | None:
    """The diff's common case without its shell: its two `git`s as a step and its command, one exec
    (a shell's start is ~1 ms of CPU here, each a dynamically linked program's CPUID probes trapping to
    the hypervisor). None where that case is not the workspace's: `git add` failed or said anything
    (a nested repository, no baseline, no git), or the diff failed; ``_DIFF_SCRIPT`` then takes the
    diff, and its word is the diff's. A fresh index of its own name each time: nothing staged before,
    and no stat data, is trusted. A step past its timeout is the diff's failure, as the script's is:
    not tried again."""
    workdir = sandbox.workdir
    env = _git_env(workdir)
    git_dir = env["GIT_DIR"] = env[_BASELINE_GIT_ENV]
    env["GIT_WORK_TREE"] = workdir
    env["GIT_INDEX_FILE"] = posixpath.join(git_dir, f"rollout-diff-{secrets.token_hex(8)}.index")
    stage = ["git", *_GIT_OPTIONS, "add", "--warn-embedded-repo", "-A", "-f", "--", "."]
    result = await sandbox.exec(  # type: ignore[call-arg]  # a RunsBefore sandbox (see the caller)
        ["git", *_GIT_OPTIONS, "diff", *_DIFF_OPTIONS, BASELINE_REF],
        timeout=GIT_TIMEOUT_S,
        cwd=workdir,
        env=env,
        name=_DIFF_NAME,
        before=ExecStep(argv=stage, timeout=GIT_TIMEOUT_S, name="git-stage"),
    )
    staged = result.before
    if staged is not None and staged.timed_out:
        raise git_failure("diff", "timed out", staged.stderr_tail)  # its diff ran on a part of the tree
    if staged is None or staged.exit_code != 0 or staged.stderr_bytes:
        return None
    return result if result.exit_code == 0 or result.timed_out else None  # read_diff: a timeout fails


async def read_diff(sandbox: Sandbox, result: ExecResult | None, limit: int = DIFF_LIMIT_BYTES) -> str | None:
    """What ``workspace_diff`` returns, from the result of a ``diff_step`` (None: it did not run)."""
    if result is None:
        raise WorkspaceError("the exec returned no result of its diff step")
    if result.exit_code in (GIT_NOT_FOUND, _NOT_A_REPO):
        return None
    _ok(result, "diff")
    if result.stdout_path:
        data = await sandbox.read_file(result.stdout_path, limit)
    else:
        data = result.stdout_tail.encode()[:limit]
    text = data.decode("utf-8", errors="replace")
    if result.stdout_bytes > len(data):
        text += f"\n[diff truncated at {len(data)} of {result.stdout_bytes} bytes]\n"
    return text

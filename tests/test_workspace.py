"""Workspace lay-out in a real local sandbox, and the diff of what changed after it."""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest

from sandboxes import workspace as workspace_module
from sandboxes.base import SandboxSpec, WorkspaceSpec
from sandboxes.local import LocalSandbox, LocalSandboxProvider
from sandboxes.prepared import PREPARED_DIR, PreparedWorkspaces, reap_prepared
from sandboxes.workspace import WorkspaceError, lay_out, read_diff, workspace_diff
from tests.test_shared_root import dead_owner

needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")

GIT_ENV = {
    "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
    "HOME": "/nonexistent",
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_CONFIG_GLOBAL": "/dev/null",
    "GIT_AUTHOR_NAME": "t",
    "GIT_AUTHOR_EMAIL": "t@t",
    "GIT_COMMITTER_NAME": "t",
    "GIT_COMMITTER_EMAIL": "t@t",
}


def git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-c", "init.defaultBranch=main", *args],
        cwd=repo,
        env=GIT_ENV,
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout


@pytest.fixture(params=["in_sandbox", "prepared"])
def prepared(request: pytest.FixtureRequest, tmp_path: Path) -> PreparedWorkspaces | None:
    """Each lay-out test runs both ways: git inside the sandbox, and a copy of the worker's prepared one."""
    return PreparedWorkspaces(tmp_path / "prepared", "run") if request.param == "prepared" else None


@pytest.fixture
async def sandbox(tmp_path: Path):
    provider = LocalSandboxProvider(tmp_path / "sandboxes")
    sb = await provider.start(SandboxSpec(run_id="run", session_id=uuid.uuid4().hex[:12], ttl_s=600))
    yield sb
    await sb.stop()


@needs_git
async def test_inline_files_then_diff_of_the_agents_edits(
    sandbox: LocalSandbox, prepared: PreparedWorkspaces | None
) -> None:
    await lay_out(
        sandbox, WorkspaceSpec(files={"README.md": "# task\n", "src/pkg/mod.py": "x = 1\n"}), prepared
    )
    assert Path(sandbox.workdir, "src/pkg/mod.py").read_text() == "x = 1\n"
    assert await sandbox.read_file("README.md", 100) == b"# task\n"
    assert await workspace_diff(sandbox) == ""  # the lay-out itself is the baseline, not a change

    # The agent edits one file and creates another; neither is staged, like a harness would leave them.
    await sandbox.write_file("src/pkg/mod.py", b"x = 2\n")
    await sandbox.exec(["bash", "-c", "echo new > notes.txt"], timeout=30)
    diff = await workspace_diff(sandbox)
    assert diff is not None
    assert "--- a/src/pkg/mod.py" in diff and "-x = 1" in diff and "+x = 2" in diff
    assert "+++ b/notes.txt" in diff and "+new" in diff
    assert "README.md" not in diff


@needs_git
async def test_a_workspace_that_is_no_repository_stays_one_and_its_agents_own_repository_is_not_ours(
    sandbox: LocalSandbox, prepared: PreparedWorkspaces | None
) -> None:
    await lay_out(sandbox, WorkspaceSpec(files={"app.py": "v = 1\n"}), prepared)
    work = Path(sandbox.workdir)
    assert sorted(p.name for p in work.iterdir()) == ["app.py"]  # no .git, nothing of ours
    outside = {**GIT_ENV, "GIT_CEILING_DIRECTORIES": str(work.parent)}
    found = subprocess.run(["git", "rev-parse", "--git-dir"], cwd=work, env=outside, capture_output=True)
    assert found.returncode != 0  # the agent's git finds no repository, as the task gave none

    # The agent makes a repository of its own and commits its edit there: the diff is still against
    # the lay-out, and holds nothing of the agent's .git.
    script = "git init -q && echo 'v = 2' > app.py && git add -A && git commit -qm mine && echo n > new.txt"
    done = await sandbox.exec(["bash", "-c", script], timeout=30, env=GIT_ENV)
    assert done.exit_code == 0, done.stderr_tail
    diff = await workspace_diff(sandbox)
    assert diff is not None
    assert "-v = 1" in diff and "+v = 2" in diff and "+++ b/new.txt" in diff
    assert ".git/" not in diff


@needs_git
async def test_nested_repositories_show_file_by_file_whether_committed_or_not(
    sandbox: LocalSandbox, tmp_path: Path, prepared: PreparedWorkspaces | None
) -> None:
    """git stages a nested repository as one gitlink, its files unseen: one at the lay-out, one the agent
    commits in (git then only warns) and one it leaves without a commit (git then fails) all show."""
    src = tmp_path / "src"
    (src / "vendored").mkdir(parents=True)
    (src / "vendored" / "lib.py").write_text("v = 1\n")
    git(src / "vendored", "init", "-q")
    git(src / "vendored", "add", "-A")
    git(src / "vendored", "commit", "-q", "-m", "theirs")
    await lay_out(sandbox, WorkspaceSpec(copy_from=str(src)), prepared)
    assert await workspace_diff(sandbox) == ""

    script = (
        "echo 'v = 2' > vendored/lib.py"
        " && mkdir kept && cd kept && git init -q && echo 'k = 1' > k.py && git add -A && git commit -qm m"
        " && cd .. && mkdir bare && cd bare && git init -q && echo 'b = 1' > b.py"
    )
    done = await sandbox.exec(["bash", "-c", script], timeout=30, env=GIT_ENV)
    assert done.exit_code == 0, done.stderr_tail
    diff = await workspace_diff(sandbox)
    assert diff is not None
    assert "-v = 1" in diff and "+v = 2" in diff
    assert "+++ b/kept/k.py" in diff and "+k = 1" in diff
    assert "+++ b/bare/b.py" in diff and "+b = 1" in diff
    assert "Subproject commit" not in diff and ".git/" not in diff

    # Once the nested repositories are gone, the diff is git's one `add` again, and says the same.
    done = await sandbox.exec(["bash", "-c", "rm -rf vendored/.git kept/.git bare/.git"], timeout=30)
    assert done.exit_code == 0, done.stderr_tail
    assert await workspace_diff(sandbox) == diff


@needs_git
async def test_copy_from_a_git_repository(
    sandbox: LocalSandbox, tmp_path: Path, prepared: PreparedWorkspaces | None
) -> None:
    src = tmp_path / "repo"
    src.mkdir()
    git(src, "init", "-q")
    (src / "app.py").write_text("print('v1')\n")
    git(src, "add", "app.py")
    git(src, "commit", "-q", "-m", "first")
    (src / "untracked.txt").write_text("was there before\n")
    head = git(src, "rev-parse", "HEAD").strip()

    await lay_out(sandbox, WorkspaceSpec(copy_from=str(src), files={"extra.txt": "inline\n"}), prepared)
    work = Path(sandbox.workdir)
    assert (work / ".git").is_dir()
    assert (work / "app.py").read_text() == "print('v1')\n"
    assert (work / "untracked.txt").exists() and (work / "extra.txt").exists()
    assert git(work, "rev-parse", "HEAD").strip() == head  # the task's history is left as it was
    assert await workspace_diff(sandbox) == ""

    await sandbox.exec(["bash", "-c", "echo \"print('v2')\" > app.py"], timeout=30)
    diff = await workspace_diff(sandbox)
    assert diff is not None
    assert "-print('v1')" in diff and "+print('v2')" in diff
    assert "extra.txt" not in diff and "untracked.txt" not in diff
    assert (src / "app.py").read_text() == "print('v1')\n"  # the source repository is untouched


async def test_copy_from_keeps_symlinks_as_links(
    sandbox: LocalSandbox, tmp_path: Path, prepared: PreparedWorkspaces | None
) -> None:
    src = tmp_path / "plain"
    (src / "data").mkdir(parents=True)
    (src / "data" / "file.txt").write_text("content\n")
    os.symlink("data/file.txt", src / "link.txt")
    await lay_out(sandbox, WorkspaceSpec(copy_from=str(src)), prepared)
    link = Path(sandbox.workdir, "link.txt")
    assert link.is_symlink() and os.readlink(link) == "data/file.txt"
    assert link.read_text() == "content\n"


@pytest.mark.parametrize("path", ["../outside.txt", "/etc/evil", "a/../../outside.txt", "", "."])
async def test_inline_paths_must_stay_inside(
    sandbox: LocalSandbox, path: str, prepared: PreparedWorkspaces | None
) -> None:
    with pytest.raises(WorkspaceError, match="must be relative"):
        await lay_out(sandbox, WorkspaceSpec(files={"ok.txt": "fine", path: "bad"}), prepared)
    assert not Path(sandbox.workdir, "ok.txt").exists()  # checked before anything is written
    assert not (sandbox.root / "outside.txt").exists()


async def test_copy_from_must_be_a_directory(
    sandbox: LocalSandbox, tmp_path: Path, prepared: PreparedWorkspaces | None
) -> None:
    with pytest.raises(WorkspaceError, match="not a directory"):
        await lay_out(sandbox, WorkspaceSpec(copy_from=str(tmp_path / "missing")), prepared)


async def test_without_git_there_is_no_diff(tmp_path: Path) -> None:
    provider = LocalSandboxProvider(tmp_path / "sandboxes")
    no_git = SandboxSpec(run_id="run", session_id="nogit", ttl_s=600, env={"PATH": str(tmp_path / "empty")})
    sb = await provider.start(no_git)
    try:
        await lay_out(sb, WorkspaceSpec(files={"a.txt": "a\n"}))
        assert Path(sb.workdir, "a.txt").read_text() == "a\n"
        assert not Path(sb.workdir, ".git").exists()
        assert await workspace_diff(sb) is None
    finally:
        await sb.stop()


@needs_git
async def test_diff_is_bounded(sandbox: LocalSandbox, prepared: PreparedWorkspaces | None) -> None:
    await lay_out(sandbox, WorkspaceSpec(files={"big.txt": ""}), prepared)
    await sandbox.write_file("big.txt", b"line\n" * 10_000)
    diff = await workspace_diff(sandbox, limit=1000)
    assert diff is not None
    body, note = diff.rsplit("\n[diff truncated at 1000 of ", 1)
    assert len(body.encode()) == 1000
    assert note.endswith(" bytes]\n")


# -- workspaces prepared once per worker -------------------------------------------------------------------


async def _started(provider: LocalSandboxProvider) -> LocalSandbox:
    spec = SandboxSpec(run_id="run", session_id=uuid.uuid4().hex[:12], ttl_s=600)
    return await provider.start(spec)  # type: ignore[return-value]


@needs_git
async def test_a_prepared_workspace_is_built_once_and_each_sandbox_gets_its_own_copy(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    spec = WorkspaceSpec(copy_from=str(src), files={"notes/task.md": "fix add\n"})
    prepared = PreparedWorkspaces(tmp_path / "prepared", "run")
    provider = LocalSandboxProvider(tmp_path / "sandboxes")
    first, second = await _started(provider), await _started(provider)
    try:
        await lay_out(first, spec, prepared)
        await first.write_file("calc.py", b"def add(a, b):\n    return a + b\n")  # the agent's fix
        await lay_out(second, spec, prepared)
        assert prepared.builds == 1
        assert Path(second.workdir, "calc.py").read_text() == "def add(a, b):\n    return a - b\n"
        assert Path(second.workdir, "notes/task.md").read_text() == "fix add\n"
        assert await workspace_diff(second) == ""
        first_diff = await workspace_diff(first)
        assert first_diff is not None and "+    return a + b" in first_diff and "task.md" not in first_diff

        # A source edited during the run is laid out anew, not served from the old entry.
        (src / "calc.py").write_text("def add(a, b):\n    return 0\n")
        third = await _started(provider)
        await lay_out(third, spec, prepared)
        assert prepared.builds == 2
        assert Path(third.workdir, "calc.py").read_text() == "def add(a, b):\n    return 0\n"
        await third.stop()
    finally:
        await first.stop()
        await second.stop()
        await provider.aclose()


@needs_git
async def test_a_grading_lay_out_copies_the_baseline_alone_and_the_agents_workspace_diffs_against_it(
    sandbox: LocalSandbox, tmp_path: Path, prepared: PreparedWorkspaces | None
) -> None:
    spec = WorkspaceSpec(files={"calc.py": "def add(a, b):\n    return a - b\n", "README.md": "# task\n"})
    await lay_out(sandbox, spec, prepared, files_too=False)
    laid_out = sorted(os.listdir(sandbox.workdir))
    # From a prepared lay-out the files are not copied (the agent's replace them); in the sandbox, its
    # git records them where they are.
    assert laid_out == ([] if prepared is not None else ["README.md", "calc.py"])
    # The agent's workspace, as the grading sandbox gets it: one file fixed, one removed, one new.
    for name in laid_out:
        os.unlink(Path(sandbox.workdir, name))
    await sandbox.write_file("calc.py", b"def add(a, b):\n    return a + b\n")
    await sandbox.write_file("new.txt", b"new\n")
    diff = await workspace_diff(sandbox)
    assert diff is not None
    assert "-    return a - b" in diff and "+    return a + b" in diff
    assert "--- a/README.md" in diff and "-# task" in diff and "+++ b/new.txt" in diff


@needs_git
async def test_the_grading_lay_out_takes_the_baseline_the_agents_came_from_whatever_the_source_became(
    tmp_path: Path,
) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    spec = WorkspaceSpec(copy_from=str(src))
    prepared = PreparedWorkspaces(tmp_path / "prepared", "run")
    provider = LocalSandboxProvider(tmp_path / "sandboxes")
    agent, grading = await _started(provider), await _started(provider)
    try:
        laid_out_as = await lay_out(agent, spec, prepared, baseline=False)
        assert laid_out_as is not None
        (src / "calc.py").write_text("def add(a, b):\n    return 0\n")  # edited during the agent's run
        await agent.write_file("calc.py", b"def add(a, b):\n    return a + b\n")  # the agent's fix
        assert await lay_out(grading, spec, prepared, files_too=False, same_as=laid_out_as) == laid_out_as
        assert prepared.builds == 1
        shutil.copy(Path(agent.workdir, "calc.py"), Path(grading.workdir, "calc.py"))  # the carry
        diff = await workspace_diff(grading)
        assert diff is not None and "-    return a - b" in diff and "+    return a + b" in diff

        # An entry no longer kept: the source as it is now, laid out anew.
        await prepared.aclose()
        third = await _started(provider)
        assert await lay_out(third, spec, prepared, files_too=False, same_as=laid_out_as) != laid_out_as
        assert prepared.builds == 2
        await third.stop()
    finally:
        await agent.stop()
        await grading.stop()
        await provider.aclose()


@needs_git
async def test_prepared_entries_are_bounded(tmp_path: Path) -> None:
    prepared = PreparedWorkspaces(tmp_path / "prepared", "run", max_entries=2)
    provider = LocalSandboxProvider(tmp_path / "sandboxes")
    try:
        for i in range(4):
            sb = await _started(provider)
            await lay_out(sb, WorkspaceSpec(files={"n.txt": f"{i}\n"}), prepared)
            assert Path(sb.workdir, "n.txt").read_text() == f"{i}\n"
            await sb.stop()
    finally:
        await provider.aclose()
    assert prepared.builds == 4
    assert len(list(prepared.root.iterdir())) == 2
    await prepared.aclose()
    assert not prepared.root.exists()


@pytest.mark.parametrize("inline", ["escape/x.txt", "escape/new/dir/x.txt"])
async def test_an_inline_file_cannot_leave_the_prepared_workspace_through_a_symlink(
    tmp_path: Path, inline: str
) -> None:
    src, outside = tmp_path / "src", tmp_path / "outside"
    src.mkdir()
    outside.mkdir()
    os.symlink(outside, src / "escape")
    prepared = PreparedWorkspaces(tmp_path / "prepared", "run")
    provider = LocalSandboxProvider(tmp_path / "sandboxes")
    sb = await _started(provider)
    try:
        with pytest.raises(WorkspaceError, match="outside the workspace"):
            await lay_out(sb, WorkspaceSpec(copy_from=str(src), files={inline: "x"}), prepared)
    finally:
        await sb.stop()
        await provider.aclose()
    assert list(outside.iterdir()) == []
    assert not prepared.root.exists() or list(prepared.root.iterdir()) == []  # no half-built entry


def test_reap_prepared_removes_only_the_entries_of_gone_workers(tmp_path: Path) -> None:
    mine = PreparedWorkspaces(tmp_path, "run").root  # this process: alive
    gone = tmp_path / "other-run" / PREPARED_DIR / dead_owner(tmp_path)
    elsewhere = tmp_path / "run" / PREPARED_DIR / "not-an-owner"
    for path in (mine, gone, elsewhere):
        (path / "entry").mkdir(parents=True)
    assert reap_prepared(tmp_path) == [f"other-run/{PREPARED_DIR}/{gone.name}"]
    assert mine.is_dir() and elsewhere.is_dir() and not gone.exists()
    assert reap_prepared(tmp_path) == []


@needs_git
async def test_a_task_repositorys_config_runs_nothing_of_its_own(tmp_path: Path) -> None:
    """A repository's config can make `git add` run a program (a clean filter): the baseline is committed
    to a git directory of ours, which reads no config of the task's, so it runs nowhere."""
    src, seen = tmp_path / "repo", tmp_path / "filter-ran-in.txt"
    src.mkdir()
    git(src, "init", "-q")
    git(src, "config", "filter.spy.clean", f"sh -c 'echo \"${{ROLLOUT_SANDBOX:-host}}\" >> {seen}; cat'")
    (src / ".gitattributes").write_text("*.txt filter=spy\n")
    (src / "a.txt").write_text("a\n")
    prepared = PreparedWorkspaces(tmp_path / "prepared", "run")
    provider = LocalSandboxProvider(tmp_path / "sandboxes")
    sb = await _started(provider)
    try:
        await lay_out(sb, WorkspaceSpec(copy_from=str(src)), prepared)
        assert Path(sb.workdir, "a.txt").read_text() == "a\n"
    finally:
        await sb.stop()
        await provider.aclose()
    assert prepared.builds == 0
    assert not seen.exists()


@needs_git
async def test_the_diff_trusts_no_stat_data(
    sandbox: LocalSandbox, tmp_path: Path, prepared: PreparedWorkspaces | None
) -> None:
    """Every file is hashed: a same-size rewrite that puts the old mtime back (an agent hiding an edit
    from an index that trusts size and mtime) is in the diff."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("kept.py", "edited.py", "same_size.py"):
        (src / name).write_text(f"{name} = 1\n")
        os.utime(src / name, (1_600_000_000, 1_600_000_000))
    await lay_out(sandbox, WorkspaceSpec(copy_from=str(src)), prepared)

    work = Path(sandbox.workdir)
    (work / "edited.py").write_text("edited.py = 2\n")
    (work / "same_size.py").write_text("same_size.py = 2\n")
    os.utime(work / "same_size.py", (1_600_000_000, 1_600_000_000))
    diff = await workspace_diff(sandbox)
    assert diff is not None
    assert "+edited.py = 2" in diff and "+same_size.py = 2" in diff
    assert "kept.py" not in diff


@needs_git
async def test_the_diff_without_a_shell_is_the_scripts_diff(
    sandbox: LocalSandbox, prepared: PreparedWorkspaces | None
) -> None:
    """A local sandbox takes the diff's common case as two `git`s with no shell between them; over every
    kind of change (an edit, a new file, a removal, a mode, a link, a binary file, a name of spaces and
    letters outside ASCII, an ignored file) it says what the script says, and a workspace the script
    must take (a nested repository: `git add` warns) still gets the script's answer."""
    files = {"a.py": "x = 1\n", "gone.txt": "bye\n", "run.sh": "echo hi\n", ".gitignore": "*.log\n"}
    await lay_out(sandbox, WorkspaceSpec(files=files), prepared)
    work = Path(sandbox.workdir)
    (work / "a.py").write_text("x = 2\n")
    (work / "gone.txt").unlink()
    (work / "run.sh").chmod(0o755)
    (work / "new dir").mkdir()
    (work / "new dir" / "ünï code.txt").write_text("new\n")
    (work / "blob.bin").write_bytes(bytes(range(256)) * 4)
    (work / "ignored.log").write_text("kept in the diff too\n")
    os.symlink("a.py", work / "link")

    async def by_script() -> str | None:
        script = workspace_module._DIFF_SCRIPT
        return await read_diff(sandbox, await workspace_module._git_script(sandbox, script, "diff-script"))

    fast = await workspace_diff(sandbox)
    # Its index, a fresh name of its own (the script's is rollout-diff.index): the two gits ran.
    assert [p.name for p in (work.parent / "baseline.git").glob("rollout-diff-*.index")]
    assert fast is not None and fast == await by_script()
    for part in ("+x = 2", "deleted file mode", "old mode 100644", "new mode 100755", "Binary files"):
        assert part in fast, part
    assert "new dir/ünï code.txt" in fast  # unquoted: core.quotePath=false
    assert "+kept in the diff too" in fast and "+++ b/link" in fast

    git(work / "new dir", "init", "-q")  # a nested repository: `git add` warns, the script's way is taken
    fast = await workspace_diff(sandbox)
    assert fast is not None and fast == await by_script()
    assert "ünï code.txt" in fast

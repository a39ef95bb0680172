"""Reviewing an agent's work where the agent never was: the diff and the verifier, in a fresh sandbox.

The agent is the policy under training, optimised against its reward: whatever it can reach that raises
the reward without doing the task, it learns. So nothing that judges it runs where it ran. After the
harness, a new sandbox of the same provider and image starts (its own identity, HOME, TMP, environment,
PID namespace), the task's workspace is laid out there again with its git baseline (which the agent's
sandbox never had), the agent's final workspace replaces the lay-out (partial work included: regular
files, directories and links, never followed out of it: sandboxes/carry.py), the diff is taken against
that baseline, the task's hidden checks (``verify.files``) are written in, and the verifier runs.

The verifier's contract (README, "The verifier"; docs/configuration.md): exit 0 is reward 1.0 and any
other exit 0.0, except the exits that say it could not grade. 125 is the one a verifier uses itself for
"could not grade", as git bisect reserves it for "skip this commit"; 126 and 127 are the shell's "found
but not executable" and "not found"; 129 up to 128 + SIGRTMAX are how a shell reports a command it ran
killed by a signal (an OOM kill of the test runner is no grade of the agent's work).
"""

from __future__ import annotations

import asyncio
import copy
import logging
import math
import os
import secrets
import shutil
import signal
import weakref
from collections.abc import Awaitable
from pathlib import Path

from executor import harbor
from executor.row import Row
from executor.tasks import Task, Verifier
from policy import FailureKind, Outcome, bound_text, status_for
from sandboxes.base import (
    CONTROL_SUFFIX,
    REVIEW_SUFFIX,
    ExecResult,
    RunsBefore,
    Sandbox,
    SandboxError,
    SandboxLostError,
    SandboxProvider,
    SandboxSpec,
)
from sandboxes.carry import Carried, copy_steps, copy_untrusted_tree
from sandboxes.inline import in_slices
from sandboxes.local import LocalSandbox
from sandboxes.prepared import PreparedWorkspaces
from sandboxes.workspace import checked_relative_path, diff_step, lay_out, read_diff, workspace_diff

log = logging.getLogger(__name__)

VERIFIER_CANNOT_GRADE = 125
VERIFIER_COULD_NOT_RUN = (126, 127)
_SHELL_SIGNAL_EXITS = range(129, 129 + int(signal.SIGRTMAX))
# The optional reward file: the verifier may write one number in [0, 1] to the path this variable
# names (in the sandbox, outside the workspace, fresh for each run); when present it is the reward.
REWARD_FILE_VAR = "ROLLOUT_REWARD_FILE"
REWARD_FILE_LIMIT = 4096  # bytes read of it; a number needs a few dozen
MAX_DIFF_CHARS = 200_000
# A workspace carried between sandboxes that share no host directory goes as a tar through the worker.
CARRY_TAR_LIMIT_BYTES = 1024**3
CARRY_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 30.0
# Grading sandboxes started beside their agent's harness where a start is quick (local), at most this
# many at once per provider: each holds a sandbox (its server, namespaces, disk) idle for the harness's
# whole run, which saves its rollout the start's ~10-20 ms; with hundreds of sessions in flight that is
# memory no rollout's latency pays back, and past the bound a grading sandbox starts after its harness.
MAX_EARLY_REVIEWS = 8
_early_reviews: weakref.WeakKeyDictionary[SandboxProvider, int] = weakref.WeakKeyDictionary()
# Sessions of a provider still setting up (their sandbox, workspace and harness). Nor does a grading
# sandbox begin beside its harness while any do: its start would take the CPU from theirs, which are on
# their rollouts' paths where it is not (a run's first wave: a worker's hundred starts at once).
_setting_up: weakref.WeakKeyDictionary[SandboxProvider, int] = weakref.WeakKeyDictionary()


class Review:
    """One session's grading sandbox: the diff of the agent's final workspace, and with ``grade`` its
    reward, both taken in a fresh sandbox the agent never ran in.

    ``begin`` starts it and lays the task's workspace out (with its baseline) while the agent still runs,
    where a sandbox's start is slow (a container, a Slurm job): only carrying the agent's work, the diff
    and the verifier are then left after the agent. ``close`` stops it (or what of it started), beside the
    agent's own sandbox's stop; every path of a session calls it."""

    def __init__(
        self,
        provider: SandboxProvider,
        spec: SandboxSpec,
        task: Task,
        workspaces: PreparedWorkspaces | None,
    ) -> None:
        # A Harbor task's tests run as its [verifier] user (root unless it says), not as its agent's.
        user = task.verify.user if task.verify is not None else None
        self.spec = spec.model_copy(update={"session_id": spec.session_id + REVIEW_SUFFIX, "user": user})
        self.task = task
        self._provider = provider
        self._workspaces = workspaces
        self._ready: asyncio.Future[Sandbox] | None = None
        self._early = False  # counted in _early_reviews until the agent's run is over
        # The prepared lay-out the agent's workspace came from (``lay_out``), set before ``begin``.
        self.laid_out_as: str | None = None
        self._in_set_up = True  # counted in _setting_up until its session's set-up is over
        _setting_up[provider] = _setting_up.get(provider, 0) + 1

    def _set_up(self) -> None:
        if self._in_set_up:
            self._in_set_up = False
            _setting_up[self._provider] = max(0, _setting_up.get(self._provider, 1) - 1)

    @property
    def began(self) -> bool:
        """Whether its grading sandbox's start has begun."""
        return self._ready is not None

    def begin(self) -> None:
        if self._ready is None:
            self._ready = asyncio.ensure_future(self._prepare())

    def begin_beside_harness(self) -> None:
        """Begin now, while the agent's harness runs, unless ``MAX_EARLY_REVIEWS`` of this provider's
        grading sandboxes already wait beside theirs, or other sessions of it are still setting up (then
        it begins when it is needed). Called once the session's set-up is over."""
        self._set_up()
        if self._ready is not None:
            return
        waiting = _early_reviews.get(self._provider, 0)
        if waiting >= MAX_EARLY_REVIEWS or _setting_up.get(self._provider, 0):
            return
        _early_reviews[self._provider] = waiting + 1
        self._early = True
        self.begin()

    def _no_longer_waiting(self) -> None:
        if self._early:
            self._early = False
            _early_reviews[self._provider] = max(0, _early_reviews.get(self._provider, 1) - 1)

    async def _prepare(self) -> Sandbox:
        checker = await self._provider.start(self.spec)
        try:
            await _lay_out_task(
                checker, self.task, self._workspaces, files_too=False, same_as=self.laid_out_as
            )
        except BaseException:
            await asyncio.shield(stop_sandbox(checker))
            raise
        return checker

    async def close(self) -> bool:
        """Stop the grading sandbox; True when there was none to stop, or it stopped."""
        self._set_up()
        self._no_longer_waiting()
        ready, self._ready = self._ready, None
        if ready is None:
            return True
        ready.cancel()  # a no-op once it is ready; else its start is given up (and cleans up after itself)
        try:
            checker = await ready
        except BaseException:  # never started, or cancelled on the way: nothing is left of it
            return True
        return await stop_sandbox(checker)

    async def __call__(
        self, agent: Sandbox, outcome: Outcome, row: Row, *, grade: bool, evidence_dir: Path
    ) -> Outcome:
        """The outcome, changed only where grading could not be done. A failure of the grading sandbox's
        own is the infrastructure's (verifier_error, retried then masked), never a 0."""
        task = self.task
        self._set_up()
        self._no_longer_waiting()
        self.begin()
        assert self._ready is not None
        try:
            checker = await asyncio.shield(self._ready)  # a cancelled session leaves it to close()
        except Exception as exc:
            return _not_reviewed(row, outcome, grade, f"the grading sandbox was not made: {describe(exc)}")
        row.review_sandbox_id = checker.id
        try:
            await _take_over(agent, checker, task, row)
        except SandboxLostError as exc:
            return Outcome.of(
                FailureKind.SANDBOX_LOST, f"sandbox lost while carrying the workspace: {describe(exc)}"
            )
        except Exception as exc:
            why = f"the workspace could not be carried over: {describe(exc)}"
            return _not_reviewed(row, outcome, grade, why)
        if grade and task.verify is not None:
            graded, verifier_said = await _diff_and_grade(checker, task.verify, outcome, row)
            if verifier_said and not row.verified:
                graded = await self._whose_failure(checker, outcome, graded, row)
            outcome = graded
        else:
            await record_diff(row, workspace_diff(checker))
        if harbor.is_harbor(task) and (gap := await harbor.keep_logs(checker, evidence_dir)):
            row.evidence_gaps.append(gap)
        return outcome

    async def _whose_failure(self, checker: Sandbox, before: Outcome, failed: Outcome, row: Row) -> Outcome:
        """The verifier ran on the agent's workspace and never graded it: it could not grade, timed out,
        or wrote no reward. That is the infrastructure's only if it cannot grade the task's own workspace
        either: the tests run the agent's code, which can exit 125, kill its verifier, loop past the
        timeout or remove the reward file, and a grading that fails is masked (the agent's way out of its
        0). So the verifier runs once on the task's untouched workspace, in a fresh sandbox; if it grades
        there, the agent's workspace gets one more run (a hiccup of the grader's has passed by then), and
        if that does not grade either, the failure is the agent's own: ``agent_self_inflicted``, 0."""
        verify = self.task.verify
        assert verify is not None
        if not await self._grades_untouched(copy.copy(row)):
            return failed  # the doubt stays the infrastructure's
        row.verifier_runs = (row.verifier_runs or 0) + 1
        try:
            reward, failure = await _verify_once(checker, verify, row, with_diff=False)
        except SandboxLostError as exc:
            return Outcome.of(FailureKind.SANDBOX_LOST, f"sandbox lost while verifying: {describe(exc)}")
        except Exception:
            return failed
        if failure is None:
            row.verified, row.reward = True, reward
            return before
        row.verified, row.reward = True, 0.0
        why = f"the verifier graded the task's own workspace but not the agent's: {failure[1]}"
        return before.model_copy(
            update={
                "status": status_for(FailureKind.AGENT_SELF_INFLICTED),
                "failure_kind": FailureKind.AGENT_SELF_INFLICTED,
                "error_message": bound_text(why, 4000),
            }
        )

    async def _grades_untouched(self, scratch: Row) -> bool:
        """Whether the verifier grades the task's workspace as laid out, in a fresh sandbox of its own
        (``scratch`` takes what a run records; the row keeps the agent's)."""
        verify = self.task.verify
        assert verify is not None
        session_id = self.spec.session_id.removesuffix(REVIEW_SUFFIX) + CONTROL_SUFFIX
        try:
            control = await self._provider.start(self.spec.model_copy(update={"session_id": session_id}))
        except Exception:
            return False
        try:
            await _lay_out_task(control, self.task, self._workspaces)
            if verify.files:
                await _write_checks(control, verify)
            _, failure = await _verify_once(control, verify, scratch, with_diff=False)
            return failure is None
        except Exception:
            return False
        finally:
            await stop_sandbox(control)


def _not_reviewed(row: Row, outcome: Outcome, grade: bool, why: str) -> Outcome:
    row.evidence_gaps.append(f"workspace_diff_unavailable: {why[:200]}")
    if not grade:
        return outcome
    return outcome.model_copy(update={"failure_kind": FailureKind.VERIFIER_ERROR, "error_message": why})


async def _lay_out_task(
    checker: Sandbox,
    task: Task,
    workspaces: PreparedWorkspaces | None,
    *,
    files_too: bool = True,
    same_as: str | None = None,
) -> None:
    """The task's workspace as the agent got it, with its baseline (and a Harbor task's /logs).
    ``files_too``: False for a grading sandbox, whose workspace the agent's replaces (``_take_over``);
    ``same_as``: the prepared lay-out the agent's came from (``lay_out``)."""
    # A task's image may ship files at its workdir: the baseline is then made in the sandbox, of the
    # workspace as the image gave it, not copied from the host's lay-out of the task's files alone.
    prepared = workspaces if task.image is None and task.build is None else None
    await lay_out(checker, task.workspace, prepared, files_too=files_too, same_as=same_as)
    if harbor.is_harbor(task):
        await harbor.prepare_agent(checker)


async def _take_over(agent: Sandbox, checker: Sandbox, task: Task, row: Row) -> None:
    """The laid-out workspace in ``checker`` replaced by the agent's final one; a Harbor task's
    /logs/agent and /logs/artifacts too, which its tests may read as the agent left them."""
    carried = await asyncio.wait_for(carry_workspace(agent, checker), CARRY_TIMEOUT_S)
    if (gap := carried.gap()) is not None:
        row.evidence_gaps.append(gap)
    if harbor.is_harbor(task):
        for name in harbor.AGENT_LOG_DIRS:
            logs = f"/logs/{name}"
            carried = await asyncio.wait_for(_carry_by_tar(agent, checker, logs, logs), CARRY_TIMEOUT_S)
            if (gap := carried.gap()) is not None:
                row.evidence_gaps.append(gap)


async def carry_workspace(src: Sandbox, dst: Sandbox) -> Carried:
    """Replace ``dst``'s workspace by ``src``'s, as sandboxes/carry.py says. Two sandboxes whose
    workspaces are directories of this host (the local provider's; a container's at /rollout/work, its
    session directory's work/) copy directory to directory, with no command in either; any other pair
    goes through a tar made in ``src`` and unpacked in ``dst`` by their own users, so neither side's
    files are handled as root."""
    if isinstance(src, LocalSandbox) and isinstance(dst, LocalSandbox):
        if src.files_in_memory and dst.files_in_memory:
            return await _carry_in_memory(Path(src.workdir), Path(dst.workdir), dst.owner_ids)
        return await asyncio.to_thread(_carry_on_host, Path(src.workdir), Path(dst.workdir), dst.owner_ids)
    src_dir, dst_dir = _host_workdir(src), _host_workdir(dst)
    if src_dir is not None and dst_dir is not None:
        # Two exec round trips and the tar's bytes through the worker saved: each exec in a container
        # starts a supervisor interpreter (0.1-0.3 s under load).
        return await asyncio.to_thread(_carry_on_host, src_dir, dst_dir, None)
    return await _carry_by_tar(src, dst, src.workdir, dst.workdir)


def _host_workdir(sandbox: Sandbox) -> Path | None:
    """A container sandbox's workspace on this host, where the worker may copy it there itself."""
    return getattr(sandbox, "host_workdir", None)


def _carry_on_host(src: Path, dst: Path, owner: tuple[int, int] | None) -> Carried:
    _clear(dst)
    return copy_untrusted_tree(str(src), str(dst), owner)


async def _carry_in_memory(src: Path, dst: Path, owner: tuple[int, int] | None) -> Carried:
    """``_carry_on_host`` between two sandboxes' own tmpfs: on the event loop, in slices."""
    with os.scandir(dst) as entries:
        laid_out = next(entries, None) is not None
    if laid_out:  # only where the task's files were laid out in the grading sandbox itself
        await asyncio.to_thread(_clear, dst)
    done = Carried()
    await in_slices(copy_steps(str(src), str(dst), owner, done))
    return done


def _clear(dst: Path) -> None:
    for entry in list(dst.iterdir()):  # the lay-out, made by us in a sandbox the agent never saw
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


_TAR_OUT = 't="$TMPDIR/.carry-{tag}.tar"; tar -C "$1" -cf "$t" .; rc=$?; echo "$t"; exit $rc'
_TAR_IN = (
    'find "$1" -mindepth 1 -maxdepth 1 -exec rm -rf {} + && tar -C "$1" -xf "$2"; rc=$?; rm -f "$2"; exit $rc'
)


async def _carry_by_tar(src: Sandbox, dst: Sandbox, src_dir: str, dst_dir: str) -> Carried:
    done = Carried()
    made = await src.exec(
        ["sh", "-c", _TAR_OUT.format(tag=secrets.token_hex(6)), "sh", src_dir],
        timeout=CARRY_TIMEOUT_S,
        name="carry-out",
    )
    # tar exits 1 when a file changed as it read it: the agent's processes may still write; what it
    # read is the workspace's final state as far as anyone can tell.
    if made.exit_code not in (0, 1) or not made.stdout_tail.strip():
        raise SandboxError(
            f"tar in the agent's sandbox failed (exit {made.exit_code}): {made.stderr_tail[-500:]}"
        )
    data = await src.read_file(made.stdout_tail.strip().splitlines()[-1], CARRY_TAR_LIMIT_BYTES)
    if len(data) >= CARRY_TAR_LIMIT_BYTES:
        done.stopped = f"{CARRY_TAR_LIMIT_BYTES} bytes of tar"
    inbox = f"{dst.home.rstrip('/')}/.carry-{secrets.token_hex(6)}.tar"
    await dst.write_file(inbox, data, 0o600)
    unpacked = await dst.exec(
        ["sh", "-c", _TAR_IN, "sh", dst_dir, inbox], timeout=CARRY_TIMEOUT_S, name="carry-in"
    )
    if unpacked.exit_code != 0:
        done.skip("(tar)", f"unpacked with errors: {unpacked.stderr_tail[-300:]}")
    done.bytes = len(data)
    return done


async def record_diff(row: Row, diff: Awaitable[str | None]) -> None:
    try:
        row.workspace_diff = bound_text(await diff, MAX_DIFF_CHARS)
    except Exception as exc:
        row.evidence_gaps.append(f"workspace_diff_unavailable: {describe(exc)[:200]}")


async def _diff_and_grade(
    sandbox: Sandbox, verify: Verifier, outcome: Outcome, row: Row
) -> tuple[Outcome, bool]:
    """The diff, then the verifier, re-run in the same sandbox while it could not grade, at most
    ``retries`` more times. The diff is taken once, before the task's checks are written in and before
    the first run: it holds the agent's changes and nothing of the checks' or the verifier's. A sandbox
    lost meanwhile is SANDBOX_LOST (the agent runs again); a verifier that never graded is
    VERIFIER_ERROR / VERIFIER_TIMEOUT (the session's status kept). With it, whether the last failure was
    the verifier's own word (it ran, and could not grade), not one of the sandbox's."""
    # One exec for the diff and the first run, where the sandbox can, unless checks go in between.
    one_exec = isinstance(sandbox, RunsBefore) and not verify.files
    if not one_exec:
        await record_diff(row, workspace_diff(sandbox))
    failure: tuple[FailureKind, str] = (FailureKind.VERIFIER_ERROR, "the verifier did not run")
    for run in range(1, verify.retries + 2):
        row.verifier_runs = run
        first_with_diff = one_exec and run == 1
        try:
            if run == 1 and verify.files:
                await _write_checks(sandbox, verify)
            reward, failure_now = await _verify_once(sandbox, verify, row, with_diff=first_with_diff)
        except SandboxLostError as exc:
            lost = Outcome.of(FailureKind.SANDBOX_LOST, f"sandbox lost while verifying: {describe(exc)}")
            return lost, False
        except Exception as exc:
            if first_with_diff:  # the diff step's result went with the exec; later runs never take it
                row.evidence_gaps.append(f"workspace_diff_unavailable: {describe(exc)[:200]}")
            reward, failure_now, said = None, (FailureKind.VERIFIER_ERROR, describe(exc)), False
        else:
            said = True
        if failure_now is None:
            row.verified, row.reward = True, reward
            return outcome, True
        failure = failure_now
    kind, message = failure
    runs = verify.retries + 1
    message = bound_text(f"{message} ({runs} verifier run{'s' if runs > 1 else ''})", 4000)
    return outcome.model_copy(update={"failure_kind": kind, "error_message": message}), said


async def _write_checks(sandbox: Sandbox, verify: Verifier) -> None:
    """The task's hidden checks, over whatever the agent left at their paths: what is there goes first,
    with any link or file the agent put where one of their directories belongs (a ``tests`` linked out of
    the workspace would make the write fail, and a failed grading is masked: the agent's way out of its
    0); by the worker for a local sandbox, else in one exec."""
    paths = {checked_relative_path(rel): text for rel, text in verify.files.items()}
    if isinstance(sandbox, LocalSandbox):
        await sandbox.clear_paths(list(paths))
    else:
        res = await sandbox.exec(
            ["sh", "-c", _CLEAR_FOR_CHECKS, "sh", *paths], timeout=60, cwd=sandbox.workdir, name="checks"
        )
        if res.exit_code != 0:
            raise SandboxError(
                f"could not clear the checks' paths (exit {res.exit_code}): {res.stderr_tail[-300:]}"
            )
    for path, text in paths.items():
        await sandbox.write_file(path, text.encode())


# Each argument a relative path: every ancestor that is a link or not a directory is removed, then the path.
_CLEAR_FOR_CHECKS = r"""
for p in "$@"; do
  rest=$p; pre=
  while :; do
    case $rest in */*) head=${rest%%/*}; rest=${rest#*/} ;; *) break ;; esac
    pre=${pre:+$pre/}$head
    if [ -L "$pre" ] || { [ -e "$pre" ] && [ ! -d "$pre" ]; }; then rm -rf -- "$pre" || exit 1; fi
  done
  rm -rf -- "$p" || exit 1
done
"""


async def _verify_once(
    sandbox: Sandbox, verify: Verifier, row: Row, *, with_diff: bool
) -> tuple[float | None, tuple[FailureKind, str] | None]:
    """One run of the verifier: its reward, or why it could not grade. ``with_diff``: the workspace's
    diff is taken in the same exec, just before the verifier starts, and recorded on the row."""
    if verify.tests_dir is not None:
        return await _verify_harbor(sandbox, verify, row)
    argv = ["bash", "-c", verify.command]
    # A fresh name per run, outside the workspace: an earlier run's file is never read as this run's.
    reward_path = f"{sandbox.home.rstrip('/')}/.rollout-reward-{secrets.token_hex(8)}"
    env = {REWARD_FILE_VAR: reward_path}
    if with_diff:
        before = diff_step(sandbox.workdir)
        res = await sandbox.exec(argv, timeout=verify.timeout_s, env=env, name="verify", before=before)  # type: ignore[call-arg]
        await record_diff(row, read_diff(sandbox, res.before))
    else:
        res = await sandbox.exec(argv, timeout=verify.timeout_s, env=env, name="verify")
    row.verifier_exit_code = res.exit_code
    cannot = _cannot_grade(res, verify)
    if cannot is not None:
        return None, (FailureKind.VERIFIER_TIMEOUT if res.timed_out else FailureKind.VERIFIER_ERROR, cannot)
    return await _reward_of(sandbox, res, reward_path)


async def _verify_harbor(
    sandbox: Sandbox, verify: Verifier, row: Row
) -> tuple[float | None, tuple[FailureKind, str] | None]:
    """One run of a Harbor task's tests: the reward is what they wrote in /logs/verifier, whatever their
    exit code."""
    if (why := await harbor.prepare_verifier(sandbox, verify)) is not None:
        return None, (FailureKind.VERIFIER_ERROR, why)
    argv = ["bash", "-c", verify.command]
    res = await sandbox.exec(argv, timeout=verify.timeout_s, env=verify.env, name="verify")
    row.verifier_exit_code = res.exit_code
    row.verifier_stdout_tail, row.verifier_stderr_tail = res.stdout_tail, res.stderr_tail
    if res.timed_out or res.exit_code is None:
        cannot = _cannot_grade(res, verify) or "verifier did not finish"
        return None, (FailureKind.VERIFIER_TIMEOUT if res.timed_out else FailureKind.VERIFIER_ERROR, cannot)
    reward, row.rewards, failure = await harbor.read_reward(sandbox, verify.reward_key)
    return reward, failure


def _cannot_grade(res: ExecResult, verify: Verifier) -> str | None:
    """Why this run of the verifier is no grade at all, or None when its exit code is one."""
    stderr = res.stderr_tail.strip()[-500:]
    said = f"; stderr: {stderr}" if stderr else ""
    if res.timed_out:
        return f"verifier ran past {verify.timeout_s}s"
    if res.exit_code is None or res.signal:
        return f"verifier killed by signal {res.signal}{said}"
    if res.exit_code in _SHELL_SIGNAL_EXITS:
        return f"verifier's command killed by signal {res.exit_code - 128} (exit {res.exit_code}){said}"
    if res.exit_code in VERIFIER_COULD_NOT_RUN:
        return f"verifier could not run (exit {res.exit_code}){said}"
    if res.exit_code == VERIFIER_CANNOT_GRADE:
        return f"verifier could not grade (exit {VERIFIER_CANNOT_GRADE}){said}"
    return None


async def _reward_of(
    sandbox: Sandbox, res: ExecResult, reward_path: str
) -> tuple[float | None, tuple[FailureKind, str] | None]:
    """The reward file's number when the verifier wrote one, else 1.0 for exit 0 and 0.0 otherwise."""
    try:
        data = await sandbox.read_file(reward_path, REWARD_FILE_LIMIT)
    except FileNotFoundError:
        return (1.0 if res.exit_code == 0 else 0.0), None
    except SandboxLostError:
        raise
    except SandboxError as exc:
        return None, (FailureKind.VERIFIER_ERROR, f"reward file unreadable: {describe(exc)[:500]}")
    text = data.decode("utf-8", errors="replace").strip()
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0.0 <= value <= 1.0:  # NaN fails this too
        shown = repr(text[:100]) + ("..." if len(text) > 100 else "")
        return None, (FailureKind.VERIFIER_ERROR, f"reward file holds {shown}, not a number in [0, 1]")
    return value, None


async def stop_sandbox(sandbox: Sandbox) -> bool:
    """Stop ``sandbox``: True once it is confirmed stopped within ``STOP_TIMEOUT_S``. The bound is on the
    waiting, never on the stop: a stop cut short leaves the sandbox half-removed (its directory, disk,
    uid), and an overloaded host is where stops run long. Past the bound (or when the session is
    cancelled) the stop goes on by itself, its provider's to finish (the local provider waits for it at
    its close), and the session's slot is free; the row says the cleanup was not confirmed."""
    stopping = asyncio.ensure_future(sandbox.stop())
    try:
        await asyncio.wait_for(asyncio.shield(stopping), timeout=STOP_TIMEOUT_S)
        return True
    except TimeoutError:
        log.warning("sandbox %s: still stopping after %.0f s; it goes on", sandbox.id, STOP_TIMEOUT_S)
        _going_on(stopping, sandbox.id)
        return False
    except asyncio.CancelledError:
        _going_on(stopping, sandbox.id)
        raise
    except Exception as exc:
        log.warning("sandbox %s: cleanup failed: %s", sandbox.id, describe(exc))
        return False


# Stops that outlived their caller's wait, held until they end (the loop keeps only weak references).
_stops_going_on: set[asyncio.Future[None]] = set()


def _going_on(stopping: asyncio.Future[None], sandbox_id: str) -> None:
    def ended(done: asyncio.Future[None]) -> None:
        _stops_going_on.discard(done)
        if not done.cancelled() and (exc := done.exception()) is not None:
            log.warning("sandbox %s: cleanup failed: %s", sandbox_id, describe(exc))

    if not stopping.done():
        _stops_going_on.add(stopping)
    stopping.add_done_callback(ended)


def describe(exc: BaseException) -> str:
    """An exception as one bounded line for a row: its type and its text."""
    text = str(exc) or type(exc).__name__
    return bound_text(f"{type(exc).__name__}: {text}", 4000) or ""

"""Container images of tasks: a named image is looked up (pulled if missing), a build context is built
once per distinct content digest and reused by every sample and retry of every task that gives it.

A build is keyed by the digest of its context (paths, modes, contents, symlink targets), tagged
``localhost/rollout-task:<digest>``, and serialized by an flock on ``<cache>/images/<digest>.lock``, so
concurrent workers on one machine build it once; each finished build appends a line to
``<cache>/images/builds.log``. A build that failed is not tried again by this process: its error is the
answer for every later sample of the task.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import logging
import os
import signal
import stat
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from sandboxes.base import SandboxStartError, TaskEnvironmentError

log = logging.getLogger(__name__)

TASK_IMAGE_REPO = "localhost/rollout-task"
MAX_CONTEXT_BYTES = 2 * 1024**3
MAX_CONTEXT_FILES = 100_000
INSPECT_TIMEOUT_S = 60.0
_HASH_CHUNK = 1024 * 1024


class ImageError(SandboxStartError):
    """A task's image is missing or cannot be pulled."""


class BuildError(ImageError, TaskEnvironmentError):
    """A task's image cannot be built from its context: the Dockerfile fails, or the build runs past
    its bound. The task's own: another attempt would fail the same way."""


@dataclass(frozen=True)
class ImageInfo:
    ref: str
    workdir: str  # the image's WORKDIR; "" when it sets none


def context_digest(context: Path) -> str:
    """The sha256 of a build context: every entry's relative path, kind, executable bit, and content or
    link target, in sorted order. Bounded in files and bytes."""
    h = hashlib.sha256()
    files = size = 0
    for dirpath, dirnames, filenames in os.walk(context):
        dirnames.sort()
        for name in sorted(filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]):
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, context)
            st = os.lstat(path)
            files += 1
            if files > MAX_CONTEXT_FILES:
                raise ImageError(f"build context {context}: more than {MAX_CONTEXT_FILES} files")
            if stat.S_ISLNK(st.st_mode):
                h.update(f"L\0{rel}\0{os.readlink(path)}\0".encode())
                continue
            if not stat.S_ISREG(st.st_mode):
                continue
            size += st.st_size
            if size > MAX_CONTEXT_BYTES:
                raise ImageError(f"build context {context}: larger than {MAX_CONTEXT_BYTES} bytes")
            h.update(f"F\0{rel}\0{bool(st.st_mode & 0o111)}\0{st.st_size}\0".encode())
            with open(path, "rb") as f:
                while chunk := f.read(_HASH_CHUNK):
                    h.update(chunk)
    return h.hexdigest()


def _again(exc: ImageError) -> ImageError:
    """A fresh exception of the same kind and text, for a later ask answered from a failure."""
    return type(exc)(str(exc))


def _last_lines(text: str, n: int = 3, limit: int = 600) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return " | ".join(lines[-n:])[-limit:] or "(no output)"


class Images:
    """The images one provider's sandboxes run, resolved through ``engine`` (podman or docker)."""

    def __init__(
        self,
        engine: str,
        cache_dir: Path,
        *,
        build_args: Sequence[str] = (),
        build_timeout_s: float = 1800.0,
        pull_timeout_s: float = 600.0,
    ) -> None:
        self.engine = engine
        self.cache_dir = Path(cache_dir)
        self.build_args = list(build_args)
        self.build_timeout_s = build_timeout_s
        self.pull_timeout_s = pull_timeout_s
        self._info: dict[str, ImageInfo] = {}
        self._failed: dict[str, ImageError] = {}  # what could not be had: the answer for every later ask
        self._built: dict[str, str] = {}  # a context's path -> its tag: hashed once per process
        self._locks: dict[str, asyncio.Lock] = {}

    async def resolve(
        self, image: str | None, build_context: str | None, build_timeout_s: float | None = None
    ) -> ImageInfo:
        """The image a sandbox runs: ``build_context`` built (once, within ``build_timeout_s``, else the
        provider's bound), else ``image``. ImageError if it cannot be had; BuildError if it cannot be
        built."""
        if build_context is not None:
            ref = await self._build(Path(build_context), build_timeout_s or self.build_timeout_s)
        elif image:
            ref = image
        else:
            raise ImageError("no image: the task gives none and the run sets no sandbox.image")
        if ref in self._failed:
            raise _again(self._failed[ref])
        if ref not in self._info:
            async with self._locks.setdefault(f"ref:{ref}", asyncio.Lock()):
                if ref not in self._info and ref not in self._failed:
                    try:
                        self._info[ref] = await asyncio.to_thread(self._inspect_or_pull, ref)
                    except ImageError as exc:
                        self._failed[ref] = exc
            if ref in self._failed:
                raise _again(self._failed[ref])
        return self._info[ref]

    def _engine(self, argv: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
        try:
            return subprocess.run(
                [self.engine, *argv], capture_output=True, text=True, timeout=timeout, check=False
            )
        except subprocess.TimeoutExpired:
            raise ImageError(f"{self.engine} {argv[0]} ran past {timeout:.0f}s") from None
        except OSError as exc:
            raise ImageError(f"{self.engine}: {exc}") from None

    def _inspect(self, ref: str) -> ImageInfo | None:
        proc = self._engine(
            ["image", "inspect", "--format", "{{.Config.WorkingDir}}", ref], INSPECT_TIMEOUT_S
        )
        return ImageInfo(ref, proc.stdout.strip()) if proc.returncode == 0 else None

    def _inspect_or_pull(self, ref: str) -> ImageInfo:
        info = self._inspect(ref)
        if info is not None:
            return info
        proc = self._engine(["pull", "--quiet", ref], self.pull_timeout_s)
        info = self._inspect(ref) if proc.returncode == 0 else None
        if info is None:
            why = _last_lines(proc.stderr, 1)
            raise ImageError(f"image {ref!r} is not on this host and cannot be pulled: {why}")
        return info

    async def _build(self, context: Path, timeout_s: float) -> str:
        if not (context / "Dockerfile").is_file():
            raise BuildError(f"build context {context}: no Dockerfile in it")
        key = str(context.resolve())
        if key in self._failed:
            raise _again(self._failed[key])
        if key in self._built:
            return self._built[key]
        async with self._locks.setdefault(key, asyncio.Lock()):
            if key in self._failed:
                raise _again(self._failed[key])
            if key not in self._built:
                try:
                    self._built[key] = await asyncio.to_thread(self._build_once, context, timeout_s)
                except ImageError as exc:
                    self._failed[key] = exc if isinstance(exc, BuildError) else BuildError(str(exc))
                    raise _again(self._failed[key]) from None
            return self._built[key]

    def _run_build(self, argv: list[str], timeout_s: float) -> tuple[int, str]:
        """``engine build``, its whole process group killed past ``timeout_s`` (a build's steps run in
        processes of their own, which a kill of the engine alone would leave running)."""
        try:
            proc = subprocess.Popen(
                [self.engine, *argv],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
        except OSError as exc:
            raise BuildError(f"{self.engine}: {exc}") from None
        try:
            output, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=INSPECT_TIMEOUT_S)
            raise BuildError(f"{self.engine} build ran past its bound of {timeout_s:g}s") from None
        return proc.returncode, output

    def _build_once(self, context: Path, timeout_s: float) -> str:
        digest = context_digest(context)
        tag = f"{TASK_IMAGE_REPO}:{digest[:32]}"
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        with open(self.cache_dir / f"{digest[:32]}.lock", "a") as lock:
            # Another worker building the same context holds this; its build is bounded by its timeout.
            fcntl.flock(lock, fcntl.LOCK_EX)
            if self._inspect(tag) is not None:
                return tag
            started = time.monotonic()
            code, output = self._run_build(
                ["build", *self.build_args, "-t", tag, "-f", str(context / "Dockerfile"), str(context)],
                timeout_s,
            )
            (self.cache_dir / f"{digest[:32]}.build.log").write_text(output, encoding="utf-8")
            if code != 0:
                raise BuildError(f"build of {context} failed (exit {code}): {_last_lines(output)}")
            took = time.monotonic() - started
            with open(self.cache_dir / "builds.log", "a", encoding="utf-8") as f:
                f.write(f"{time.time():.0f} {digest} {tag} {context} {took:.1f}s\n")
            log.info("images: built %s from %s in %.1fs", tag, context, took)
            return tag

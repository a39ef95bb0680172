"""Where a run lives: a local directory, or a prefix on an object store (``s3://bucket/prefix``, and
``gs://`` where pyarrow has GCS). Every read, list and write of a run's files goes through ``Location``,
one small path-like value, so a local run and a remote one take the same code.

Object stores have no rename and no directories: a file is an object, put whole in one request (a
reader never sees half of it), and a directory is the prefix of the objects under it. "Write once"
(``Location.create``) is a hard link from a private temporary on a local disk, a conditional PUT
(``If-None-Match: *``) on S3, which pyarrow does not expose, so boto3 makes that one request; where
neither is there (GCS, or S3 without boto3) it is a look then a put, which the run lock makes safe.

Credentials and endpoint come from the standard variables (``AWS_ENDPOINT_URL``, ``AWS_PROFILE``,
``AWS_ACCESS_KEY_ID``, ...) as the AWS SDK reads them; nothing of them is written into a run.
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import os
import re
import secrets
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
import pyarrow.parquet as pq

from executor.tasks import InputError

log = logging.getLogger(__name__)

OBJECT_SCHEMES = ("s3", "gs")
_URI_RE = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")
# Each S3 request: connect within CONNECT_S, answer within REQUEST_S, tried ATTEMPTS times by the SDK.
CONNECT_S = 5.0
REQUEST_S = 60.0
ATTEMPTS = 3
MAX_ERROR_CHARS = 300


@dataclass(frozen=True)
class Location:
    """A file or directory of a run: ``path`` on ``fs``. ``scheme`` is "" for the local disk."""

    fs: pafs.FileSystem
    path: str
    scheme: str = ""

    # -- naming ---------------------------------------------------------------------------------------
    @property
    def local(self) -> Path | None:
        """The local path, or None on an object store."""
        return None if self.scheme else Path(self.path)

    @property
    def uri(self) -> str:
        return f"{self.scheme}://{self.path}" if self.scheme else self.path

    def __str__(self) -> str:
        return self.uri

    def __fspath__(self) -> str:
        if self.scheme:
            raise TypeError(f"{self.uri} is not a local path")
        return self.path

    @property
    def name(self) -> str:
        return self.path.rstrip("/").rsplit("/", 1)[-1]

    def __truediv__(self, part: str) -> Location:
        return Location(self.fs, f"{self.path.rstrip('/')}/{part}", self.scheme)

    # -- reading --------------------------------------------------------------------------------------
    def _info(self) -> pafs.FileInfo:
        return self.fs.get_file_info(self.path)

    def is_dir(self) -> bool:
        if self.local is not None:
            return self.local.is_dir()
        return self._info().type == pafs.FileType.Directory

    def is_file(self) -> bool:
        if self.local is not None:
            return self.local.is_file()
        return self._info().type == pafs.FileType.File

    def exists(self) -> bool:
        return self.local.exists() if self.local is not None else self._info().type != pafs.FileType.NotFound

    def mtime(self) -> float | None:
        if self.local is not None:
            return self.local.stat().st_mtime
        when = self._info().mtime
        return when.timestamp() if when is not None else None

    def read_bytes(self, limit: int | None = None) -> bytes:
        """The file's content (its first ``limit`` bytes); FileNotFoundError when there is none."""
        if self.local is not None:
            with self.local.open("rb") as fh:
                return fh.read(-1 if limit is None else limit)
        try:
            with self.fs.open_input_stream(self.path) as fh:
                return fh.read(limit)
        except FileNotFoundError:
            raise
        except OSError as exc:
            if self._info().type == pafs.FileType.NotFound:
                raise FileNotFoundError(self.uri) from exc
            raise

    def read_text(self) -> str:
        return self.read_bytes().decode("utf-8")

    def children(self) -> list[Location]:
        """The entries directly under this directory, by name; none when it does not exist."""
        if self.local is not None:
            if not self.local.is_dir():
                return []
            return [Location(self.fs, str(p)) for p in sorted(self.local.iterdir())]
        infos = self.fs.get_file_info(pafs.FileSelector(self.path, allow_not_found=True))
        return sorted((Location(self.fs, i.path, self.scheme) for i in infos), key=lambda loc: loc.path)

    def parquet(self) -> pq.ParquetFile:
        if self.local is not None:
            return pq.ParquetFile(self.path)
        return pq.ParquetFile(self.path, filesystem=self.fs)

    # -- writing --------------------------------------------------------------------------------------
    def mkdir(self) -> None:
        """Make the directory on a local disk; an object store has none to make."""
        if self.local is not None:
            self.local.mkdir(parents=True, exist_ok=True)

    def write_bytes(self, data: bytes) -> None:
        """Put ``data`` whole, replacing what was there: a reader sees the old or the new, never half."""
        if self.local is not None:
            self.local.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.local.with_name(f".{self.local.name}.{secrets.token_hex(4)}.tmp")
            try:
                tmp.write_bytes(data)
                os.replace(tmp, self.local)
            finally:
                tmp.unlink(missing_ok=True)
            return
        with self.fs.open_output_stream(self.path) as fh:
            fh.write(data)

    def write_text(self, text: str) -> None:
        self.write_bytes(text.encode("utf-8"))

    def put_file(self, source: Path) -> None:
        """Copy local file ``source`` here whole, streamed, replacing what was there."""
        if self.local is not None:
            tmp = self.local.with_name(f".{self.local.name}.{secrets.token_hex(4)}.tmp")
            try:
                shutil.copyfile(source, tmp)
                os.replace(tmp, self.local)
            finally:
                tmp.unlink(missing_ok=True)
            return
        pafs.copy_files(
            str(source.absolute()), self.path, source_filesystem=_local_fs(), destination_filesystem=self.fs
        )

    def create(self, data: bytes) -> bool:
        """Write ``data`` whole under this name unless something is there: False then, nothing changed."""
        if self.local is not None:
            return _create_local(self.local, data)
        if self.scheme == "s3" and (client := _boto3_client(*_aws_settings())) is not None:
            return _create_s3(client, self.path, data)
        if self.exists():  # no conditional write here: the run lock keeps out a second writer
            return False
        self.write_bytes(data)
        return True

    def unlink(self) -> None:
        """Remove the file; one already gone is no error."""
        if self.local is not None:
            self.local.unlink(missing_ok=True)
            return
        with contextlib.suppress(FileNotFoundError):
            self.fs.delete_file(self.path)

    def remove_tree(self) -> None:
        """Remove this directory and all under it; one already gone is no error."""
        if self.local is not None:
            shutil.rmtree(self.local, ignore_errors=True)
            return
        with contextlib.suppress(FileNotFoundError):
            self.fs.delete_dir(self.path)

    def read_identified(self, limit: int) -> tuple[bytes, object] | None:
        """The content and an identity of this very file (None when there is none): a file put anew
        under the same name has another identity, so ``remove_if`` never removes it."""
        if self.local is not None:
            try:
                with self.local.open("rb") as fh:
                    st = os.fstat(fh.fileno())
                    return fh.read(limit), (st.st_dev, st.st_ino)
            except FileNotFoundError:
                return None
        try:
            data = self.read_bytes(limit)
        except FileNotFoundError:
            return None
        return data, data  # an object's content is its identity here: a lock holds a random token

    def remove_if(self, identity: object) -> None:
        """Remove the file if it is still the one ``read_identified`` gave ``identity`` for."""
        if self.local is not None:
            _remove_local_if(self.local, identity)
            return
        now = self.read_identified(len(identity) + 1) if isinstance(identity, bytes) else None
        if now is not None and now[1] == identity:
            self.unlink()

    def upload_tree(self, source: Path) -> int:
        """Put every file under local ``source`` at the same relative name under this prefix; the
        bytes put. Raises OSError on the first file that could not be put."""
        sent = 0
        for path in sorted(source.rglob("*")):
            if path.is_file() and not path.is_symlink():
                data = path.read_bytes()  # evidence files are bounded (16 MiB at most)
                (self / path.relative_to(source).as_posix()).write_bytes(data)
                sent += len(data)
        return sent


Where = str | os.PathLike[str] | Location  # what a caller may name a run's file or directory by


def is_object_uri(value: str) -> bool:
    match = _URI_RE.match(value)
    return match is not None and match.group(1).lower() in OBJECT_SCHEMES


def locate(where: str | os.PathLike[str] | Location) -> Location:
    """The location a path, a ``file://`` URI or an object-store URI names. A bad URI is an InputError
    naming it; nothing is contacted here."""
    if isinstance(where, Location):
        return where
    value = os.fspath(where)
    match = _URI_RE.match(value)
    if match is None:
        return Location(_local_fs(), value)
    scheme = match.group(1).lower()
    rest = value[len(match.group(0)) :]
    if scheme == "file":
        return Location(_local_fs(), rest or "/")
    if scheme not in OBJECT_SCHEMES:
        raise InputError(f"{value[:200]}: {scheme}:// storage is not supported; use a path, s3:// or gs://")
    path = rest.strip("/")
    if not path or path.startswith("/"):
        raise InputError(f"{value[:200]}: no bucket in the URI; write {scheme}://BUCKET/PREFIX")
    return Location(_object_fs(scheme, path.split("/", 1)[0], *_aws_settings()), path, scheme)


@contextlib.contextmanager
def local_copy(loc: Location) -> Iterator[Path]:
    """A local path holding ``loc``'s content for the block: the file itself on a local disk, else a
    temporary copy, removed after."""
    if loc.local is not None:
        yield loc.local
        return
    with tempfile.TemporaryDirectory(prefix="rollout-copy-") as scratch:
        path = Path(scratch) / loc.name
        pafs.copy_files(loc.path, str(path), source_filesystem=loc.fs, destination_filesystem=_local_fs())
        yield path


def check_writable(loc: Location) -> None:
    """Put, read back and remove a small object under ``loc``, so that a missing bucket, an endpoint not
    reached or credentials refused is one InputError naming the URI and the cause, before a run starts."""
    probe = loc / f".rollout-probe-{secrets.token_hex(6)}"
    try:
        loc.mkdir()
        probe.write_bytes(b"probe")
        probe.read_bytes()
        probe.unlink()
    except (OSError, ValueError) as exc:
        raise InputError(f"out {loc.uri}: cannot write there ({describe_error(exc)})") from None


def describe_error(exc: BaseException) -> str:
    """The first line of a storage error, bounded: the SDK's messages carry request ids and more."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return text[:MAX_ERROR_CHARS]


@functools.cache
def _local_fs() -> pafs.FileSystem:
    return pafs.LocalFileSystem()


def _aws_settings() -> tuple[str | None, str | None]:
    """The endpoint and region the standard variables name (None: the SDK's defaults)."""
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    return endpoint or None, region or None


@functools.cache
def _object_fs(scheme: str, bucket: str, endpoint: str | None, region: str | None) -> pafs.FileSystem:
    if scheme == "gs":
        try:
            return pafs.GcsFileSystem(retry_time_limit=timedelta(seconds=REQUEST_S))
        except (AttributeError, ImportError) as exc:  # a pyarrow built without GCS
            raise InputError(f"gs://{bucket}: this pyarrow has no GCS filesystem ({exc})") from None
    if not region and not endpoint:
        with contextlib.suppress(OSError):  # the bucket's own region, as pyarrow's from_uri finds it
            region = pafs.resolve_s3_region(bucket)
    options: dict[str, Any] = {
        "connect_timeout": CONNECT_S,
        "request_timeout": REQUEST_S,
        "retry_strategy": pafs.AwsStandardS3RetryStrategy(max_attempts=ATTEMPTS),
        # A small object is then one PUT, not a multipart upload of three requests; an error still
        # comes out of the write, at its close.
        "allow_delayed_open": True,
    }
    if endpoint:
        options["endpoint_override"] = endpoint
    if region:
        options["region"] = region
    return pafs.S3FileSystem(**options)


@functools.cache
def _boto3_client(endpoint: str | None, region: str | None) -> Any:
    """An S3 client for the conditional PUT, or None without boto3 (the ``s3`` extra)."""
    try:
        import boto3
        from botocore.config import Config
    except ImportError:
        log.warning("boto3 is not installed: S3 writes are look-then-put, guarded by the run lock only")
        return None
    config = Config(
        connect_timeout=CONNECT_S,
        read_timeout=REQUEST_S,
        retries={"max_attempts": ATTEMPTS, "mode": "standard"},
    )
    return boto3.client("s3", endpoint_url=endpoint, region_name=region, config=config)


def _create_s3(client: Any, path: str, data: bytes) -> bool:
    from botocore.exceptions import BotoCoreError, ClientError

    bucket, key = path.split("/", 1)
    try:
        client.put_object(Bucket=bucket, Key=key, Body=data, IfNoneMatch="*")
    except ClientError as exc:
        code = exc.response.get("Error", {}).get("Code")
        if code in ("PreconditionFailed", "ConditionalRequestConflict"):
            return False
        raise OSError(f"s3://{path}: {describe_error(exc)}") from exc
    except BotoCoreError as exc:
        raise OSError(f"s3://{path}: {describe_error(exc)}") from exc
    return True


def _create_local(path: Path, data: bytes) -> bool:
    """The content goes to a name of our own first and is then hard-linked to ``path``: the link is the
    exclusive create (like O_EXCL, and atomic on NFS too), and a reader never sees a file half written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(6)}.tmp")
    try:
        with tmp.open("xb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.link(tmp, path)
    except FileExistsError:
        return False
    finally:
        tmp.unlink(missing_ok=True)
    _fsync_dir(path.parent)  # the new name survives a power cut, not just the data
    return True


def _remove_local_if(path: Path, identity: object) -> None:
    """The rename moves one file aside atomically; if it was not the one judged, it goes back (a link:
    never over a file made meanwhile)."""
    aside = path.with_name(f".{path.name}.stale.{os.getpid()}.{secrets.token_hex(4)}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return
    try:
        st = aside.stat()
        if (st.st_dev, st.st_ino) != identity:
            with contextlib.suppress(FileExistsError):
                os.link(aside, path)
    finally:
        aside.unlink(missing_ok=True)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with contextlib.suppress(OSError):  # some filesystems refuse fsync on a directory
            os.fsync(fd)
    finally:
        os.close(fd)


def parquet_bytes(table: Any) -> bytes:
    """A table as one whole Parquet file's bytes, for ``Location.create``."""
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd")
    return buf.getvalue()

"""Object stores behind the mailbox: a directory (``fs``) or an S3(-compatible) bucket (``s3``). Torch-free.

A store moves opaque bytes under ``/``-separated keys. It knows nothing about rounds or payloads; the
protocol (:mod:`.protocol`) does. Both backends give the same guarantees the protocol relies on:

* ``put`` is atomic: a reader sees either nothing or the whole object (fs: temp file + rename; S3: a
  single PUT is atomic by itself);
* ``get`` of a missing key returns ``None`` (that is how readers poll for a peer's manifest);
* ``get_into`` reads an object into a caller-provided buffer and fails if the size differs, so a
  payload is never copied more than once on the way in;
* ``get_view`` (stores with ``maps_objects``: fs) maps an object into memory instead: no copy at all;
* ``get_range`` reads a byte range of an object into a caller-provided buffer (fs: seek and read; S3: a
  ``Range`` GET), and fails if the object's size is not the one the caller expects;
* ``create`` stores an object only if the key is still free, atomically: of two writers racing for one key
  exactly one wins (fs: ``link()`` of a complete temp file; S3: conditional PUT, ``If-None-Match: *``).
  Round commits rely on it; :func:`probe_create` checks that a store really refuses the second create.
"""

from __future__ import annotations

import builtins
import mmap
import os
import random
import tempfile
import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import TypeVar

from ...fsutil import write_atomic
from .errors import StoreError, XRChecksumError

_T = TypeVar("_T")
# Writes into a directory another region's delete may remove meanwhile (FsStore._in_parent): tries.
_PARENT_ATTEMPTS = 20


class Store(ABC):
    maps_objects = False  # True: get_view maps objects (zero-copy) and is preferred over get_into
    retries = 0  # requests retried so far (S3: botocore's RetryAttempts plus this store's own re-reads)
    _retries_lock = threading.Lock()  # S3Store has one per instance

    def count_retry(self) -> None:
        """One more request retried by a caller: the protocol reads an object again whose checksum failed."""
        with self._retries_lock:
            self.retries += 1

    @abstractmethod
    def put(self, key: str, data: bytes | bytearray | memoryview) -> None: ...

    @abstractmethod
    def create(self, key: str, data: bytes | bytearray | memoryview) -> bool:
        """Store ``data`` under ``key`` only if no object is there: True if this call created it, False if
        the key was taken (by this or another writer). Atomic: of concurrent creators exactly one wins."""

    @abstractmethod
    def get(self, key: str) -> bytes | None: ...

    @abstractmethod
    def get_into(self, key: str, out: memoryview) -> None:
        """Read object ``key`` into ``out``; raise if it is missing or its size is not ``len(out)``."""

    @abstractmethod
    def get_range(self, key: str, offset: int, out: memoryview, total: int) -> None:
        """Read ``len(out)`` bytes of object ``key`` from byte ``offset`` into ``out``; raise if it is missing
        or its size is not ``total`` (the manifest's: another object under the key is not read)."""

    def get_view(self, key: str, nbytes: int) -> memoryview:
        """Object ``key`` (``nbytes`` long) as a memoryview, without copying it (``maps_objects`` stores)."""
        raise NotImplementedError

    @abstractmethod
    def modified(self, key: str) -> float | None:
        """When object ``key`` was last written, in seconds since the epoch by the STORE's clock (S3: the
        server's, to the second; fs: the file's mtime, set by the file server, or the writing host on a
        local filesystem); None if it is missing. Only compared with other times of the same store."""

    @abstractmethod
    def get_aged(self, key: str) -> tuple[bytes, float | None] | None:
        """Object ``key`` and its AGE: seconds since it was last written, on the STORE's clock alone (S3:
        the ``Date`` of the same response less its ``Last-Modified``; fs: the mtime of a file created
        just before less the object's), never this host's; None for the age when the store does not say.
        The age errs low (an object is never older than it says): a liveness judgement built on it waits
        a little longer rather than calling a live writer gone. None if the object is missing."""

    def clone(self) -> Store:
        """A store on the same objects with its own connections (S3: another client and connection pool),
        so that small urgent requests (heartbeats) never queue behind this store's uploads; fs: itself."""
        return self

    @abstractmethod
    def list(self, prefix: str) -> list[str]:
        """Keys that start with ``prefix`` (a folder-like prefix ending in ``/``), any order."""

    def children(self, prefix: str) -> builtins.list[str]:
        """Keys of the objects directly under ``prefix`` (ending in ``/``), not those of its sub-folders: one
        request on S3 (a delimited listing), however many objects the sub-folders hold."""
        return [k for k in self.list(prefix) if "/" not in k[len(prefix) :]]

    @abstractmethod
    def delete(self, keys: Sequence[str]) -> None:
        """Delete ``keys``; missing keys are not an error."""

    @abstractmethod
    def describe(self, key: str = "") -> str:
        """Human-readable location of ``key`` for error messages (``fs:/dir/key``, ``s3://b/p/key``)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        pass


# ---------------------------------------------------------------------------------------------------


class FsStore(Store):
    """A directory: a shared filesystem for real runs, a local one for demos and tests."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root).absolute()
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        if not key or key.startswith("/") or ".." in key.split("/"):
            raise ValueError(f"bad mailbox key {key!r}")
        return self.root / key

    @staticmethod
    def _in_parent(path: Path, write: Callable[[], _T]) -> _T:
        """Make ``path``'s directory, then ``write`` into it. :meth:`delete` removes directories it left
        empty, so another region's delete can remove the directory between the two: make it again."""
        for attempt in range(_PARENT_ATTEMPTS):
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                return write()
            except (FileNotFoundError, FileExistsError):
                # FileExistsError: mkdir saw the directory, then found it gone when it checked is_dir().
                if attempt == _PARENT_ATTEMPTS - 1:
                    raise
        raise AssertionError("unreachable")

    def _complete_temp(self, key: str, data: bytes | bytearray | memoryview) -> tuple[Path, Path]:
        """(the key's path, a complete temp file beside it holding ``data``, for :meth:`create` to link);
        the caller removes the temp."""
        path = self._path(key)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")

        def write() -> None:
            try:
                with open(tmp, "wb") as f:
                    f.write(data)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise

        self._in_parent(path, write)
        return path, tmp

    def put(self, key: str, data: bytes | bytearray | memoryview) -> None:
        path = self._path(key)
        # atomic: readers see the old object, or the complete new one
        self._in_parent(path, lambda: write_atomic(path, data, fsync=False))

    def create(self, key: str, data: bytes | bytearray | memoryview) -> bool:
        path, tmp = self._complete_temp(key, data)
        try:
            os.link(tmp, path)  # fails if the key exists; readers never see a partial object
            return True
        except FileExistsError:
            return False
        finally:
            tmp.unlink(missing_ok=True)

    def get(self, key: str) -> bytes | None:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            return None

    def modified(self, key: str) -> float | None:
        try:
            return self._path(key).stat().st_mtime
        except FileNotFoundError:
            return None

    def get_aged(self, key: str) -> tuple[bytes, float | None] | None:
        now = self._now()  # first: a write that lands meanwhile makes the age smaller, never larger
        try:
            with open(self._path(key), "rb") as f:  # open, then fstat: fresh attributes (NFS close-to-open)
                mtime = os.fstat(f.fileno()).st_mtime
                data = f.read()
        except FileNotFoundError:
            return None
        return data, max(0.0, now - mtime)

    def _now(self) -> float:
        """Now by the clock that stamps this store's files: the mtime of a new (hidden) file in the root."""
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".clock-")
        try:
            return os.fstat(fd).st_mtime
        finally:
            os.close(fd)
            os.unlink(tmp)

    def _open_sized(self, key: str, nbytes: int):
        """Object ``key`` opened for reading, after checking it exists and holds ``nbytes`` bytes."""
        try:
            f = open(self._path(key), "rb")  # noqa: SIM115
        except FileNotFoundError:
            raise StoreError(f"object missing: {self.describe(key)}") from None
        size = os.fstat(f.fileno()).st_size
        if size != nbytes:
            f.close()
            raise XRChecksumError(f"{self.describe(key)}: {size} bytes, the manifest says {nbytes}")
        return f

    def get_into(self, key: str, out: memoryview) -> None:
        self.get_range(key, 0, out, memoryview(out).nbytes)

    def get_range(self, key: str, offset: int, out: memoryview, total: int) -> None:
        view = memoryview(out).cast("B")
        size = len(view)
        if offset < 0 or offset + size > total:
            raise ValueError(f"bytes {offset}..{offset + size} are not in an object of {total}")
        with self._open_sized(key, total) as f:
            f.seek(offset)
            got = 0
            while got < size:
                n = f.readinto(view[got:])
                if not n:
                    raise XRChecksumError(f"{self.describe(key)}: short read ({got} of {size} bytes)")
                got += n

    # Zero-copy reads. Safe because objects are immutable once visible: writers only ever create a new
    # file and rename it over the key, and unlinking a mapped file leaves the mapping intact. A private
    # (copy-on-write) mapping is writable for the caller without touching the file.
    maps_objects = True

    def get_view(self, key: str, nbytes: int) -> memoryview:
        with self._open_sized(key, nbytes) as f:
            if nbytes == 0:
                return memoryview(bytearray())
            return memoryview(mmap.mmap(f.fileno(), nbytes, access=mmap.ACCESS_COPY))

    def list(self, prefix: str) -> list[str]:
        base = self.root / prefix if prefix else self.root
        if not base.is_dir():
            return []
        keys = []
        for dirpath, _dirs, files in os.walk(base):
            for name in files:
                if name.startswith("."):  # temp files of writers in flight
                    continue
                keys.append(os.path.relpath(os.path.join(dirpath, name), self.root).replace(os.sep, "/"))
        return keys

    def children(self, prefix: str) -> builtins.list[str]:
        try:
            with os.scandir(self._path(prefix.rstrip("/"))) as it:
                return [prefix + e.name for e in it if not e.name.startswith(".") and e.is_file()]
        except (FileNotFoundError, NotADirectoryError):
            return []

    def delete(self, keys: Sequence[str]) -> None:
        parents = set()
        for key in keys:
            p = self._path(key)
            p.unlink(missing_ok=True)
            parents.add(p.parent)
        # Remove directories left empty (deepest first); a concurrent writer may refill one: fine.
        for d in sorted(parents, key=lambda p: len(p.parts), reverse=True):
            while d != self.root and self.root in d.parents:
                try:
                    d.rmdir()
                except OSError:
                    break
                d = d.parent

    def describe(self, key: str = "") -> str:
        return f"fs:{self.root / key if key else self.root}"


# ---------------------------------------------------------------------------------------------------


def _lean_config(threads: int, addressing_style: str, retries: int):
    from botocore.config import Config

    return Config(
        # One connection per worker thread (plus headroom for the poller), so no thread waits for a
        # connection and no connection is opened twice.
        max_pool_connections=max(10, threads + 4),
        retries={"max_attempts": retries, "mode": "standard"},  # exponential backoff with jitter
        s3={"addressing_style": addressing_style, "payload_signing_enabled": False},
        # The protocol carries its own checksum per shard: skip botocore's extra body checksums.
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
        connect_timeout=10,
        read_timeout=300,
        tcp_keepalive=True,
    )


class S3Store(Store):
    """An S3 or S3-compatible bucket through ONE boto3 client, created here and reused for every request
    (boto3 clients are thread-safe; the connection pool is sized to the thread pool). :meth:`clone` makes
    another, with a client and pool of its own (the heartbeat's)."""

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        addressing_style: str = "auto",
        region_name: str | None = None,
        profile: str | None = None,
        access_key_id_env: str | None = None,
        secret_access_key_env: str | None = None,
        session_token_env: str | None = None,
        threads: int = 16,
        retries: int = 6,
    ) -> None:
        import boto3

        self._args = (bucket, prefix)
        self._kw: dict = dict(
            endpoint_url=endpoint_url,
            addressing_style=addressing_style,
            region_name=region_name,
            profile=profile,
            access_key_id_env=access_key_id_env,
            secret_access_key_env=secret_access_key_env,
            session_token_env=session_token_env,
            retries=retries,
        )
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        kwargs: dict = {}
        if access_key_id_env:
            kwargs = {
                "aws_access_key_id": _env(access_key_id_env),
                "aws_secret_access_key": _env(secret_access_key_env or ""),
            }
            if session_token_env:
                kwargs["aws_session_token"] = _env(session_token_env)
        try:
            session = boto3.session.Session(profile_name=profile, region_name=region_name, **kwargs)
        except Exception as e:  # ProfileNotFound and friends
            raise StoreError(f"S3 credentials: {e}") from e
        self.client = session.client(
            "s3", endpoint_url=endpoint_url, config=_lean_config(threads, addressing_style, retries)
        )
        # botocore sends every PUT with a body (it makes bytes a file object) with `Expect: 100-continue`:
        # the PUT then waits one round trip for the server's `100 Continue` before it sends a byte. On a WAN
        # that is an RTT per PUT, three per round (bench roundcost: 6.2 RTT a round with it, 3.0 without).
        # A PUT the server refuses costs its body's bytes instead, which the mailbox never expects.
        from botocore.handlers import add_expect_header

        self.client.meta.events.unregister("before-call.s3", add_expect_header)
        self._errors = self.client.exceptions
        self._body_errs = _body_errors()
        self.read_attempts = max(1, retries)  # a GET whose body breaks off is read again, this often at most
        self.retries = 0
        self._retries_lock = threading.Lock()

    def _count(self, resp_or_error) -> None:
        """Add botocore's retries of one call (``RetryAttempts`` of a response, or of a ClientError)."""
        resp = getattr(resp_or_error, "response", resp_or_error)
        n = (resp or {}).get("ResponseMetadata", {}).get("RetryAttempts", 0) if isinstance(resp, dict) else 0
        if n:
            with self._retries_lock:
                self.retries += int(n)

    def _read_again(self, key: str, attempt: int, e: BaseException) -> None:
        """A body that broke off (reset, truncated, timed out): count it and back off, or give up."""
        if attempt + 1 >= self.read_attempts:
            raise StoreError(
                f"download of {self.describe(key)} failed after {self.read_attempts} attempts: "
                f"{type(e).__name__}: {e}"
            ) from e
        with self._retries_lock:
            self.retries += 1
        time.sleep(min(2.0, 0.05 * 2**attempt) * (0.5 + random.random()))

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def put(self, key: str, data: bytes | bytearray | memoryview) -> None:
        body = data if isinstance(data, bytes | bytearray) else bytes(data)
        try:
            self._count(self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=body))
        except Exception as e:
            self._count(e)
            raise StoreError(f"upload to {self.describe(key)} failed: {e}") from e

    def create(self, key: str, data: bytes | bytearray | memoryview) -> bool:
        from botocore.exceptions import ClientError

        body = data if isinstance(data, bytes | bytearray) else bytes(data)
        for attempt in range(6):
            try:
                self._count(
                    self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=body, IfNoneMatch="*")
                )
                return True
            except ClientError as e:
                self._count(e)
                err = e.response.get("Error", {})
                status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
                if err.get("Code") == "PreconditionFailed" or status == 412:
                    # After a retried attempt, the key may hold this very write (the first attempt
                    # reached the server, its answer did not reach us): that is a win, not a loss.
                    if e.response.get("ResponseMetadata", {}).get("RetryAttempts", 0) and self.get(
                        key
                    ) == bytes(body):
                        return True
                    return False
                if (err.get("Code") == "ConditionalRequestConflict" or status == 409) and attempt < 5:
                    time.sleep(
                        0.05 * 2**attempt
                    )  # a concurrent conditional write is in flight: S3 asks to retry
                    continue
                raise StoreError(f"conditional create of {self.describe(key)} failed: {e}") from e
            except Exception as e:
                raise StoreError(f"conditional create of {self.describe(key)} failed: {e}") from e
        raise AssertionError("unreachable")

    def _get_object(self, key: str, **kw):
        from botocore.exceptions import ClientError

        try:
            resp = self.client.get_object(Bucket=self.bucket, Key=self._key(key), **kw)
            self._count(resp)
            return resp
        except self._errors.NoSuchKey as e:
            self._count(e)
            return None
        except ClientError as e:
            self._count(e)
            if e.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return None
            raise StoreError(f"download of {self.describe(key)} failed: {e}") from e
        except self._body_errs:  # an (error) response that broke off: the caller reads again
            raise
        except Exception as e:
            raise StoreError(f"download of {self.describe(key)} failed: {e}") from e

    def _reading(self, key: str, read):
        """``read()``, again while the body breaks off (reset, truncated, timed out), at most
        read_attempts times."""
        for attempt in range(self.read_attempts):
            try:
                return read()
            except self._body_errs as e:
                self._read_again(key, attempt, e)
        raise AssertionError("unreachable")

    def get(self, key: str) -> bytes | None:
        return self._reading(key, lambda: self._get_once(key))

    def modified(self, key: str) -> float | None:
        from botocore.exceptions import ClientError

        try:
            resp = self.client.head_object(Bucket=self.bucket, Key=self._key(key))
        except ClientError as e:
            self._count(e)
            if e.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return None
            raise StoreError(f"reading the time of {self.describe(key)} failed: {e}") from e
        except Exception as e:
            raise StoreError(f"reading the time of {self.describe(key)} failed: {e}") from e
        self._count(resp)
        return float(resp["LastModified"].timestamp())

    def clone(self) -> S3Store:
        return S3Store(*self._args, **self._kw, threads=1)

    def get_aged(self, key: str) -> tuple[bytes, float | None] | None:
        got: list = []
        data = self._reading(key, lambda: self._get_once(key, got))
        if data is None:
            return None
        date = got[0].get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
        if not date or "LastModified" not in got[0]:
            return data, None
        # Both to the second (truncated): the true age is above this by less than a second, or below it by
        # less than one; take the low end
        age = parsedate_to_datetime(date).timestamp() - got[0]["LastModified"].timestamp() - 1.0
        return data, max(0.0, age)

    def _get_once(self, key: str, resp_out: list | None = None) -> bytes | None:
        resp = self._get_object(key)
        if resp is None:
            return None
        if resp_out is not None:
            resp_out[:] = [resp]
        body = resp["Body"]
        try:
            data = body.read()  # botocore checks the length against Content-Length
        finally:
            body.close()
        if len(data) != int(resp.get("ContentLength", len(data))):
            raise _ShortRead(
                f"{self.describe(key)}: short read ({len(data)} of {resp['ContentLength']} bytes)"
            )
        return data

    def get_into(self, key: str, out: memoryview) -> None:
        # A plain GET (not download_fileobj): one request, no ranged re-reads.
        self._reading(key, lambda: self._get_into_once(key, out))

    def _get_into_once(self, key: str, out: memoryview) -> None:
        resp = self._get_object(key)
        if resp is None:
            raise StoreError(f"object missing: {self.describe(key)}")
        view = memoryview(out).cast("B")
        size = int(resp["ContentLength"])
        if size != len(view):
            resp["Body"].close()
            raise XRChecksumError(f"{self.describe(key)}: {size} bytes, the manifest says {len(view)}")
        self._fill(key, resp, view)

    def get_range(self, key: str, offset: int, out: memoryview, total: int) -> None:
        view = memoryview(out).cast("B")
        if offset < 0 or offset + len(view) > total:
            raise ValueError(f"bytes {offset}..{offset + len(view)} are not in an object of {total}")
        if len(view):
            self._reading(key, lambda: self._get_range_once(key, offset, view, total))

    def _get_range_once(self, key: str, offset: int, view: memoryview, total: int) -> None:
        """One ``Range`` GET (through the one client, with its retries); the answer's ``Content-Range``
        names the object's size, checked like a whole read's length."""
        last = offset + len(view) - 1
        resp = self._get_object(key, Range=f"bytes={offset}-{last}")
        if resp is None:
            raise StoreError(f"object missing: {self.describe(key)}")
        got = str(resp.get("ContentRange", ""))
        if got != f"bytes {offset}-{last}/{total}" or int(resp["ContentLength"]) != len(view):
            resp["Body"].close()
            raise XRChecksumError(
                f"{self.describe(key)}: asked for bytes {offset}-{last} of {total}, got {got or 'no range'} "
                f"({resp['ContentLength']} bytes): not the object the manifest describes"
            )
        self._fill(key, resp, view)

    def _fill(self, key: str, resp, view: memoryview) -> None:
        """The body of ``resp`` (its length checked already) into ``view``; a body that ends early raises
        :class:`_ShortRead` (read again)."""
        size = len(view)
        body = resp["Body"]
        try:
            got = 0
            for chunk in body.iter_chunks(chunk_size=1 << 20):
                n = len(chunk)
                if got + n > size:
                    raise XRChecksumError(f"{self.describe(key)}: more bytes than announced")
                view[got : got + n] = chunk
                got += n
        finally:
            body.close()
        if got != size:
            raise _ShortRead(f"{self.describe(key)}: short read ({got} of {size} bytes)")

    def list(self, prefix: str) -> list[str]:
        full = self._key(prefix)
        strip = len(self.prefix) + 1 if self.prefix else 0
        keys: list[str] = []
        try:
            for page in self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=full
            ):
                self._count(page)
                keys += [o["Key"][strip:] for o in page.get("Contents", [])]
        except Exception as e:
            self._count(e)
            raise StoreError(f"listing {self.describe(prefix)} failed: {e}") from e
        return keys

    def children(self, prefix: str) -> builtins.list[str]:
        full = self._key(prefix)
        strip = len(self.prefix) + 1 if self.prefix else 0
        keys: list[str] = []
        try:
            for page in self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=full, Delimiter="/"
            ):
                self._count(page)
                keys += [o["Key"][strip:] for o in page.get("Contents", [])]
        except Exception as e:
            self._count(e)
            raise StoreError(f"listing {self.describe(prefix)} failed: {e}") from e
        return keys

    def delete(self, keys: Sequence[str]) -> None:
        for i in range(0, len(keys), 1000):
            batch = [{"Key": self._key(k)} for k in keys[i : i + 1000]]
            try:
                resp = self.client.delete_objects(
                    Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True}
                )
                self._count(resp)
            except Exception as e:
                self._count(e)
                raise StoreError(f"delete under {self.describe()} failed: {e}") from e
            if resp.get("Errors"):
                raise StoreError(f"delete under {self.describe()} failed: {resp['Errors'][:3]}")

    def describe(self, key: str = "") -> str:
        path = "/".join(p for p in (self.prefix, key) if p)
        return f"s3://{self.bucket}/{path}"

    def close(self) -> None:
        self.client.close()


class _ShortRead(XRChecksumError):
    """The body ended before Content-Length (a truncated response): read again."""


def _body_errors() -> tuple[type[BaseException], ...]:
    """What a GET body that breaks off raises: botocore's streaming errors, urllib3's protocol errors,
    a reset socket, our own short-read check."""
    import http.client

    from botocore.exceptions import (
        ConnectionClosedError,
        IncompleteReadError,
        ReadTimeoutError,
        ResponseStreamingError,
    )
    from urllib3.exceptions import ProtocolError
    from urllib3.exceptions import ReadTimeoutError as Urllib3ReadTimeout

    return (
        _ShortRead,
        IncompleteReadError,
        ResponseStreamingError,
        ReadTimeoutError,
        ConnectionClosedError,
        ProtocolError,
        Urllib3ReadTimeout,
        http.client.IncompleteRead,
        ConnectionError,
        TimeoutError,
    )


def probe_create(store: Store, prefix: str) -> bool:
    """Does ``store`` refuse a second create of the same key? (Some S3-compatible servers ignore
    ``If-None-Match`` and overwrite: round commits would then not be decided once.)"""
    key = f"{prefix}/_probe/{uuid.uuid4().hex}"
    try:
        first = store.create(key, b"1")
        second = store.create(key, b"2")
        kept = store.get(key)
    finally:
        store.delete([key])
    return first and not second and kept == b"1"


def _env(name: str) -> str:
    v = os.environ.get(name)
    if not v:
        raise StoreError(
            f"S3 credentials: environment variable {name} is not set (named by the site profile)"
        )
    return v


def make_store(transport, threads: int = 16) -> Store:
    """The store for a :class:`sbatch_gen.xr_options.FsTransport` / ``S3Transport``."""
    if transport.kind == "fs":
        return FsStore(transport.root)
    c = transport.credentials
    return S3Store(
        transport.bucket,
        transport.prefix,
        endpoint_url=transport.endpoint_url,
        addressing_style=transport.addressing_style,
        region_name=transport.region_name,
        profile=c.profile,
        access_key_id_env=c.access_key_id_env,
        secret_access_key_env=c.secret_access_key_env,
        session_token_env=c.session_token_env,
        threads=threads,
    )

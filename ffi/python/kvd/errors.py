"""Exceptions, one per libkvd status code (which are kvd's error variants, one to one)."""

from __future__ import annotations

from typing import Optional

from . import _lib

OK = 0

CORRUPTION_NONE = 0
CORRUPTION_QUARANTINED = 1
CORRUPTION_READER_COPY = 2
CORRUPTION_AT_SEAL = 3


class KvdError(Exception):
    """A libkvd call failed. ``status`` is its code; the other fields are its detail."""

    status: int = -1

    def __init__(
        self,
        message: str,
        *,
        retryable: bool = False,
        retry_after_ms: int = 0,
        corruption: int = CORRUPTION_NONE,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.retryable = retryable
        self.retry_after_ms = retry_after_ms
        self.corruption = corruption


class StaleGeneration(KvdError):
    """The handle names a block that no longer exists, or a view's page moved on: a miss."""

    status = 1


class IllegalTransition(KvdError):
    """The block is not in a state that allows the operation."""

    status = 2


class NoSpace(KvdError):
    """Not enough free space. Retryable."""

    status = 3


class Overloaded(KvdError):
    """A bound was reached; retry after ``retry_after_ms``."""

    status = 4


class NotFound(KvdError):
    """No such key, request or reservation."""

    status = 5


class AlreadyExists(KvdError):
    """The key exists (published, or being written by someone: busy)."""

    status = 6


class Corrupt(KvdError):
    """A checksum did not match; ``corruption`` says where (``CORRUPTION_*``). A miss."""

    status = 7


class InvalidArgument(KvdError, ValueError):
    """A malformed argument, a closed client, or a block this session does not hold."""

    status = 8


class LeaseExpired(KvdError):
    """The session's lease or a pin's TTL ran out."""

    status = 9


class StaleEpoch(KvdError):
    """An older epoch than the current one."""

    status = 10


class Deadline(KvdError):
    """The operation could not finish before its deadline."""

    status = 11


class Unavailable(KvdError):
    """The daemon is draining: go to another node."""

    status = 12


class ProtocolError(KvdError):
    """Another protocol or ABI version, or a malformed message."""

    status = 13


class KvdIOError(KvdError, OSError):
    """An operating-system call failed (for example no daemon at the socket)."""

    status = 14


class Disconnected(KvdError):
    """The connection failed; reconnect and look blocks up again. Retryable."""

    status = 15


class Unsupported(KvdError):
    """This libkvd or host cannot do it (built without CUDA, no CUDA driver). Not retryable."""

    status = 16


class InternalError(KvdError):
    """A bug inside libkvd; close the client."""

    status = 100


BY_STATUS: dict[int, type[KvdError]] = {
    c.status: c
    for c in (
        StaleGeneration,
        IllegalTransition,
        NoSpace,
        Overloaded,
        NotFound,
        AlreadyExists,
        Corrupt,
        InvalidArgument,
        LeaseExpired,
        StaleEpoch,
        Deadline,
        Unavailable,
        ProtocolError,
        KvdIOError,
        Disconnected,
        Unsupported,
        InternalError,
    )
}


def status_text(status: int) -> str:
    """libkvd's text for a status code."""
    return (_lib.lib.kvd_status_str(status) or b"").decode()


def for_status(status: int, message: Optional[str] = None) -> KvdError:
    """The exception of a per-item status (no last-error detail: items carry only a code)."""
    cls = BY_STATUS.get(status, KvdError)
    e = cls(message or status_text(status))
    if cls is KvdError:
        e.status = status
    return e


def last_error(status: int) -> KvdError:
    """The exception for a failed call, with the calling thread's last-error detail."""
    info = _lib.ErrorInfo()
    _lib.lib.kvd_last_error_info(info)
    message = (_lib.lib.kvd_last_error_message() or b"").decode(errors="replace")
    cls = BY_STATUS.get(status, KvdError)
    e = cls(
        message or status_text(status),
        retryable=bool(info.retryable),
        retry_after_ms=int(info.retry_after_ms),
        corruption=int(info.corruption),
    )
    if cls is KvdError:
        e.status = status
    return e


def check(status: int) -> None:
    """Raise the exception of a failed call."""
    if status != OK:
        raise last_error(status)

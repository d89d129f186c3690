"""The one exception tree of kvstore.

Every error kvstore raises derives from :class:`KvstoreError`, so an engine adapter can catch
one type at its boundary. Messages say what was expected and what arrived.

Read-path problems with a *block* (missing, short, mis-keyed, corrupt) are normally not raised
to the caller: the page store turns them into a miss, logs one line and quarantines the file.
They are exceptions here because the low-level decoders raise them and the page store catches
them in one place.
"""

from __future__ import annotations

import errno


class KvstoreError(Exception):
    """Base class of every error kvstore raises."""


class ConfigError(KvstoreError, ValueError):
    """A configuration key is unknown, ill-typed or out of range."""


class NativeRequiredError(KvstoreError):
    """``KVSTORE_NATIVE=require`` and a C extension is not built, not loadable or failed its
    self-test (:mod:`kvstore.native`)."""


class IdentityMismatchError(KvstoreError):
    """A namespace exists with a stored identity different from the caller's."""


class StoreFormatError(KvstoreError):
    """A store, namespace or array document is not what format v1 prescribes."""


class BlockError(KvstoreError):
    """A block file cannot be served. The page store reports these as misses."""

    reason = "bad block"
    # (st_dev, st_ino) of the file that was read, when one was: the page store quarantines
    # that file and no other (the name may hold a good copy published since).
    file_id: tuple[int, int] | None = None


class BlockMissingError(BlockError):
    """No published file exists for the requested key."""

    reason = "missing"


class CorruptBlockError(BlockError):
    """A block file is short, mis-keyed, foreign or fails a checksum."""

    reason = "corrupt"


class StoreIOError(KvstoreError, OSError):
    """An operating-system I/O call failed; carries the errno of the failing call."""


class StoreTimeoutError(StoreIOError):
    """A store call was not answered within its deadline (the file system is slow or hung).

    The call itself may still be blocked in the kernel; whatever it was to deliver is dropped
    (:class:`kvstore.io.deadline.DeliveryGate`)."""

    def __init__(self, message: str) -> None:
        super().__init__(errno.ETIMEDOUT, message)

    def __str__(self) -> str:
        return str(self.strerror)


class EntryKindError(StoreIOError):
    """A store path holds another kind of entry than kvstore put there: a FIFO, socket,
    device, directory or symbolic link where a regular file belongs, or anything but a real
    directory where a directory belongs. kvstore never opens such an entry in a way that could
    block, nor follows it (:mod:`kvstore.io.fileio`); readers treat it as a miss."""


class LayoutError(KvstoreError, ValueError):
    """A parallel layout or tensor form cannot be mapped to canonical pages (fail closed)."""


class InspectError(KvstoreError):
    """A request the inspection tool cannot answer: unknown namespace, ambiguous hash, ..."""

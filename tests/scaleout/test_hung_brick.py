"""What a reader on a GlusterFS mount sees while a brick hangs (issue 35), without an engine.

One brick process of the volume is frozen (SIGSTOP: its connections stay open, the kernel
still accepts new ones, nothing answers), as a server that hangs rather than dies would be.
Blocks are written through node A's mount with kvstore's API; the brick that holds block 0 is
frozen and reads are started from threads, as an engine's I/O threads would:

* thawed before ``network.ping-timeout`` passes: the blocked reads complete, with the right
  bytes, as soon as the brick answers;
* left frozen: every read waits until the client gives up on the brick (between one and two
  ping timeouts), then fails, all at once. A file on the frozen brick is then simply *not
  there* (open: ENOENT, DHT finds no copy on the bricks it can reach; in 2 runs of 7
  ENOTCONN; kvstore counts a miss either way); a read through a descriptor opened before
  the freeze fails with ENOTCONN (and its close, even after the thaw, with ENOTCONN or
  EBADFD); a read of a block on the *other* brick waits as long, then hits (the lookup of
  its directory asks every brick). New reads while the brick stays frozen answer at once,
  the same way (until the client's next reconnection attempt, which the frozen brick's
  kernel accepts, and which hangs again for a ping timeout);
* thawed, the client reconnects within its 3 s retry interval, the blocks read back whole and
  ``kvstore verify`` finds the store clean.

The test prints one line of figures (``-s``), for docs/shared-filesystems.md. Measured here
(ping-timeout 5 s, 2 loaded cores): reads blocked 8.3-9.9 s, then failed together; a brick
thawed within the timeout answered its blocked reads 0.01-0.04 s after the thaw; after a
give-up, blocks read again 3.2-4.0 s after the thaw (the client's reconnection). Every
wait is bounded; the brick is thawed and the ping timeout restored in every outcome.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvstore.cli import main as kvstore_main
from kvstore.config import StoreConfig
from kvstore.identity import GroupSpec, Identity
from kvstore.store.group_store import GroupStore
from kvstore.store.page_store import KVStore
from kvstore.store.types import BlockRead, BlockWrite, ReadStatus, WriteStatus
from tests.scaleout import gluster as gl
from tests.scaleout.harness import SharedRoot
from tests.scaleout.node import bhash, content

SALT = "hung-brick"
N_BLOCKS = 32  # the frozen brick holds at least 5 of them but with probability 2e-6
PING_TIMEOUT_S = 5
HOLD_S = 2.0  # frozen this long, then thawed: well within the ping timeout
# A blocked read returns at about twice the ping timeout (the client sends its ping up to one
# timeout after the brick last answered, then waits one more); generous on a loaded machine.
GIVE_UP_BOUND_S = 3 * PING_TIMEOUT_S + 15
THAWED_BOUND_S = 15.0  # a read blocked on a brick completes this soon after it is thawed


@dataclass
class Timed:
    """One read run on a thread: when it started and ended (seconds after the freeze)."""

    what: str
    started: float
    ended: float | None = None
    outcome: str = ""

    @property
    def seconds(self) -> float | None:
        return None if self.ended is None else round(self.ended - self.started, 2)


class Reads:
    """Reads started on threads, timed from one origin (the freeze)."""

    def __init__(self, origin: float) -> None:
        self.origin = origin
        self.reads: list[Timed] = []
        self._threads: list[threading.Thread] = []

    def start(self, what: str, read: Callable[[], str]) -> Timed:
        timed = Timed(what, time.monotonic() - self.origin)

        def run() -> None:
            try:
                timed.outcome = read()
            except OSError as exc:
                timed.outcome = errno.errorcode.get(exc.errno or 0, str(exc))
            except Exception as exc:  # recorded, and the test fails on the outcome
                timed.outcome = f"{type(exc).__name__}: {exc}"
            timed.ended = time.monotonic() - self.origin

        # daemon: a read still blocked when the test fails must not keep pytest alive
        thread = threading.Thread(target=run, name=f"read {what}", daemon=True)
        thread.start()
        self.reads.append(timed)
        self._threads.append(thread)
        return timed

    def join(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def pending(self) -> list[str]:
        return [r.what for r in self.reads if r.ended is None]


def _identity() -> Identity:
    """Blocks of 256 KiB (4 layers x 8 KV heads x 64 x 16 tokens, bfloat16): larger than what
    GlusterFS's client caches whole at lookup (quick-read, 64 KiB), as real blocks are."""
    names = tuple(f"model.layers.{i}.self_attn.attn" for i in range(4))
    group = GroupSpec(kind="full", layer_names=names, num_kv_heads=8, head_dim=64)
    return Identity(
        model="test/hung-brick", kv_dtype="bfloat16", tokens_per_block=16, groups=(group,)
    )


def _summary(reads: list[Timed]) -> str:
    """``what=outcome@seconds`` of each read (``pending`` while blocked), for messages."""
    return ", ".join(f"{r.what}={r.outcome or 'pending'}@{r.seconds}s" for r in reads)


def _write_blocks(root: Path) -> None:
    with KVStore(StoreConfig(root=root, durability="full")) as store:
        group = store.namespace(_identity()).group(0)
        writes = [BlockWrite(bhash(SALT, i), content(group, SALT, i)) for i in range(N_BLOCKS)]
        assert all(r.status is WriteStatus.WRITTEN for r in group.write_blocks(writes))


def _bricks(env: gl.GlusterEnv, group: GroupStore) -> list[str | None]:
    """The brick holding each block (read from the bricks, not through a mount)."""
    mount = env.a.mount
    return [
        gl.brick_holding(env, Path(group.path_of(bhash(SALT, i))).relative_to(mount))
        for i in range(N_BLOCKS)
    ]


def _kvstore_read(group: GroupStore, i: int) -> Callable[[], str]:
    """kvstore's read of block ``i``: its status, and whether a hit has the right bytes."""

    def read() -> str:
        buf = np.zeros(group.layout.block_nbytes, dtype=np.uint8)
        (result,) = group.read_blocks([BlockRead(bhash(SALT, i), buf)])
        if result.status is ReadStatus.HIT:
            return "hit" if np.array_equal(buf, content(group, SALT, i)) else "WRONG BYTES"
        return str(result.status.value)

    return read


def _plain_read(path: str, expected: bytes) -> Callable[[], str]:
    """open + read of a block file, as any program would."""

    def read() -> str:
        with open(path, "rb") as f:
            data = f.read()
        return "bytes" if data == expected else f"WRONG BYTES ({len(data)})"

    return read


def _pread(fd: int, expected: bytes) -> Callable[[], str]:
    """pread through a descriptor opened before the freeze."""

    def read() -> str:
        data = os.pread(fd, len(expected), 0)
        return "bytes" if data == expected else f"WRONG BYTES ({len(data)})"

    return read


def _close(fd: int) -> str:
    """Close ``fd``: "ok" or the error name (a descriptor of a connection the client gave up
    on fails even to close)."""
    try:
        os.close(fd)
    except OSError as exc:
        return errno.errorcode.get(exc.errno or 0, str(exc))
    return "ok"


def _settle() -> None:
    """Let node A's cached names and attributes expire, so that reads ask the bricks."""
    time.sleep(max(gl.ENTRY_TIMEOUT_S, gl.ATTRIBUTE_TIMEOUT_S) + 0.5)


def _thawed_in_time(
    env: gl.GlusterEnv, group: GroupStore, frozen: str, blocks: list[int]
) -> dict[str, object]:
    """Episode 1: reads blocked on the frozen brick complete once it is thawed, before the
    client gave up on it."""
    paths = [group.path_of(bhash(SALT, i)) for i in blocks[:2]]
    expected = Path(paths[0]).read_bytes()
    _settle()
    with gl.frozen_brick(env, frozen):
        reads = Reads(time.monotonic())
        plain = reads.start("plain", _plain_read(paths[0], expected))
        kv = reads.start("kvstore", _kvstore_read(group, blocks[1]))
        time.sleep(HOLD_S)
        blocked = reads.pending()
        thawed_at = time.monotonic() - reads.origin
    reads.join(THAWED_BOUND_S)
    assert blocked == ["plain", "kvstore"], _summary(reads.reads)
    assert (plain.outcome, kv.outcome) == ("bytes", "hit"), _summary(reads.reads)
    after_thaw = max((r.ended or 0.0) - thawed_at for r in reads.reads)
    return {"held_s": HOLD_S, "completed_after_thaw_s": round(after_thaw, 2)}


def _left_frozen(
    env: gl.GlusterEnv, group: GroupStore, frozen: str, on_frozen: list[int], elsewhere: int
) -> dict[str, object]:
    """Episode 2: reads blocked past the ping timeout fail, or miss, and never return wrong
    bytes; new reads while the brick stays frozen; time to read again after the thaw."""
    path_open, path_plain = (group.path_of(bhash(SALT, i)) for i in on_frozen[:2])
    expected_open, expected = Path(path_open).read_bytes(), Path(path_plain).read_bytes()
    _settle()
    # A file opened before the freeze, its cached pages dropped: its read must ask the brick.
    fd = os.open(path_open, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    try:
        with gl.frozen_brick(env, frozen):
            reads = Reads(time.monotonic())
            reads.start("plain", _plain_read(path_plain, expected))
            reads.start("kvstore", _kvstore_read(group, on_frozen[2]))
            reads.start("opened-before", _pread(fd, expected_open))
            reads.start("other-brick", _kvstore_read(group, elsewhere))
            reads.join(GIVE_UP_BOUND_S)
            first = list(reads.reads)
            assert not reads.pending(), _summary(first)
            # The client has given up on the brick: what do new reads see now?
            later = Reads(reads.origin)
            later.start("later-plain", _plain_read(path_plain, expected))
            later.start("later-kvstore", _kvstore_read(group, on_frozen[2]))
            later.start("later-other-brick", _kvstore_read(group, elsewhere))
            later.join(GIVE_UP_BOUND_S)
            assert not later.pending(), _summary(later.reads)
    finally:
        closed = _close(fd)
    readable_s = gl.wait_readable([Path(group.path_of(bhash(SALT, i))) for i in on_frozen], 60)
    everything = first + later.reads
    assert not [r for r in everything if "WRONG" in r.outcome], _summary(everything)
    frozen_reads = [r for r in first if r.what in ("plain", "kvstore", "opened-before")]
    # Every read of the frozen brick waited (the client does not know yet), then failed.
    assert all((r.seconds or 0) >= 1.0 for r in frozen_reads), _summary(first)
    assert all(r.outcome not in ("bytes", "hit") for r in frozen_reads), _summary(first)
    figures: dict[str, object] = {f"{r.what}": f"{r.outcome}@{r.seconds}s" for r in everything}
    figures["close-after-thaw"] = closed
    figures["readable_after_thaw_s"] = round(readable_s, 2)
    return figures


def test_reads_while_a_brick_is_frozen(gluster: gl.GlusterEnv, shared: SharedRoot) -> None:
    root = shared.a
    before = gl.ping_timeout_s(gluster)
    with gl.ping_timeout(gluster, PING_TIMEOUT_S):  # first: it restarts the bricks
        _write_blocks(root)
        with KVStore(StoreConfig(root=root, durability="full"), create=False) as store:
            group = store.namespace(_identity(), create=False).group(0)
            bricks = _bricks(gluster, group)
            frozen = bricks[0]
            assert frozen is not None and None not in bricks, bricks
            on_frozen = [i for i, b in enumerate(bricks) if b == frozen]
            elsewhere = [i for i, b in enumerate(bricks) if b != frozen]
            assert len(on_frozen) >= 5 and elsewhere, bricks
            thawed = _thawed_in_time(gluster, group, frozen, on_frozen[:2])
            left = _left_frozen(gluster, group, frozen, on_frozen[2:5], elsewhere[0])
            results = [_kvstore_read(group, i)() for i in range(N_BLOCKS)]
            assert results == ["hit"] * N_BLOCKS
    assert gl.ping_timeout_s(gluster) == before
    assert kvstore_main(["verify", str(root)]) == 0
    line = ", ".join(f"{k}={v}" for k, v in {**thawed, **left}.items())
    print(f"[scaleout] frozen brick (ping-timeout {PING_TIMEOUT_S} s): {line}")

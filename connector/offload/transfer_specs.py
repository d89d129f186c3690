"""What the scheduler sends every worker per transfer job: small, picklable ``LoadStoreSpec``s.

Both specs travel inside vLLM's ``OffloadingConnectorMetadata`` to every worker process each
step, so they hold only bytes, ints and strings: the ``OffloadKey``s in the order vLLM lists
the job's GPU blocks (group-major, chunk order), and for stores the fields of each block's
:class:`kvstore.PendingBlock` (about 100 bytes a block).
"""

from __future__ import annotations

from collections.abc import Sequence

from vllm.v1.kv_offload.base import LoadStoreSpec

from kvstore import PendingBlock

# (array index, block hash, parent hash or None, temporary-file token, created_ns)
PendingFields = tuple[int, bytes, bytes | None, str, int]


class KVStoreLoadSpec(LoadStoreSpec):  # type: ignore[misc, unused-ignore]  # Any w/o vLLM
    """Blocks to load: their OffloadKeys, aligned with the job's GPU block ids."""

    def __init__(self, keys: Sequence[bytes], req_id: str = "") -> None:
        self.keys: tuple[bytes, ...] = tuple(bytes(k) for k in keys)
        self.req_id = req_id  # reported back when a multi-group model's load fails

    def __repr__(self) -> str:
        return f"KVStoreLoadSpec({len(self.keys)} blocks)"


class KVStoreStoreSpec(LoadStoreSpec):  # type: ignore[misc, unused-ignore]  # Any w/o vLLM
    """Blocks to store: OffloadKeys plus the pending-block fields every writer needs."""

    def __init__(
        self,
        namespace: str,
        checksum_algo: int,
        keys: Sequence[bytes],
        pendings: Sequence[PendingBlock],
    ) -> None:
        if len(keys) != len(pendings):
            raise ValueError(f"store spec: {len(keys)} keys but {len(pendings)} pending blocks")
        self.namespace = namespace
        self.checksum_algo = checksum_algo
        self.keys: tuple[bytes, ...] = tuple(bytes(k) for k in keys)
        self.fields: tuple[PendingFields, ...] = tuple(
            (p.group, p.block_hash, p.parent_hash, p.token, p.created_ns) for p in pendings
        )

    def pending(self, i: int) -> PendingBlock:
        """The :class:`PendingBlock` of entry ``i``, equal to the scheduler's."""
        group, block_hash, parent, token, created_ns = self.fields[i]
        return PendingBlock(
            namespace=self.namespace,
            group=group,
            block_hash=block_hash,
            parent_hash=parent,
            token=token,
            created_ns=created_ns,
            checksum_algo=self.checksum_algo,
        )

    def __repr__(self) -> str:
        return f"KVStoreStoreSpec({len(self.keys)} blocks of {self.namespace})"

"""Parallel layout and rank coordinates: how vLLM spreads one model over ranks.

:class:`ParallelLayout` holds the TP, PP, DCP and PCP sizes (validated on construction, with
a ``"tp=4,pp=2"`` text form), :class:`RankCoord` the position of one worker in it, and
:func:`pp_layer_range` the layers of each pipeline stage (vLLM ``get_pp_indices``). It is pure
integer arithmetic: no torch, no vLLM. The parallelism model (rank order, TP, PP, DCP, PCP)
is described in :mod:`kvstore.layout.parallel`, which derives the mapping from it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, get_args

from kvstore.errors import LayoutError

__all__ = [
    "ParallelLayout",
    "PcpKv",
    "RankCoord",
    "pp_layer_range",
]

PcpKv = Literal["replicated", "sharded"]

_LAYOUT_INT_KEYS = ("tp", "pp", "dcp", "pcp", "interleave")
_LAYOUT_KEYS = (*_LAYOUT_INT_KEYS, "pcp_kv", "pp_partition")


@dataclass(frozen=True)
class RankCoord:
    """Position of one worker in a :class:`ParallelLayout` (DCP ranks live inside TP x PCP)."""

    tp_rank: int
    pp_rank: int = 0
    pcp_rank: int = 0

    def __post_init__(self) -> None:
        for name in ("tp_rank", "pp_rank", "pcp_rank"):
            value = getattr(self, name)
            if not _is_int(value) or value < 0:
                raise LayoutError(f"rank: expected {name} to be an int >= 0, got {value!r}")


@dataclass(frozen=True)
class ParallelLayout:
    """How vLLM spreads one model over ranks. Validated on construction."""

    tp: int = 1  # tensor-parallel size: splits (or replicates) KV heads
    pp: int = 1  # pipeline stages: split layers
    dcp: int = 1  # decode-context-parallel size: shards the tokens of a block
    pcp: int = 1  # prefill-context-parallel size: see pcp_kv
    interleave: int = 1  # cp_kv_cache_interleave_size: consecutive tokens per token shard
    pcp_kv: PcpKv = "replicated"  # PCP ranks hold replicas (vLLM 0.33) or token shards
    pp_partition: tuple[int, ...] | None = None  # layers per stage (VLLM_PP_LAYER_PARTITION)

    def __post_init__(self) -> None:
        for name in _LAYOUT_INT_KEYS:
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise LayoutError(f"parallel layout: expected {name} >= 1, got {value!r}")
        if self.pcp_kv not in get_args(PcpKv):
            raise LayoutError(
                f"parallel layout: expected pcp_kv in {get_args(PcpKv)}, got {self.pcp_kv!r}"
            )
        self._check_dcp()
        if self.pp_partition is not None:
            parts = self.pp_partition
            if len(parts) != self.pp or any(not _is_int(p) or p < 1 for p in parts):
                raise LayoutError(
                    f"parallel layout: expected pp_partition to hold pp={self.pp} layer counts "
                    f">= 1, got {parts!r}"
                )

    def _check_dcp(self) -> None:
        """DCP ranks are carved out of existing ranks; vLLM's ParallelConfig rules."""
        if self.pcp_kv == "sharded" or self.pcp == 1:
            if self.tp % self.dcp:
                raise LayoutError(
                    f"parallel layout {self}: expected dcp to divide tp (DCP groups are made of "
                    f"TP ranks), got tp={self.tp}, dcp={self.dcp}"
                )
        elif self.dcp not in (1, self.pcp, self.tp * self.pcp):
            raise LayoutError(
                f"parallel layout {self}: with pcp > 1, expected dcp in "
                f"{sorted({1, self.pcp, self.tp * self.pcp})} (disabled, spanning PCP, or "
                f"spanning TP x PCP, as vLLM requires), got dcp={self.dcp}"
            )

    # -- sizes ---------------------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        """Number of ranks (workers) of this layout."""
        return self.tp * self.pp * self.pcp

    @property
    def token_shards(self) -> int:
        """Number of ranks a block's tokens are spread over (the canonical T / local bs)."""
        return self.dcp * self.pcp if self.pcp_kv == "sharded" else self.dcp

    # -- ranks ---------------------------------------------------------------------------------

    def ranks(self) -> tuple[RankCoord, ...]:
        """Every rank, in global rank order."""
        return tuple(self.coord_of(r) for r in range(self.world_size))

    def global_rank(self, coord: RankCoord) -> int:
        """vLLM's global rank of ``coord`` (PP outermost, then PCP, then TP)."""
        self.check_rank(coord)
        return (coord.pp_rank * self.pcp + coord.pcp_rank) * self.tp + coord.tp_rank

    def coord_of(self, global_rank: int) -> RankCoord:
        """Inverse of :meth:`global_rank`."""
        if not _is_int(global_rank) or not 0 <= global_rank < self.world_size:
            raise LayoutError(
                f"rank: expected a global rank in [0, {self.world_size}) for {self}, "
                f"got {global_rank!r}"
            )
        stage, tp_rank = divmod(global_rank, self.tp)
        pp_rank, pcp_rank = divmod(stage, self.pcp)
        return RankCoord(tp_rank=tp_rank, pp_rank=pp_rank, pcp_rank=pcp_rank)

    def check_rank(self, coord: RankCoord) -> None:
        """Raise :class:`LayoutError` unless ``coord`` is a rank of this layout."""
        limits = (("tp_rank", self.tp), ("pp_rank", self.pp), ("pcp_rank", self.pcp))
        for name, size in limits:
            value = getattr(coord, name)
            if value >= size:
                raise LayoutError(f"rank: expected {name} < {size} for {self}, got {value}")

    def dcp_position(self, coord: RankCoord) -> tuple[int, int]:
        """``(dcp_group, dcp_rank)`` of ``coord`` within its pipeline stage.

        Replicated PCP follows vLLM's group construction (ranks ordered by
        ``tp_rank * pcp + pcp_rank``, cut into groups of ``dcp``); sharded PCP follows
        ``canonical_mapping.py`` (DCP groups inside each PCP rank's TP group).
        """
        if self.pcp_kv == "sharded":
            group_in_tp, dcp_rank = divmod(coord.tp_rank, self.dcp)
            return coord.pcp_rank * (self.tp // self.dcp) + group_in_tp, dcp_rank
        return divmod(coord.tp_rank * self.pcp + coord.pcp_rank, self.dcp)

    def token_shard(self, coord: RankCoord) -> int:
        """Which of the :attr:`token_shards` interleaved token sets ``coord`` holds."""
        _, dcp_rank = self.dcp_position(coord)
        if self.pcp_kv == "sharded":
            return coord.pcp_rank * self.dcp + dcp_rank
        return dcp_rank

    def layer_range(self, num_hidden_layers: int, pp_rank: int) -> tuple[int, int]:
        """Model layer ids ``[start, end)`` of pipeline stage ``pp_rank``."""
        return pp_layer_range(num_hidden_layers, pp_rank, self.pp, self.pp_partition)

    # -- text form -----------------------------------------------------------------------------

    def __str__(self) -> str:
        parts = [f"tp={self.tp}"]
        parts += [f"{k}={getattr(self, k)}" for k in _LAYOUT_INT_KEYS[1:] if getattr(self, k) != 1]
        if self.pcp_kv != "replicated":
            parts.append(f"pcp_kv={self.pcp_kv}")
        if self.pp_partition is not None:
            parts.append("pp_partition=" + ":".join(str(p) for p in self.pp_partition))
        return ",".join(parts)

    @classmethod
    def parse(cls, text: str) -> ParallelLayout:
        """Parse ``"tp=4,pp=2"``, ``"tp=2,dcp=2,interleave=4"``, ... (the :meth:`__str__` form).

        Keys: tp, pp, dcp, pcp, interleave (ints), pcp_kv (replicated|sharded), pp_partition
        (layer counts joined by ':'). Unset keys take their defaults; ``""`` is TP=1.
        """
        values: dict[str, object] = {}
        items = [item.strip() for item in text.split(",")] if text.strip() else []
        for item in items:
            key, sep, raw = (part.strip() for part in item.partition("="))
            if not sep or not key or not raw:
                raise LayoutError(f"parallel layout {text!r}: expected key=value, got {item!r}")
            if key not in _LAYOUT_KEYS:
                raise LayoutError(
                    f"parallel layout {text!r}: unknown key {key!r}; accepted keys are "
                    f"{', '.join(_LAYOUT_KEYS)}"
                )
            if key in values:
                raise LayoutError(f"parallel layout {text!r}: key {key!r} given twice")
            values[key] = _parse_layout_value(text, key, raw)
        return cls(**values)  # type: ignore[arg-type]


def _parse_layout_value(text: str, key: str, raw: str) -> object:
    if key == "pcp_kv":
        return raw
    try:
        if key == "pp_partition":
            return tuple(int(p) for p in raw.split(":"))
        return int(raw)
    except ValueError:
        expected = "layer counts joined by ':'" if key == "pp_partition" else "an integer"
        raise LayoutError(
            f"parallel layout {text!r}: expected {key} to be {expected}, got {raw!r}"
        ) from None


def pp_layer_range(
    num_hidden_layers: int, pp_rank: int, pp_size: int, partition: Sequence[int] | None = None
) -> tuple[int, int]:
    """Model layer ids ``[start, end)`` held by pipeline stage ``pp_rank``.

    Same partition as vLLM 0.33 ``vllm.distributed.utils.get_pp_indices``: each stage gets
    ``num_hidden_layers // pp_size`` layers and the remainder ``r`` goes one each to the ``r``
    stages just before the last one (``partitions[-2], partitions[-3], ...``), since the last
    stage carries the final norm. ``partition`` is the explicit override vLLM reads from
    ``VLLM_PP_LAYER_PARTITION`` (passed in here, never read from the environment).
    """
    if not 0 <= pp_rank < pp_size:
        raise LayoutError(f"pipeline: expected pp_rank in [0, {pp_size}), got {pp_rank}")
    if partition is not None:
        parts = list(partition)
        if len(parts) != pp_size or sum(parts) != num_hidden_layers:
            raise LayoutError(
                f"pipeline: expected pp_partition of {pp_size} counts summing to "
                f"num_hidden_layers={num_hidden_layers}, got {parts}"
            )
    else:
        if num_hidden_layers < pp_size:
            raise LayoutError(
                f"pipeline: pp={pp_size} exceeds num_hidden_layers={num_hidden_layers}; a stage "
                "would hold no layers"
            )
        parts = [num_hidden_layers // pp_size] * pp_size
        for i in range(2, num_hidden_layers % pp_size + 2):
            parts[-i] += 1
    start = sum(parts[:pp_rank])
    return start, start + parts[pp_rank]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)

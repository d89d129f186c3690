"""Prefix trees of a group, rebuilt from the parent hashes in the block headers.

Nodes are the group's blocks (full hash and parent hash from each header). A block whose
parent is absent is a **root**: a *chain start* when its header has no parent (the first block
of a prompt), an *orphan* when the parent was evicted. A **leaf** has no stored child; each
root-to-leaf path is a **chain** (the longest cached prefix of at least one request).

Sharing, the reuse a prefix cache exists for:

* ``shared_blocks`` - blocks lying on two or more chains (a prefix common to several requests);
* ``chain_blocks`` - the sum of the chain lengths: the blocks the chains would hold if nothing
  were shared; ``reuse`` = chain_blocks / blocks (1.0 = no sharing), and
  ``saved_blocks`` = chain_blocks - blocks.

Blocks reachable from no root (parent links forming a cycle, possible only in a forged or
damaged store) are counted as ``unreachable`` and left out of every other number. Blocks whose
header cannot be used are listed under ``damaged`` (the first
:data:`~kvstore.inspect.bounded.LISTED`, and counted in ``damaged_count``) and are not nodes.

**Big groups.** The exact forest needs every block's header in memory (about 1 KB a block).
:func:`scan_group` streams the group's listing (exact block count and bytes, whatever the
size) and builds the exact forest only while the group holds at most ``max_blocks`` blocks.
Above that it builds a **sampled** forest instead: ``sample`` blocks chosen uniformly (the
smallest under a fixed mix of their path coordinates: the same store gives the same sample,
whatever the listing order), each joined to its ancestors by following parent hashes (one
``lstat`` and one header read per ancestor), the union holding at most ``max_blocks`` nodes; a
walk stopped by that limit is *cut* (its blocks' depths are lower bounds). What the sample
estimates about the whole group (trees, chain starts, orphans, block depths) is in
:attr:`TreeScan.estimates`, scaled from the sampled blocks and labelled as estimates.
"""

from __future__ import annotations

import heapq
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

from kvstore.errors import InspectError
from kvstore.inspect import bounded
from kvstore.inspect.blockfile import quick_header
from kvstore.inspect.bounded import BoundedList, BoundedProblems
from kvstore.store.paths import BlockFile
from kvstore.store.view import GroupView

#: Largest group whose exact forest is built (``tree --max-blocks``): ~1 KB of memory a block.
MAX_BLOCKS = 10_000
#: Blocks sampled above :data:`MAX_BLOCKS` (``tree --sample``).
SAMPLE_BLOCKS = 2_500
# How the walk from a sampled block towards its root ended at a node of the sampled forest.
START, ORPHAN, CUT, PARENT_DAMAGED = "chain start", "orphan", "cut", "parent damaged"
_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class Damaged:
    """A block file left out of the tree because its header is unusable."""

    path: str
    problem: str


@dataclass
class Forest:
    """The prefix forest of one group; derived maps cover reachable nodes only."""

    parent: dict[bytes, bytes | None]
    damaged: list[Damaged] = field(default_factory=list)  # the first ones (see damaged_count)
    damaged_count: int | None = None  # all damaged headers seen; None: len(damaged)
    children: dict[bytes, list[bytes]] = field(default_factory=dict)
    roots: list[bytes] = field(default_factory=list)
    order: list[bytes] = field(default_factory=list)  # breadth first from the roots
    depth: dict[bytes, int] = field(default_factory=dict)  # roots have depth 1
    size: dict[bytes, int] = field(default_factory=dict)  # blocks in the subtree
    leaves_under: dict[bytes, int] = field(default_factory=dict)  # chains through the block
    root_of: dict[bytes, bytes] = field(default_factory=dict)

    @classmethod
    def build(
        cls,
        parent: dict[bytes, bytes | None],
        damaged: list[Damaged] | None = None,
        damaged_count: int | None = None,
    ) -> Forest:
        forest = cls(parent, list(damaged or []), damaged_count)
        forest._link()
        return forest

    def _link(self) -> None:
        for node, parent in self.parent.items():
            if parent is not None and parent in self.parent:
                self.children.setdefault(parent, []).append(node)
            else:
                self.roots.append(node)
        for kids in self.children.values():
            kids.sort()
        self.roots.sort(key=lambda r: r)
        queue = deque((r, 1, r) for r in self.roots)
        while queue:
            node, depth, root = queue.popleft()
            self.order.append(node)
            self.depth[node] = depth
            self.root_of[node] = root
            queue.extend((k, depth + 1, root) for k in self.children.get(node, ()))
        for node in reversed(self.order):
            kids = self.children.get(node, [])
            self.size[node] = 1 + sum(self.size[k] for k in kids)
            self.leaves_under[node] = sum(self.leaves_under[k] for k in kids) if kids else 1

    @property
    def leaves(self) -> list[bytes]:
        return [n for n in self.order if not self.children.get(n)]


@dataclass
class TreeScan:
    """What :func:`scan_group` found: exact totals, and the exact or the sampled forest."""

    blocks: int  # block files listed (exact)
    bytes_on_disk: int  # their sizes (exact)
    forest: Forest  # exact when ``sample`` is None, else the sampled forest
    problems: BoundedProblems  # listing problems (links, unreadable directories ...)
    sample: dict[str, Any] | None = None  # how the sampled forest was built
    estimates: dict[str, Any] | None = None  # of the whole group, from the sample
    sampled_blocks: list[bytes] = field(default_factory=list)  # hashes (usable headers)

    @property
    def sampled(self) -> bool:
        return self.sample is not None


def scan_group(
    group: GroupView, *, max_blocks: int = MAX_BLOCKS, sample: int = SAMPLE_BLOCKS
) -> TreeScan:
    """Stream ``group``'s block files once: count them and their bytes, read headers into the
    exact forest while there are at most ``max_blocks``, and keep a uniform sample of
    ``sample`` files; above ``max_blocks`` the exact headers are dropped and the sampled
    forest is built (module docstring). Memory: O(max_blocks), whatever the group's size."""
    if not 0 < sample <= max_blocks:
        raise InspectError(
            f"tree: expected 0 < --sample <= --max-blocks ({max_blocks}), got --sample {sample}"
        )
    problems = BoundedProblems(bounded.LISTED)
    parent: dict[bytes, bytes | None] | None = {}
    damaged: BoundedList[Damaged] = BoundedList(bounded.LISTED)
    # Max-heap (keys negated) of the `sample` smallest keys seen; (hi, lo) break ties, so a
    # BlockFile is never compared.
    heap: list[tuple[int, int, int, BlockFile]] = []
    blocks = on_disk = 0
    for f in group.iter_files(problems=problems):
        blocks += 1
        on_disk += f.nbytes
        item = (-_sample_key(f.hash_hi, f.hash_lo), f.hash_hi, f.hash_lo, f)
        if len(heap) < sample:
            heapq.heappush(heap, item)
        elif item > heap[0]:
            heapq.heapreplace(heap, item)
        if parent is None:
            continue
        if blocks > max_blocks:
            parent = None  # too many for the exact forest: free it, sample instead
            continue
        _read_into(group, f, parent, damaged)
    if parent is not None:
        forest = Forest.build(parent, damaged.items, damaged.total)
        return TreeScan(blocks, on_disk, forest, problems)
    chosen = [f for *_, f in sorted(heap, reverse=True)]  # smallest key first
    del heap
    return _sampled(group, chosen, blocks, on_disk, problems, damaged, max_blocks)


def _read_into(
    group: GroupView,
    f: BlockFile,
    parent: dict[bytes, bytes | None],
    damaged: BoundedList[Damaged],
) -> bytes | None:
    """Read ``f``'s header into ``parent``; its hash, or None (then recorded as damaged)."""
    header, problem = quick_header(group, f.path)
    if header is None:
        damaged.add(Damaged(str(f.path), problem or "unusable header"))
        return None
    parent[header.block_hash] = header.parent_hash
    return header.block_hash


def _sampled(  # noqa: PLR0913 - the scan's state handed over: sample, exact totals, findings, limit
    group: GroupView,
    chosen: list[BlockFile],
    blocks: int,
    on_disk: int,
    problems: BoundedProblems,
    damaged: BoundedList[Damaged],
    max_blocks: int,
) -> TreeScan:
    """The sampled forest: the chosen blocks and their ancestors, at most ``max_blocks``."""
    nodes: dict[bytes, bytes | None] = {}
    sampled: list[bytes] = []
    for f in chosen:
        block = _read_into(group, f, nodes, damaged)
        if block is not None:
            sampled.append(block)
    headers = len(chosen)
    ends: dict[bytes, str] = {}  # node where a walk ended -> how (START, ORPHAN, CUT, ...)
    for block in sampled:
        headers += _walk_up(group, block, nodes, ends, damaged, max_blocks)
    # file_of records what it finds on the group's own mapping; bounded: <= max_blocks lookups.
    for path, why in group.listing_problems.items():
        problems[path] = why
    forest = Forest.build(nodes, damaged.items, damaged.total)
    sample = {
        "blocks": len(chosen),
        "of": blocks,
        "usable": len(sampled),
        "max_blocks": max_blocks,
        "nodes": len(nodes),
        "ancestors": len(nodes) - len(sampled),
        "headers_read": headers,
        "cut_walks": sum(how == CUT for how in ends.values()),
        "method": "uniform sample (smallest keys of a fixed mix of the path coordinates), "
        "joined to its ancestors through parent hashes",
    }
    estimates = _estimates(forest, sampled, ends, blocks)
    return TreeScan(blocks, on_disk, forest, problems, sample, estimates, sampled)


def _walk_up(  # noqa: PLR0913 - the walk's shared state: forest so far, walk ends, findings, limit
    group: GroupView,
    block: bytes,
    nodes: dict[bytes, bytes | None],
    ends: dict[bytes, str],
    damaged: BoundedList[Damaged],
    max_blocks: int,
) -> int:
    """Add ``block``'s ancestors to ``nodes`` until a known node, a root, or the node limit;
    record in ``ends`` how the walk ended. Returns the headers read."""
    node, read = block, 0
    while True:
        up = nodes[node]
        if up is None:
            ends[node] = START
            return read
        if up in nodes:  # joined a walk already made (or a cycle): nothing new above
            return read
        if len(nodes) >= max_blocks:
            ends[node] = CUT
            return read
        f = group.file_of(up)  # one lstat by full hash: no listing, never follows a link
        if f is None:
            ends[node] = ORPHAN  # parent evicted (or not a regular file: a listing problem)
            return read
        read += 1
        header, problem = quick_header(group, f.path)
        if header is None or header.block_hash != up:
            got = problem if header is None else f"header names block {header.block_hash.hex()}"
            damaged.add(Damaged(str(f.path), f"{got} (parent of {node.hex()})"))
            ends[node] = PARENT_DAMAGED
            return read
        nodes[up] = header.parent_hash
        node = up


def _estimates(
    forest: Forest, sampled: list[bytes], ends: dict[bytes, str], blocks: int
) -> dict[str, Any]:
    """Numbers of the whole group estimated from the sampled blocks (scaled by
    ``blocks / usable sampled blocks``). A sampled block is a root of the group when its header
    has no parent (chain start) or its parent is not stored (orphan): each root is one tree.
    A count is never below the roots of that kind the walks found (a tree the sample reached
    only through its deeper blocks still exists). A sampled block's depth is exact when its
    walk reached a root, a lower bound otherwise (cut at the node limit, or a damaged parent).
    """
    usable = len(sampled)
    scale = blocks / usable if usable else 0.0
    starts = sum(forest.parent[b] is None for b in sampled)
    orphans = sum(ends.get(b) == ORPHAN for b in sampled)
    found = Counter(ends.get(r) for r in forest.roots)
    est_starts = max(round(starts * scale), found[START])
    est_orphans = max(round(orphans * scale), found[ORPHAN])
    open_tops = {n for n, how in ends.items() if how in (CUT, PARENT_DAMAGED)}
    reached = [b for b in sampled if b in forest.depth]  # not on a cycle
    depths = [forest.depth[b] for b in reached]
    by_root = Counter(forest.root_of[b] for b in reached)
    return {
        "from_sampled_blocks": usable,
        "trees": est_starts + est_orphans,
        "chain_starts": est_starts,
        "orphan_roots": est_orphans,
        "depth": {
            "min": min(depths, default=0),
            "mean": sum(depths) / len(depths) if depths else 0.0,
            "max": max(depths, default=0),
            "histogram": {str(k): v for k, v in sorted(Counter(depths).items())},
        },
        "depth_lower_bounds": sum(forest.root_of[b] in open_tops for b in reached),
        "largest_trees": [
            {
                "root": r.hex(),
                "root_kind": ends.get(r, START if forest.parent[r] is None else ORPHAN),
                "sampled_blocks": n,
                "blocks": round(n * scale),
                "depth_seen": max(forest.depth[b] for b in reached if forest.root_of[b] == r),
            }
            for r, n in sorted(by_root.items(), key=lambda item: (-item[1], item[0]))[:5]
        ],
    }


def _sample_key(hash_hi: int, hash_lo: int) -> int:
    """splitmix64 of the path coordinates: a sample key spread evenly even where block names
    are not random hashes (a test or forged store), and the same for the same store."""
    z = (((hash_hi << 62) ^ hash_lo) + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def summarize(forest: Forest, top: int = 5) -> dict[str, object]:
    """The numbers of the ``tree`` view (JSON-ready; see the module docstring)."""
    blocks = len(forest.order)
    leaves = forest.leaves
    lengths = [forest.depth[n] for n in leaves]
    chain_blocks = sum(lengths)
    shared = [n for n in forest.order if forest.leaves_under[n] >= 2]
    branch = [n for n in forest.order if len(forest.children.get(n, ())) >= 2]
    per_depth = Counter(forest.depth[n] for n in forest.order)
    trees = sorted(forest.roots, key=lambda r: (-forest.size[r], r))
    shared_by_root = Counter(forest.root_of[n] for n in shared)
    leaves_by_root = Counter(forest.root_of[n] for n in leaves)
    depth_by_root: dict[bytes, int] = {}
    for n in leaves:
        r = forest.root_of[n]
        depth_by_root[r] = max(depth_by_root.get(r, 0), forest.depth[n])
    return {
        "blocks": blocks,
        "trees": len(forest.roots),
        "chain_starts": sum(forest.parent[r] is None for r in forest.roots),
        "orphan_roots": sum(forest.parent[r] is not None for r in forest.roots),
        "chains": len(leaves),
        "chain_length": {
            "min": min(lengths, default=0),
            "mean": chain_blocks / len(lengths) if lengths else 0.0,
            "max": max(lengths, default=0),
            "histogram": {str(k): v for k, v in sorted(Counter(lengths).items())},
        },
        "blocks_per_depth": [per_depth[d] for d in range(1, max(per_depth, default=0) + 1)],
        "shared_blocks": len(shared),
        "chain_blocks": chain_blocks,
        "saved_blocks": chain_blocks - blocks,
        "reuse": chain_blocks / blocks if blocks else 0.0,
        "branch_points": len(branch),
        "max_fanout": max((len(forest.children.get(n, ())) for n in forest.order), default=0),
        "largest_trees": [
            {
                "root": r.hex(),
                "root_kind": "chain start" if forest.parent[r] is None else "orphan",
                "blocks": forest.size[r],
                "chains": leaves_by_root[r],
                "depth": depth_by_root.get(r, 1),
                "shared_blocks": shared_by_root[r],
            }
            for r in trees[:top]
        ],
        "top_branch_points": [
            {
                "block": n.hex(),
                "depth": forest.depth[n],
                "children": len(forest.children[n]),
                "chains": forest.leaves_under[n],
                "subtree_blocks": forest.size[n],
            }
            for n in sorted(branch, key=lambda n: (-forest.leaves_under[n], forest.depth[n], n))[
                :top
            ]
        ],
        "unreachable": len(forest.parent) - blocks,
        "damaged": [{"path": d.path, "problem": d.problem} for d in forest.damaged],
        "damaged_count": len(forest.damaged)
        if forest.damaged_count is None
        else forest.damaged_count,
    }


def plot_coordinates(forest: Forest) -> dict[bytes, tuple[int, float]]:
    """(depth, y) per node for drawing: leaves get consecutive y, a parent the mean of its
    children's, trees stacked largest first."""
    coords: dict[bytes, tuple[int, float]] = {}
    next_leaf = 0
    for root in sorted(forest.roots, key=lambda r: (-forest.size[r], r)):
        stack: list[tuple[bytes, bool]] = [(root, False)]
        while stack:
            node, done = stack.pop()
            kids = forest.children.get(node, [])
            if not kids:
                coords[node] = (forest.depth[node], float(next_leaf))
                next_leaf += 1
            elif done:
                ys = [coords[k][1] for k in kids]
                coords[node] = (forest.depth[node], sum(ys) / len(ys))
            else:
                stack.append((node, True))
                stack.extend((k, False) for k in reversed(kids))
    return coords

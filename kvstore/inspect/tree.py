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
header cannot be used are listed under ``damaged`` and are not nodes.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

from kvstore.inspect.blockfile import quick_header
from kvstore.store.view import GroupView


@dataclass(frozen=True)
class Damaged:
    """A block file left out of the tree because its header is unusable."""

    path: str
    problem: str


@dataclass
class Forest:
    """The prefix forest of one group; derived maps cover reachable nodes only."""

    parent: dict[bytes, bytes | None]
    damaged: list[Damaged] = field(default_factory=list)
    children: dict[bytes, list[bytes]] = field(default_factory=dict)
    roots: list[bytes] = field(default_factory=list)
    order: list[bytes] = field(default_factory=list)  # breadth first from the roots
    depth: dict[bytes, int] = field(default_factory=dict)  # roots have depth 1
    size: dict[bytes, int] = field(default_factory=dict)  # blocks in the subtree
    leaves_under: dict[bytes, int] = field(default_factory=dict)  # chains through the block
    root_of: dict[bytes, bytes] = field(default_factory=dict)

    @classmethod
    def build(
        cls, parent: dict[bytes, bytes | None], damaged: list[Damaged] | None = None
    ) -> Forest:
        forest = cls(dict(parent), list(damaged or []))
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


def scan_forest(group: GroupView) -> Forest:
    """Read every block header of ``group`` (one small read each) and build its forest."""
    parent: dict[bytes, bytes | None] = {}
    damaged: list[Damaged] = []
    for f in group.files():
        header, problem = quick_header(group, f.path)
        if header is None:
            damaged.append(Damaged(str(f.path), problem or "unusable header"))
        else:
            parent[header.block_hash] = header.parent_hash
    return Forest.build(parent, damaged)


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

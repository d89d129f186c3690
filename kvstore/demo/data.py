"""The demo's workload: prompts sharing prefixes, chained block hashes, deterministic KV bytes.

Token ids are drawn from a seed; block hashes chain like vLLM's (each covers its parent's hash
and its tokens); KV bytes are bf16 bit patterns of realistic magnitudes seeded by the hash, so
any process - a restarted server, another rank - can regenerate and check every byte.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvstore.identity import Identity
from kvstore.models import load_model

ROOT_HASH = hashlib.sha256(b"kvstore-demo-chain-root").digest()
VOCAB = 128_000


@dataclass(frozen=True)
class Plan:
    """What the demo writes: requests as lists of segment ids, and segment lengths in blocks."""

    segments: dict[str, int]  # segment id -> blocks
    requests: list[list[str]]  # each request: its segment ids, in order
    unseen: list[str]  # a request whose last segment was never written


def make_plan(blocks: int, requests: int) -> Plan:
    """Split ``blocks`` unique blocks into a system prompt, topics and per-request turns."""
    if blocks < 8 or requests < 1:
        raise ValueError(
            f"demo: expected --blocks >= 8 and --requests >= 1, got {blocks}, {requests}"
        )
    topics = min(3, requests)
    system = max(1, blocks // 8)
    topic = max(1, blocks // 8)
    rest = blocks - system - topics * topic
    segments = {"system": system}
    segments.update({f"topic{t}": topic for t in range(topics)})
    own = [rest // requests + (1 if r < rest % requests else 0) for r in range(requests)]
    reqs = []
    for r in range(requests):
        segments[f"req{r}"] = own[r]
        reqs.append(
            ["system", f"topic{r % topics}", f"req{r}"]
            if own[r]
            else ["system", f"topic{r % topics}"]
        )
    segments["unseen"] = max(1, own[0] or 1)
    return Plan(segments, reqs, ["system", "topic0", "unseen"])


def segment_hashes(
    segment: str, parent: bytes, blocks: int, tokens_per_block: int, seed: int
) -> list[bytes]:
    """Chained block hashes of a segment's tokens (vLLM style: hash(parent, tokens))."""
    rng = np.random.default_rng([seed, *segment.encode()])
    tokens = rng.integers(0, VOCAB, size=(blocks, tokens_per_block), dtype=np.int32)
    out = []
    for row in tokens:
        parent = hashlib.sha256(parent + row.tobytes()).digest()
        out.append(parent)
    return out


def request_chain(
    plan: Plan, request: Sequence[str], tokens_per_block: int, seed: int
) -> list[bytes]:
    """The block hashes of a request: its segments' chains, each continuing the previous."""
    chain: list[bytes] = []
    for segment in request:
        parent = chain[-1] if chain else ROOT_HASH
        chain += segment_hashes(segment, parent, plan.segments[segment], tokens_per_block, seed)
    return chain


def fill_block(out: np.ndarray, block_hash: bytes, group: int) -> None:
    """Deterministic KV bytes of a block, seeded by its hash.

    bf16 bit patterns with random sign and mantissa and exponents 2^-7..2^0, i.e. magnitudes
    in [0.0078, 2) like post-norm K/V activations; ten times cheaper to draw than normals,
    which matters when every rank process of a layout regenerates the blocks to verify them.
    """
    rng = np.random.default_rng([group, *block_hash[:16]])
    bits = out.view(np.uint16)
    rng_bits = rng.integers(0, 1 << 16, size=bits.shape, dtype=np.uint16)
    exponent = (np.uint16(120) + ((rng_bits >> 7) & np.uint16(7))) << np.uint16(7)
    bits[:] = (rng_bits & np.uint16(0x807F)) | exponent


def demo_identity(model: str, tokens: int) -> Identity:
    """The namespace identity the demo writes under."""
    return load_model(model).identity(tokens)

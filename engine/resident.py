"""ResidentIndex: blocks already resident in this process, found by chain key.

A restore that finds its prefix here shares the pool blocks (one more reference
each; copy-on-write keeps them immutable) instead of reading the store again. The
index holds one reference per block it lists, so listed blocks stay resident until
the index lets them go: least recently used first once it holds more than
capacity_blocks blocks per layer, or on clear().

Only full blocks are listed: a partial block is where the next token lands.
Keys are the store's chain keys (format id, namespace, parent, tokens), so a block
of another format or namespace never matches.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Sequence

from engine.cache import PagedKVCache
from engine.errors import InvalidRequest
from kvstore.format import FormatIdentity
from kvstore.ids import ROOT_KEY, chain_key

DEFAULT_CAPACITY_BLOCKS = 4096


class ResidentIndex:
    def __init__(self, pools: Sequence, capacity_blocks: int = DEFAULT_CAPACITY_BLOCKS):
        self.pools = list(pools)
        self.capacity_blocks = capacity_blocks
        self._entries: OrderedDict[bytes, tuple[int, ...]] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0

    def __len__(self) -> int:
        return len(self._entries)

    def _paged(self):
        return [(i, p) for i, p in enumerate(self.pools) if p is not None]

    def register(self, identity: FormatIdentity, namespace: str, tokens: Sequence[int],
                 caches: Sequence, salt: bytes | None = None) -> int:
        """List the full blocks of `tokens` held by `caches` (paged layers of these
        pools), keyed as the store keys them (`salt`: the namespace's chain salt, from
        store.chain_salt). Returns how many blocks were newly listed."""
        paged = self._paged()
        if [i for i, _ in paged] != list(identity.paged_layers):
            raise InvalidRequest("the index's pools do not match the identity's paged layers")
        size = identity.block_size_tokens
        full = min(len(tokens), *(caches[i].size() for i, _ in paged)) // size
        added, parent = 0, ROOT_KEY
        with self._lock:
            for b in range(full):
                parent = chain_key(identity.format_id, namespace, parent,
                                   tokens[b * size : (b + 1) * size], salt)
                if parent in self._entries:
                    self._entries.move_to_end(parent)
                    continue
                blocks = []
                for i, pool in paged:
                    cache = caches[i]
                    if not isinstance(cache, PagedKVCache) or cache.pool is not pool:
                        raise InvalidRequest(f"layer {i}'s cache is not in the index's pool")
                    blocks.append(cache.block_ids[b])
                for (_, pool), block in zip(paged, blocks):
                    pool.incref([block])
                self._entries[bytes(parent)] = tuple(blocks)
                added += 1
            self._shrink()
        return added

    def longest(self, keys: Sequence[bytes]) -> int:
        """How many leading keys are resident."""
        with self._lock:
            n = 0
            for k in keys:
                if bytes(k) not in self._entries:
                    break
                n += 1
            return n

    def adopt(self, keys: Sequence[bytes], size_tokens: int, **cache_kwargs) -> dict[int, PagedKVCache]:
        """Caches (one per paged layer index) sharing the resident blocks of `keys`,
        which must all be resident (see longest)."""
        with self._lock:
            rows = [self._entries[bytes(k)] for k in keys]
            for k in keys:
                self._entries.move_to_end(bytes(k))
            self.hits += len(keys)
            out = {}
            for j, (i, pool) in enumerate(self._paged()):
                out[i] = PagedKVCache.from_blocks(pool, [row[j] for row in rows],
                                                  len(keys) * size_tokens, **cache_kwargs)
            return out

    def clear(self) -> None:
        with self._lock:
            while self._entries:
                self._release_oldest()

    def _shrink(self) -> None:
        while len(self._entries) > self.capacity_blocks:
            self._release_oldest()

    def _release_oldest(self) -> None:
        _, blocks = self._entries.popitem(last=False)
        for (_, pool), block in zip(self._paged(), blocks):
            pool.decref([block])

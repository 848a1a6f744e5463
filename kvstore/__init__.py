"""kvstore: a durable, content-addressed store of KV-cache pages. No MLX here.

Nouns:
  page        an immutable run of bytes (one layer's K/V for one block of tokens),
              named by the blake3 digest of its canonical uncompressed bytes.
  PageDigest  that name: 32 bytes, shown as 64 lowercase hex characters.
  FormatIdentity
              the frozen, versioned record of what a page's bytes mean (model,
              layer geometry, page format, block size, rotation). Its canonical
              encoding hashes to the format id.
  ChainKey    the deterministic key of a block of tokens: blake3 over a domain
              tag, the format id, the namespace, the parent key and the tokens.
  block       a record under a chain key: the per-layer page digests of one
              block of tokens plus its parent key and times.
  checkpoint  a named manifest: format id, namespace, all token ids, ordered
              chain keys, attachment digests (non-paged state) and metadata.
              A checkpoint pins its blocks and pages against eviction and GC.
  Store       the embedded LMDB store; its method set is the protocol that the
              HTTP client (RemoteStore) and the S3 tier (TieredStore) implement too.
  protocol    kvstore/protocol.py declares it: the narrow views PageReader,
              PageWriter, StoreAdmin, and capabilities such as maps_pages.
"""

from kvstore.client import RemoteStore
from kvstore.errors import (
    IncompatibleFormat,
    IntegrityError,
    InvalidInput,
    KVStoreError,
    NotFound,
    StoreCorrupt,
    StoreFull,
)
from kvstore.format import FormatIdentity, LayerSpec
from kvstore.records import blocks_for_tokens
from kvstore.store import Store

# The public surface, pinned (tests/kvstore/test_surface.py): the two stores, the format
# identity and its layer record, the block builder, and the errors callers catch.
__all__ = [
    "FormatIdentity",
    "IncompatibleFormat",
    "IntegrityError",
    "InvalidInput",
    "KVStoreError",
    "LayerSpec",
    "NotFound",
    "RemoteStore",
    "Store",
    "StoreCorrupt",
    "StoreFull",
    "blocks_for_tokens",
]

"""engine: the paged KV engine on MLX.

Nouns:
  PageFormat     one named page layout (native-*, k8v8, k8v4, k4v4, and mlx-qB: mlx-lm's
                 QuantizedKVCache layout, published and restored but not paged);
                 engine/formats.py is the registry and knows each format's planes,
                 bytes and codecs.
  PageSpec       a page format bound to one layer's geometry, block size, group size and
                 key rotation; it maps to a kernels PageLayout and a kvstore LayerSpec.
  KVPolicy       which page format a model uses, with exact-model-id overrides.
  BlockPool      one layer's arena of fixed-size blocks with reference counts.
  PagedKVCache   an mlx-lm compatible layer cache whose history lives in pool blocks.
  PageSnapshot   immutable pages of a cache's history, pinned for publication.
  Capture        a host copy of a cache's pages (and attachments) ready to publish.
  EngineModel    a model bound to its id and policy: its format identity and layer
                 geometry computed once; it owns the pools, the admission controller
                 and the resident index that its requests share.
  RestoreRequest one restore: tokens, max_restore_tokens, max_new_tokens, cache_kind,
                 checkpoint, deadline, ...
  Restored       a restored cache list and how many prompt tokens it already holds.
  WriteBehindPublisher
                 a byte-capped queue that publishes captures off the decode path.
  ResidentIndex  blocks already in this process's pools, found by chain key.

make_cache(model, policy) builds a model's caches; install(model) routes attention of
paged layers through kernels.attention.paged_attention; restore(engine_model, store,
request) and publish(engine_model, store, tokens, caches) move pages between caches and
a store (kvstore.Store, kvstore.client.RemoteStore, kvstore.tier.TieredStore);
generate_with_store(engine_model, tokenizer, prompt, store) does restore -> prefill
the rest -> generate -> publish.
"""

from engine.engine_model import EngineModel
from engine.generate import generate_with_store
from engine.policy import KVPolicy
from engine.publish import publish
from engine.restore import RestoreRequest, restore
from engine.writebehind import WriteBehindPublisher

# Not the public surface, still importable from here for code written before it was
# pinned (the tests use engine.installed, engine.make_cache, ...): new code imports
# these from their modules.
from engine.attention import install, installed, uninstall  # noqa: F401,E402
from engine.cache import PagedKVCache, PageSnapshot  # noqa: F401,E402
from engine.errors import EngineError, OffsetMismatch, PoolExhausted  # noqa: F401,E402
from engine.formats import FORMATS, PageSpec, bits_per_value, format_identity  # noqa: F401,E402
from engine.generate import GenerationReport  # noqa: F401,E402
from engine.models import make_cache, make_pools, model_dtype  # noqa: F401,E402
from engine.pool import BlockPool  # noqa: F401,E402
from engine.publish import capture, upload  # noqa: F401,E402
from engine.resident import ResidentIndex  # noqa: F401,E402
from engine.restore import Restored  # noqa: F401,E402

# The public surface (issue 18): what README examples and new callers import.
__all__ = [
    "EngineModel",
    "KVPolicy",
    "RestoreRequest",
    "WriteBehindPublisher",
    "generate_with_store",
    "publish",
    "restore",
]

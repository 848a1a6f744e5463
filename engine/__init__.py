"""engine: the paged KV engine on MLX.

Nouns:
  PageFormat     one named page layout (native-*, k8v8, k8v4, k4v4); engine/formats.py
                 is the registry and knows each format's planes, bytes and codecs.
  PageSpec       a page format bound to one layer's geometry, block size, group size and
                 key rotation; it maps to a kernels PageLayout and a kvstore LayerSpec.
  KVPolicy       which page format a model uses, with exact-model-id overrides.
  BlockPool      one layer's arena of fixed-size blocks with reference counts.
  PagedKVCache   an mlx-lm compatible layer cache whose history lives in pool blocks.
  PageSnapshot   immutable pages of a cache's history, pinned for publication.

make_cache(model, policy) builds a model's caches; install(model) routes attention of
paged layers through kernels.attention.paged_attention.
"""

from engine.attention import install, installed, uninstall  # noqa: F401
from engine.cache import PagedKVCache, PageSnapshot  # noqa: F401
from engine.errors import EngineError, PoolExhausted  # noqa: F401
from engine.formats import FORMATS, PageSpec, bits_per_value, format_identity  # noqa: F401
from engine.models import make_cache, make_pools, model_dtype, model_identity  # noqa: F401
from engine.policy import KVPolicy  # noqa: F401
from engine.pool import BlockPool  # noqa: F401

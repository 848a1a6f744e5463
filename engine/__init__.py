"""engine: the paged KV engine on MLX.

Nouns:
  PageFormat     one named page layout (native, k8v8, k8v4, k4v4) and its byte math.
  KVPolicy       which page format a model uses, with per-model-id overrides.
  BlockPool      per-layer arenas of fixed-size blocks with reference counts.
  PagedKVCache   an mlx-lm compatible cache whose history lives in pool blocks.
"""

"""kernels: attention over paged, optionally packed, KV pages. Imports mlx only.

Nouns:
  block table   per sequence, the ordered pool block ids holding its history.
  packed page   codes plus FP32 scale and offset per group of head_dim values.
  implementation
                "reference" (gather, dequantize, SDPA), "partitioned" (MLX ops,
                bounded workspace), "cuda" and "metal" (custom kernels).
"""

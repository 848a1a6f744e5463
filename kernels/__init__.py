"""kernels: attention over paged, optionally packed, KV pages. Imports mlx only.

Nouns:
  block table   per sequence, the ordered pool block ids holding its history.
  packed page   codes plus FP32 scale and offset per group of head_dim values.
  call          PagedAttentionCall (kernels/call.py): one layer's queries, planes, block
                tables, context lengths, layout, scale, mask, window and sinks.
  implementation
                "reference" (gather, dequantize, SDPA), "partitioned" (MLX ops,
                bounded workspace), "cuda" and "metal" (custom kernels); kernels/attention.py
                picks one.
  tuning        DirectTuning (kernels/tuning.py): the custom kernels' launch parameters.
  launch plan   LaunchPlan (kernels/launch.py): templates, grid and scalars of one kernel call,
                planned by kernels/direct.py.
"""

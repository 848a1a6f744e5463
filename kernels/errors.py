"""Errors of the kernels package.

  ValueError
    AttentionShapeError     paged_attention arguments that do not fit together (kernels/paging.py)
  RuntimeError
    BackendUnavailable      a kernel implementation was forced where its backend is absent
"""

from __future__ import annotations


class BackendUnavailable(RuntimeError):
    """impl="cuda" or "metal" was asked for on a machine without that GPU backend."""

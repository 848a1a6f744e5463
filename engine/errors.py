"""Every error the engine raises. Callers catch these; nothing here is HTTP-aware.

    EngineError                       base of everything below
    ├── InvalidRequest                the caller's mistake (also a ValueError)
    │   ├── UnknownPageFormat         a page format name not in engine.formats.FORMATS
    │   ├── InvalidPolicy             a KV policy (dict or TOML) that does not parse
    │   ├── UnsupportedModel          a model type or geometry the engine has no rules for
    │   ├── UnsupportedBatch          a paged cache was given a batch other than 1
    │   ├── OffsetMismatch            caches whose layers do not sit where a publish
    │   │                             needs them (a checkpoint after generation, layers
    │   │                             at different offsets); carries the offsets
    │   ├── MixedComputation          a checkpoint whose stored pages came from another
    │   │                             computation than its state (they would not
    │   │                             continue like either one); nothing is committed
    │   └── FormatMismatch            keys, values or page bytes that do not fit the
    │       │                         cache's page format (dtype, heads, head dim, length)
    │       └── UnpagedFormat         a page format the paged engine (pools, PagedKVCache,
    │                                 kernels) does not serve: mlx-qB pages live in
    │                                 mlx-lm's QuantizedKVCache only
    ├── PoolExhausted                 no free block and the pool may not grow; raised
    │                                 before any block or table was changed
    ├── SnapshotReleased              a page snapshot was read after release()
    └── GrantExceeded                 a cache under an admission grant would grow past it
                                      and the growth was not admitted; raised before any
                                      block was allocated (carries the decision)

Three levels, as the style guide asks: these exceptions for a caller's mistake or a
failed operation; returned decisions (admission, restore-or-recompute) for "cannot
now"; assertions with a diagnostic for broken invariants (reference counts, tables).
"""

from __future__ import annotations


class EngineError(Exception):
    """Base class. `code` is a stable machine-readable name."""

    code = "engine_error"


class InvalidRequest(EngineError, ValueError):
    code = "invalid_request"


class UnknownPageFormat(InvalidRequest):
    code = "unknown_page_format"


class InvalidPolicy(InvalidRequest):
    code = "invalid_policy"


class UnsupportedModel(InvalidRequest):
    code = "unsupported_model"


class UnsupportedBatch(InvalidRequest):
    code = "unsupported_batch"


class FormatMismatch(InvalidRequest):
    code = "format_mismatch"


class UnpagedFormat(FormatMismatch):
    code = "unpaged_format"


class OffsetMismatch(InvalidRequest):
    """The caches' layers hold other token counts than a checkpoint of `tokens` needs.

    `offsets` is one entry per layer (None where a layer has no token count), `tokens`
    the number that was asked to be published."""

    code = "offset_mismatch"

    def __init__(self, message: str, *, offsets: list, tokens: int):
        super().__init__(message)
        self.offsets = offsets
        self.tokens = tokens


class MixedComputation(InvalidRequest):
    code = "mixed_computation"


class PoolExhausted(EngineError):
    """No free block is left and growth is capped.

    `requested` blocks were asked for, `available` could be had (free plus growth).
    """

    code = "pool_exhausted"

    def __init__(self, message: str, *, requested: int = 0, available: int = 0):
        super().__init__(message)
        self.requested = requested
        self.available = available


class SnapshotReleased(EngineError):
    code = "snapshot_released"


class GrantExceeded(EngineError):
    """A cache under an admission grant would allocate past the grant, and pricing the
    growth did not admit it. `decision` is the Deferred or Refused that said so."""

    code = "grant_exceeded"

    def __init__(self, message: str, decision=None):
        super().__init__(message)
        self.decision = decision

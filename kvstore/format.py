"""Format identity: the one frozen, versioned record of what a page's bytes mean.

A FormatIdentity names the model (id and a fingerprint of its config), the tokenizer,
the block size, and for every layer its kind, KV geometry, page format, quantization
group, scale dtype, key rotation and window. Its canonical encoding is JSON with
sorted keys and no whitespace; the format id is

    blake3(b"mlx-kvstore/format/v1\\x00" || canonical_json)

Identities are stored, compared and diffed field by field. They are never inferred
from a file name, a class name or hasattr. A schema version newer than
SCHEMA_VERSION is refused (UnsupportedVersion), never guessed; older ones are read.

Schema versions:
  1  the fields above.
  2  adds converted_at_token: how the pages were produced. 0: in their page format
     from the first token (always so for native and kXvY pages, and for an mlx-lm
     QuantizedKVCache built empty); N > 0: mlx-qB pages of a cache whose first N tokens
     were computed natively and then converted (mlx-lm generate_step's kv_bits with
     quantized_kv_start). The two computations differ, so they must not share a format
     id or a chain. A schema-1 identity has no such field and its encoding (hence its
     format id) is unchanged; for an mlx-qB schema-1 identity the conversion history
     is unknown, so nothing written today matches it.

Page byte layout per layer (docs/format.md has the full spec):
  native-*: K [kv_heads, tokens, k_head_dim] then V [kv_heads, tokens, v_head_dim],
            C order, in the named dtype.
  kXvY:     K codes, K scales, K offsets, V codes, V scales, V offsets, each
            [kv_heads, tokens, width] C order; codes u8 (4-bit: two per byte, low
            nibble first), scales and offsets float32 per group of group_size.
  mlx-qB:   mlx's affine quantization as mlx-lm's QuantizedKVCache holds it
            (mlx.core.quantize): K codes, K scales, K biases, V codes, V scales,
            V biases, each [kv_heads, tokens, width] C order; codes B bits each,
            packed LSB first into u32le words (head_dim * B / 32 words per row),
            scales and biases in scale_dtype (the model's dtype) per group.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import blake3

from kvstore.errors import IncompatibleFormat, InvalidInput, UnsupportedVersion

SCHEMA_VERSION = 2
# The first schema version whose identities carry converted_at_token.
CONVERSION_SCHEMA_VERSION = 2
MAX_CONVERSION_TOKEN = 2**40
FORMAT_DOMAIN_TAG = b"mlx-kvstore/format/v1\x00"

LAYER_KINDS = ("full", "sliding", "state")
NATIVE_FORMATS = {"native-bf16": 2, "native-f16": 2, "native-f32": 4}
PACKED_FORMATS = {"k8v8": (8, 8), "k8v4": (8, 4), "k4v4": (4, 4)}
# mlx.core.quantize's affine widths; K and V share one width, as in a QuantizedKVCache.
MLX_AFFINE_FORMATS = {f"mlx-q{bits}": bits for bits in (2, 3, 4, 5, 6, 8)}
PAGE_FORMATS = tuple(NATIVE_FORMATS) + tuple(PACKED_FORMATS) + tuple(MLX_AFFINE_FORMATS) + ("none",)
SCALE_NBYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
PACKED_SCALE_DTYPES = ("float32",)  # kXvY: always FP32
MLX_SCALE_DTYPES = ("bfloat16", "float16", "float32")  # mlx-qB: the model's dtype
CODE_WORD_BITS = 32  # mlx-qB codes are packed into u32 words
MAX_LAYERS = 1024
MAX_FIELD_CHARS = 256


def _require(ok: bool, message: str):
    if not ok:
        raise InvalidInput(message)


@dataclass(frozen=True)
class LayerSpec:
    """One layer. kind 'full' layers are paged; 'sliding' and 'state' travel as attachments."""

    kind: str = "full"
    kv_heads: int = 0
    k_head_dim: int = 0
    v_head_dim: int = 0
    page_format: str = "native-bf16"
    group_size: int = 0
    scale_dtype: str = ""
    rotation: str = "none"
    window: int = 0

    def __post_init__(self):
        _require(self.kind in LAYER_KINDS, f"layer kind {self.kind!r} not in {LAYER_KINDS}")
        _require(self.page_format in PAGE_FORMATS, f"page format {self.page_format!r} not in {PAGE_FORMATS}")
        for name in ("kv_heads", "k_head_dim", "v_head_dim", "group_size", "window"):
            value = getattr(self, name)
            _require(isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**20,
                     f"layer field {name} must be an integer in [0, 2^20), got {value!r}")
        _require(isinstance(self.rotation, str) and len(self.rotation) <= MAX_FIELD_CHARS,
                 "rotation must be a short string")
        if self.page_format in PACKED_FORMATS or self.page_format in MLX_AFFINE_FORMATS:
            allowed = PACKED_SCALE_DTYPES if self.page_format in PACKED_FORMATS else MLX_SCALE_DTYPES
            _require(self.group_size > 0, "quantized formats need group_size > 0")
            _require(self.scale_dtype in allowed,
                     f"{self.page_format} scale dtype {self.scale_dtype!r} not in {allowed}")
            for dim in (self.k_head_dim, self.v_head_dim):
                _require(dim % self.group_size == 0, f"head dim {dim} is not a multiple of group size {self.group_size}")
        if self.page_format in MLX_AFFINE_FORMATS:
            bits = MLX_AFFINE_FORMATS[self.page_format]
            for dim in (self.k_head_dim, self.v_head_dim):
                _require(dim * bits % CODE_WORD_BITS == 0,
                         f"{self.page_format}: head dim {dim} does not pack into whole 32-bit words")

    @property
    def paged(self) -> bool:
        return self.kind == "full"

    def page_nbytes(self, tokens: int) -> int:
        """Exact byte length of this layer's page holding `tokens` tokens."""
        heads = self.kv_heads
        if self.page_format in NATIVE_FORMATS:
            return heads * tokens * (self.k_head_dim + self.v_head_dim) * NATIVE_FORMATS[self.page_format]
        if self.page_format in PACKED_FORMATS:
            kb, vb = PACKED_FORMATS[self.page_format]
            scale = SCALE_NBYTES[self.scale_dtype]
            per_token = (self.k_head_dim * kb // 8 + self.v_head_dim * vb // 8
                         + 2 * scale * (self.k_head_dim + self.v_head_dim) // self.group_size)
            return heads * tokens * per_token
        if self.page_format in MLX_AFFINE_FORMATS:
            bits = MLX_AFFINE_FORMATS[self.page_format]
            scale = SCALE_NBYTES[self.scale_dtype]
            dims = self.k_head_dim + self.v_head_dim
            return heads * tokens * (dims * bits // 8 + 2 * scale * dims // self.group_size)
        return 0


@dataclass(frozen=True)
class FormatIdentity:
    model_id: str
    model_fingerprint: str
    block_size_tokens: int
    layers: tuple[LayerSpec, ...]
    tokenizer_fingerprint: str = ""
    schema_version: int = SCHEMA_VERSION
    converted_at_token: int = 0  # schema >= 2; see the module docstring
    _id: bytes = field(default=b"", init=False, repr=False, compare=False)

    def __post_init__(self):
        if (not isinstance(self.schema_version, int) or isinstance(self.schema_version, bool)
                or self.schema_version > SCHEMA_VERSION):
            raise UnsupportedVersion(
                f"format schema version {self.schema_version!r} is newer than this code "
                f"supports ({SCHEMA_VERSION}); upgrade mlx-kvstore to read it"
            )
        _require(self.schema_version >= 1, "schema version must be >= 1")
        for name in ("model_id", "model_fingerprint", "tokenizer_fingerprint"):
            value = getattr(self, name)
            _require(isinstance(value, str) and len(value) <= MAX_FIELD_CHARS,
                     f"{name} must be a string of at most {MAX_FIELD_CHARS} characters")
        _require(isinstance(self.block_size_tokens, int) and not isinstance(self.block_size_tokens, bool)
                 and 1 <= self.block_size_tokens <= 65536,
                 "block_size_tokens must be an integer in [1, 65536]")
        layers = tuple(self.layers)
        _require(1 <= len(layers) <= MAX_LAYERS, f"a format has 1..{MAX_LAYERS} layers, got {len(layers)}")
        _require(all(isinstance(x, LayerSpec) for x in layers), "layers must be LayerSpec records")
        object.__setattr__(self, "layers", layers)
        self._check_conversion()
        object.__setattr__(self, "_id", blake3.blake3(FORMAT_DOMAIN_TAG + self.canonical()).digest())

    def _check_conversion(self) -> None:
        value = self.converted_at_token
        _require(isinstance(value, int) and not isinstance(value, bool)
                 and 0 <= value < MAX_CONVERSION_TOKEN,
                 f"converted_at_token must be an integer in [0, 2^40), got {value!r}")
        if self.schema_version < CONVERSION_SCHEMA_VERSION:
            _require(value == 0, f"a schema-{self.schema_version} identity has no conversion "
                                 f"offset (converted_at_token needs schema "
                                 f">= {CONVERSION_SCHEMA_VERSION})")
        if value:
            paged = [self.layers[i].page_format for i in self.paged_layers]
            _require(bool(paged) and all(f in MLX_AFFINE_FORMATS for f in paged),
                     "only mlx-qB pages are produced by converting a native cache; "
                     f"converted_at_token={value} with page formats {sorted(set(paged))}")

    # -- encoding -----------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        out = {
            "schema_version": self.schema_version,
            "model_id": self.model_id,
            "model_fingerprint": self.model_fingerprint,
            "tokenizer_fingerprint": self.tokenizer_fingerprint,
            "block_size_tokens": self.block_size_tokens,
            "layers": [asdict(layer) for layer in self.layers],
        }
        if self.schema_version >= CONVERSION_SCHEMA_VERSION:
            # Written before schema 2 there was no such field: leaving it out keeps a
            # schema-1 identity's encoding, and so its format id, as it was stored.
            out["converted_at_token"] = self.converted_at_token
        return out

    def canonical(self) -> bytes:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "FormatIdentity":
        if not isinstance(data, dict):
            raise InvalidInput("a format identity is a JSON object")
        version = data.get("schema_version")
        if isinstance(version, int) and version > SCHEMA_VERSION:
            raise UnsupportedVersion(
                f"format schema version {version} is newer than this code supports "
                f"({SCHEMA_VERSION}); upgrade mlx-kvstore to read it"
            )
        known = {f.name for f in fields(cls) if f.init}
        # A schema-1 record has no converted_at_token; one that lists it as 0 (a body
        # that spells out every default) means the same, any other value is refused.
        unknown = set(data) - known
        _require(not unknown, f"unknown format identity fields: {sorted(unknown)}")
        layers = data.get("layers")
        _require(isinstance(layers, list) and len(layers) <= MAX_LAYERS, "layers must be a list")
        layer_fields = {f.name for f in fields(LayerSpec)}
        parsed = []
        for i, layer in enumerate(layers):
            _require(isinstance(layer, dict), f"layers[{i}] must be an object")
            extra = set(layer) - layer_fields
            _require(not extra, f"layers[{i}] has unknown fields {sorted(extra)}")
            parsed.append(LayerSpec(**layer))
        try:
            return cls(**{**data, "layers": tuple(parsed)})
        except TypeError as exc:
            raise InvalidInput(f"bad format identity: {exc}") from None

    @classmethod
    def from_json(cls, raw: bytes | str) -> "FormatIdentity":
        try:
            data = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise InvalidInput(f"format identity is not valid JSON: {exc}") from None
        return cls.from_dict(data)

    # -- identity -----------------------------------------------------------------
    @property
    def format_id(self) -> bytes:
        """32-byte blake3 of the canonical encoding."""
        return self._id

    @property
    def format_id_hex(self) -> str:
        return self._id.hex()

    @property
    def paged_layers(self) -> tuple[int, ...]:
        """Indices of the layers that have one page per block."""
        return tuple(i for i, layer in enumerate(self.layers) if layer.paged)

    def equivalent_older(self) -> "FormatIdentity | None":
        """The identity of an older schema whose pages mean exactly what this one's do,
        or None. Written before schema 2 there was no converted_at_token; only mlx-qB
        pages are ever produced by converting a cache, so a schema-1 identity with no
        mlx-qB layer names the same pages as this schema-2 one with converted_at_token
        0. A schema-1 mlx-qB identity's history is unknown: it has no equivalent."""
        if self.schema_version != CONVERSION_SCHEMA_VERSION or self.converted_at_token:
            return None
        if any(layer.page_format in MLX_AFFINE_FORMATS for layer in self.layers):
            return None
        return FormatIdentity(self.model_id, self.model_fingerprint, self.block_size_tokens,
                              self.layers, self.tokenizer_fingerprint, schema_version=1)

    def block_nbytes(self, tokens: int) -> int:
        """Bytes of all pages of one block of `tokens` tokens."""
        return sum(self.layers[i].page_nbytes(tokens) for i in self.paged_layers)

    def require_same(self, other: "FormatIdentity", what: str = "format identity") -> None:
        """Raise IncompatibleFormat naming every differing field unless the two are equal."""
        if self.format_id != other.format_id:
            raise IncompatibleFormat(f"{what} does not match", diff(self, other))


def diff(a: FormatIdentity, b: FormatIdentity) -> list[tuple[str, object, object]]:
    """Every field that differs, as (path, a's value, b's value). Empty when equal."""
    out: list[tuple[str, object, object]] = []
    da, db = a.to_dict(), b.to_dict()
    for key in sorted(set(da) | set(db)):
        if key == "layers":
            continue
        if da.get(key) != db.get(key):
            out.append((key, da.get(key), db.get(key)))
    la, lb = da["layers"], db["layers"]
    if len(la) != len(lb):
        out.append(("len(layers)", len(la), len(lb)))
    for i, (x, y) in enumerate(zip(la, lb)):
        for key in sorted(x):
            if x[key] != y[key]:
                out.append((f"layers[{i}].{key}", x[key], y[key]))
    return out

"""The one registry of page formats: their names, plane layouts, byte math and codecs.

Formats (kvstore/format.py names them the same way):
  native-bf16, native-f16, native-f32   K and V exactly as the model produced them.
                                        "native" in a policy means the model's dtype.
  k8v8, k8v4, k4v4                      token-local affine groups of `group_size` along
                                        head_dim, FP32 scale and offset per group;
                                        keys optionally in a signed Hadamard basis.
  mlx-q2 .. mlx-q8                      mlx's own affine quantization, exactly as
                                        mlx.core.quantize writes it and mlx-lm's
                                        QuantizedKVCache holds it: u32-packed codes,
                                        scale and bias per group in the model's dtype.
                                        Published from and restored into a
                                        QuantizedKVCache only: the paged engine (pools,
                                        PagedKVCache, kernels) does not serve them.

A PageSpec is one layer's page format bound to its geometry and block size: it gives the
kernels' PageLayout, the planes a pool arena holds, kvstore's LayerSpec, and the page
byte layout. A page covers the tokens of one block (the last block may be shorter) and
is the planes' bytes concatenated in plane order, each [kv_heads, tokens, width] C
order, little-endian:
  native:  k, v
  packed:  k_codes, k_scales, k_offsets, v_codes, v_scales, v_offsets
  mlx-qB:  k_codes, k_scales, k_biases, v_codes, v_scales, v_biases
which is exactly LayerSpec.page_nbytes in kvstore/format.py.

Values are quantized in one place, encode_tokens, called once when K/V are written
(mlx-qB values were quantized by mlx-lm's QuantizedKVCache and are taken as they are).
Nothing here re-quantizes a stored page.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from fractions import Fraction
from functools import cached_property

import mlx.core as mx
import numpy as np

from engine.errors import FormatMismatch, UnknownPageFormat, UnpagedFormat, UnsupportedModel
from engine.geometry import LayerGeometry, layer_geometry, model_fingerprint
from engine.pagecopy import direct_writes, gather_pages, host_readable
from kernels.hadamard import is_power_of_two, unrotate
from kernels.layout import PageLayout
from kernels.quant import dequantize
from kernels.quantize import encode as encode_packed
from kvstore.format import MLX_AFFINE_FORMATS, FormatIdentity, LayerSpec

ROTATION_SCHEME = "signed-hadamard"
SCALE_DTYPE = "float32"
MLX_PLANES = ("k_codes", "k_scales", "k_biases", "v_codes", "v_scales", "v_biases")
MLX_GROUP_SIZES = (32, 64, 128)  # what mlx.core.quantize accepts
# Scale dtypes of mlx-qB pages, by their name in a format identity.
DTYPE_BY_NAME = {"bfloat16": mx.bfloat16, "float16": mx.float16, "float32": mx.float32}
NAME_BY_DTYPE = {dtype: name for name, dtype in DTYPE_BY_NAME.items()}


@dataclass(frozen=True)
class PageFormat:
    name: str
    k_bits: int = 0  # 0: native
    v_bits: int = 0
    # native: the K/V dtype. mlx-qB: the scales' and biases' dtype (the model's), bound
    # by resolve_format; None in the registry, where it is not known yet.
    dtype: mx.Dtype | None = None
    mlx_affine: bool = False  # mlx.core.quantize's layout, not the kernels'

    @property
    def native(self) -> bool:
        return self.k_bits == 0

    @property
    def packed(self) -> bool:
        """The kernels' packed layout (kernels/layout.py): u8 codes, FP32 scales."""
        return self.k_bits != 0 and not self.mlx_affine

    @property
    def paged(self) -> bool:
        """Whether BlockPool, PagedKVCache and the kernels serve pages of this format."""
        return not self.mlx_affine


FORMATS: dict[str, PageFormat] = {
    "native-bf16": PageFormat("native-bf16", dtype=mx.bfloat16),
    "native-f16": PageFormat("native-f16", dtype=mx.float16),
    "native-f32": PageFormat("native-f32", dtype=mx.float32),
    "k8v8": PageFormat("k8v8", 8, 8),
    "k8v4": PageFormat("k8v4", 8, 4),
    "k4v4": PageFormat("k4v4", 4, 4),
    **{name: PageFormat(name, bits, bits, mlx_affine=True)
       for name, bits in MLX_AFFINE_FORMATS.items()},
}
PAGED_FORMATS = tuple(name for name, fmt in FORMATS.items() if fmt.paged)
FORMAT_ALIASES = ("native",)  # resolved against the model dtype
_NATIVE_BY_DTYPE = {mx.bfloat16: "native-bf16", mx.float16: "native-f16", mx.float32: "native-f32"}


def native_format_name(dtype: mx.Dtype) -> str:
    if dtype not in _NATIVE_BY_DTYPE:
        raise UnsupportedModel(f"no native page format for model dtype {dtype}")
    return _NATIVE_BY_DTYPE[dtype]


def resolve_format(name: str, model_dtype: mx.Dtype) -> PageFormat:
    """The PageFormat for a policy name; "native" becomes native-<model dtype>, and an
    mlx-qB format gets the model dtype as its scale dtype (mlx.core.quantize keeps
    scales and biases in the dtype of what it quantizes)."""
    if name == "native":
        name = native_format_name(model_dtype)
    if name not in FORMATS:
        known = ", ".join(sorted(set(FORMATS) | set(FORMAT_ALIASES)))
        raise UnknownPageFormat(f"unknown page format {name!r} (known: {known})")
    fmt = FORMATS[name]
    if fmt.mlx_affine:
        if model_dtype not in NAME_BY_DTYPE:
            raise UnsupportedModel(f"no {name} scale dtype for model dtype {model_dtype}")
        fmt = replace(fmt, dtype=model_dtype)
    return fmt


def require_paged(fmt: PageFormat) -> None:
    """UnpagedFormat unless the paged engine (pools, PagedKVCache, kernels) serves fmt."""
    if not fmt.paged:
        raise UnpagedFormat(
            f"the paged engine cannot serve {fmt.name} pages: they are mlx's own affine "
            "quantization (u32 codes, scales in the model dtype), which the kernels' page "
            "layouts do not describe. Hold them in mlx-lm's QuantizedKVCache "
            "(restore(..., cache_kind='quantized')), or choose a paged format "
            f"({', '.join(PAGED_FORMATS)})")


@dataclass(frozen=True)
class PageSpec:
    """One layer's pages: format, geometry, block size, quantization group and rotation."""

    format: PageFormat
    kv_heads: int
    k_head_dim: int
    v_head_dim: int
    block_size_tokens: int
    group_size: int = 64
    rotation_seed: int | None = None  # packed keys are stored as k @ R(seed) when set

    def __post_init__(self):
        if self.format.native and self.group_size != 64:
            # Native pages have no groups; one canonical value keeps specs built from a
            # policy and from an identity equal.
            object.__setattr__(self, "group_size", 64)
        if self.rotation_seed is not None:
            if not self.format.packed:
                raise FormatMismatch(f"{self.format.name} pages are never rotated")
            if not is_power_of_two(self.k_head_dim):
                raise FormatMismatch(f"key rotation needs a power-of-two head dim, got {self.k_head_dim}")
        if self.format.mlx_affine:
            self._check_mlx_affine()
        else:
            self.layout.plane_widths(self.k_head_dim, self.v_head_dim)  # validates group size

    def _check_mlx_affine(self) -> None:
        name = self.format.name
        if self.format.dtype not in NAME_BY_DTYPE:
            raise FormatMismatch(f"{name} pages need their scale dtype: use "
                                 "resolve_format(name, model dtype)")
        if self.group_size not in MLX_GROUP_SIZES:
            raise FormatMismatch(f"{name}: mlx quantizes in groups of {MLX_GROUP_SIZES}, "
                                 f"not {self.group_size}")
        for dim in (self.k_head_dim, self.v_head_dim):
            if dim % self.group_size:
                raise FormatMismatch(f"head dim {dim} is not a multiple of group size {self.group_size}")

    @cached_property
    def layout(self) -> PageLayout:
        """The kernels' layout of these pages (UnpagedFormat for mlx-qB pages). Cached: the
        decode path reads it several times per layer and step (a frozen spec never changes)."""
        require_paged(self.format)
        if not self.format.packed:
            return PageLayout()
        return PageLayout(self.format.k_bits, self.format.v_bits, self.group_size,
                          self.rotation_seed)

    @property
    def plane_names(self) -> tuple[str, ...]:
        return MLX_PLANES if self.format.mlx_affine else self.layout.plane_names

    @property
    def plane_widths(self) -> dict[str, int]:
        if not self.format.mlx_affine:
            return self.layout.plane_widths(self.k_head_dim, self.v_head_dim)
        # codes: head_dim values of k_bits each in u32 words; one scale and bias per group
        out = {}
        for half, dim in (("k", self.k_head_dim), ("v", self.v_head_dim)):
            out[f"{half}_codes"] = dim * self.format.k_bits // 32
            out[f"{half}_scales"] = out[f"{half}_biases"] = dim // self.group_size
        return out

    @property
    def plane_dtypes(self) -> dict[str, mx.Dtype]:
        if self.format.native:
            return {"k": self.format.dtype, "v": self.format.dtype}
        codes, scales = ((mx.uint32, self.format.dtype) if self.format.mlx_affine
                         else (mx.uint8, mx.float32))
        return {name: (codes if name.endswith("codes") else scales) for name in self.plane_names}

    def page_nbytes(self, tokens: int) -> int:
        """Bytes of one page holding `tokens` tokens (equals LayerSpec.page_nbytes)."""
        widths, dtypes = self.plane_widths, self.plane_dtypes
        return sum(self.kv_heads * tokens * widths[n] * dtypes[n].size for n in self.plane_names)

    @property
    def block_nbytes(self) -> int:
        """Bytes of one full block of this layer in a pool arena."""
        return self.page_nbytes(self.block_size_tokens)

    def num_blocks(self, tokens: int) -> int:
        """Blocks a sequence of `tokens` tokens occupies in a pool."""
        return -(-tokens // self.block_size_tokens)

    def storage_nbytes(self, tokens: int) -> int:
        """Pool bytes of a sequence of `tokens` tokens (whole blocks)."""
        return self.num_blocks(tokens) * self.block_nbytes

    @property
    def rotation(self) -> str:
        return "none" if self.rotation_seed is None else f"{ROTATION_SCHEME}:{self.rotation_seed}"

    @property
    def scale_dtype(self) -> str:
        """The identity's scale_dtype: "" native, float32 packed, the model's for mlx-qB."""
        if self.format.native:
            return ""
        return NAME_BY_DTYPE[self.format.dtype] if self.format.mlx_affine else SCALE_DTYPE

    def layer_spec(self) -> LayerSpec:
        quantized = not self.format.native
        return LayerSpec(kind="full", kv_heads=self.kv_heads, k_head_dim=self.k_head_dim,
                         v_head_dim=self.v_head_dim, page_format=self.format.name,
                         group_size=self.group_size if quantized else 0,
                         scale_dtype=self.scale_dtype, rotation=self.rotation)

    @classmethod
    def from_layer_spec(cls, layer: LayerSpec, block_size_tokens: int) -> "PageSpec":
        if layer.kind != "full":
            raise FormatMismatch(f"a {layer.kind} layer has no pages")
        seed = None
        if layer.rotation != "none":
            scheme, _, value = layer.rotation.partition(":")
            if scheme != ROTATION_SCHEME or not value.isdigit():
                raise FormatMismatch(f"unknown key rotation {layer.rotation!r}")
            seed = int(value)
        # The scale dtype binds an mlx-qB format (a native format names its own dtype).
        fmt = resolve_format(layer.page_format, DTYPE_BY_NAME.get(layer.scale_dtype, mx.float32))
        return cls(fmt, layer.kv_heads, layer.k_head_dim, layer.v_head_dim, block_size_tokens,
                   layer.group_size if not fmt.native else 64, seed)


def bits_per_value(spec: PageSpec, tokens: int | None = None) -> Fraction:
    """Stored bits per K or V element, metadata included, from page_nbytes (exact)."""
    tokens = tokens or spec.block_size_tokens
    values = spec.kv_heads * tokens * (spec.k_head_dim + spec.v_head_dim)
    return Fraction(spec.page_nbytes(tokens) * 8, values)


# -- format identity ------------------------------------------------------------------
def page_spec_for(geometry: LayerGeometry, fmt: PageFormat, policy) -> PageSpec:
    """The PageSpec a policy gives one full-attention layer."""
    seed = None
    if fmt.packed and policy.rotation != "off":
        if is_power_of_two(geometry.k_head_dim):
            seed = policy.rotation_seed
        elif policy.rotation == "on":
            raise FormatMismatch(
                f"rotation is 'on' but key head dim {geometry.k_head_dim} is not a power of two")
    return PageSpec(fmt, geometry.kv_heads, geometry.k_head_dim, geometry.v_head_dim,
                    policy.block_size_tokens, policy.group_size, seed)


def format_identity(config, policy, *, model_id: str, model_dtype: mx.Dtype,
                    tokenizer_fingerprint: str = "", converted_at_token: int = 0) -> FormatIdentity:
    """kvstore's FormatIdentity for a model config (dict or ModelArgs) under a KV policy.

    Full layers get the policy's page format; sliding layers (attachments) record the
    model dtype's native format, the dtype their ring arrays travel in.
    converted_at_token: for mlx-qB pages, the offset at which a native cache was
    converted to them (0: quantized from the first token; engine/stock.py).
    """
    fmt = resolve_format(policy.format_for(model_id), model_dtype)
    native = native_format_name(model_dtype)
    layers = []
    for geometry in layer_geometry(config):
        if geometry.kind == "full":
            layers.append(page_spec_for(geometry, fmt, policy).layer_spec())
        else:
            layers.append(LayerSpec(kind=geometry.kind, kv_heads=geometry.kv_heads,
                                    k_head_dim=geometry.k_head_dim,
                                    v_head_dim=geometry.v_head_dim,
                                    page_format=native if geometry.kind == "sliding" else "none",
                                    window=geometry.window))
    return FormatIdentity(model_id=model_id, model_fingerprint=model_fingerprint(config),
                          block_size_tokens=policy.block_size_tokens, layers=tuple(layers),
                          tokenizer_fingerprint=tokenizer_fingerprint,
                          converted_at_token=converted_at_token)


def page_specs(identity: FormatIdentity) -> list[PageSpec | None]:
    """Per layer, the PageSpec of a paged layer or None for an attachment layer."""
    return [PageSpec.from_layer_spec(layer, identity.block_size_tokens) if layer.paged else None
            for layer in identity.layers]


# -- codecs ---------------------------------------------------------------------------
def encode_tokens(spec: PageSpec, keys: mx.array, values: mx.array) -> dict[str, mx.array]:
    """keys [H, L, Dk], values [H, L, Dv] -> plane name -> [H, L, width]; or [1, H, L, D]
    -> [1, H, L, width] (the cache's decode path: no squeeze of the batch axis, which MLX
    0.32 builds as a gather and a squeeze per array).

    The only place values are quantized. Packed keys are rotated first when the spec
    has a rotation seed (float32 math). Cost per decode step and layer: one compiled
    graph (CPU) or a matmul and one kernel launch (CUDA) instead of ~40 small ops.
    """
    if spec.format.native:
        return {"k": keys, "v": values}
    # kernels/quantize.py: one fused launch per write on CUDA, mx.compile elsewhere; both
    # bit-identical to kernels/quant.py's quantize (tests/kernels/test_quantize.py)
    return encode_packed(keys, values, spec.layout)


def decode_tokens(spec: PageSpec, planes: dict[str, mx.array], dtype: mx.Dtype):
    """planes [..., T, width] -> (keys [..., T, Dk], values [..., T, Dv]) in dtype,
    keys back in the model's basis. A read, never a re-encode."""
    if spec.format.native:
        return planes["k"].astype(dtype), planes["v"].astype(dtype)
    layout = spec.layout
    keys = dequantize(planes["k_codes"], planes["k_scales"], planes["k_offsets"], layout.k_bits)
    values = dequantize(planes["v_codes"], planes["v_scales"], planes["v_offsets"],
                        layout.v_bits)
    if layout.rotated_keys:
        keys = unrotate(keys, layout.rotation_seed)
    return keys.astype(dtype), values.astype(dtype)


def gather_history(spec: PageSpec, arena: dict[str, mx.array], block_ids: list[int],
                   num_tokens: int) -> dict[str, mx.array]:
    """A sequence's stored planes, contiguous: name -> [H, num_tokens, width]."""
    if not block_ids:
        return {n: mx.zeros((spec.kv_heads, 0, w), spec.plane_dtypes[n])
                for n, w in spec.plane_widths.items()}
    ids = mx.array(block_ids, dtype=mx.int32)
    out = {}
    for name in spec.plane_names:
        blocks = arena[name][ids]  # [n, H, bs, W]
        n, heads, size, width = blocks.shape
        out[name] = blocks.transpose(1, 0, 2, 3).reshape(heads, n * size, width)[:, :num_tokens]
    return out


def _to_bytes(x: mx.array) -> bytes:
    """C-order little-endian bytes of an array (bfloat16 as its uint16 bit patterns)."""
    if x.dtype == mx.bfloat16:
        x = x.view(mx.uint16)
    host = np.array(x)
    return host.astype(host.dtype.newbyteorder("<"), copy=False).tobytes()


def page_from_planes(spec: PageSpec, planes: dict[str, mx.array]) -> bytes:
    """One page's bytes from its planes, each [H, tokens, width]."""
    tokens = planes[spec.plane_names[0]].shape[1]
    parts = []
    for name in spec.plane_names:
        plane = planes[name]
        expected = (spec.kv_heads, tokens, spec.plane_widths[name])
        if tuple(plane.shape) != expected or plane.dtype != spec.plane_dtypes[name]:
            raise FormatMismatch(f"plane {name} is {plane.dtype}{tuple(plane.shape)}, "
                                 f"expected {spec.plane_dtypes[name]}{expected}")
        parts.append(_to_bytes(plane))
    data = b"".join(parts)
    assert len(data) == spec.page_nbytes(tokens), (len(data), spec.page_nbytes(tokens))
    return data


def planes_from_page(spec: PageSpec, data, tokens: int) -> dict[str, mx.array]:
    """A page's bytes -> name -> [H, tokens, width] (exact bytes, no re-encoding).

    One copy: the page's bytes become one uint8 array, and each plane is a
    reinterpreting view of its slice of it (hosts are little-endian, as pages are).
    """
    view = memoryview(data).cast("B")
    if len(view) != spec.page_nbytes(tokens):
        raise FormatMismatch(f"a page of {tokens} tokens is {spec.page_nbytes(tokens)} bytes, "
                             f"got {len(view)}")
    raw = mx.array(np.frombuffer(view, dtype=np.uint8))
    out, start = {}, 0
    for name in spec.plane_names:
        dtype = spec.plane_dtypes[name]
        shape = (spec.kv_heads, tokens, spec.plane_widths[name])
        nbytes = shape[0] * shape[1] * shape[2] * dtype.size
        plane = raw[start : start + nbytes]
        out[name] = (plane if dtype == mx.uint8 else plane.view(dtype)).reshape(shape)
        start += nbytes
    return out


def pages_from_blocks(spec: PageSpec, arena: dict[str, mx.array], block_ids: list[int],
                      num_tokens: int, copies=None) -> list[memoryview]:
    """The kvstore pages of a sequence: one per block, the last one possibly shorter.

    arena: name -> [num_blocks, H, block_size, width] (a pool layer's planes).
    Cost: one copy of the pages' bytes, from the arena's own memory (host views,
    engine/pagecopy.py) into one host buffer; on CUDA the blocks are gathered on the
    device first and come over in one transfer per plane. The pages are read-only
    views of that buffer (bytes-like: hash, send or compare them; bytes() copies).
    copies (an engine.pagecopy.PageCopies): only add the copies to it, for the caller
    to run together with others (capture runs every layer's on one set of threads).
    """
    size = spec.block_size_tokens
    if num_tokens > len(block_ids) * size or num_tokens <= (len(block_ids) - 1) * size:
        raise FormatMismatch(f"{num_tokens} tokens do not fill {len(block_ids)} blocks of {size}")
    if direct_writes():
        hosts = {name: host_readable(arena[name]) for name in spec.plane_names}
        return gather_pages(spec, hosts, list(block_ids), num_tokens, copies)
    ids = mx.array(block_ids, dtype=mx.int32)
    hosts = {name: host_readable(arena[name][ids]) for name in spec.plane_names}
    return gather_pages(spec, hosts, list(range(len(block_ids))), num_tokens, copies)


def blocks_from_pages(spec: PageSpec, pages: list) -> tuple[dict[str, mx.array], int]:
    """Pages (each a full block but the last) -> (name -> [n, H, block_size, width], tokens).

    The tail of a short last block is zero. Inverse of pages_from_blocks.
    """
    size = spec.block_size_tokens
    full = spec.page_nbytes(size)
    lengths = [len(memoryview(p).cast("B")) for p in pages]
    if any(n != full for n in lengths[:-1]):
        raise FormatMismatch(f"every page but the last must hold a full block ({full} bytes)")
    per_token = spec.page_nbytes(1)
    if not pages or lengths[-1] == 0 or lengths[-1] % per_token or lengths[-1] > full:
        raise FormatMismatch(f"the last page must hold 1..{size} tokens of {per_token} bytes")
    tail = lengths[-1] // per_token
    blocks: dict[str, list[mx.array]] = {n: [] for n in spec.plane_names}
    for i, page in enumerate(pages):
        tokens = size if i < len(pages) - 1 else tail
        for name, plane in planes_from_page(spec, page, tokens).items():
            if tokens < size:
                pad = mx.zeros((spec.kv_heads, size - tokens, plane.shape[-1]), plane.dtype)
                plane = mx.concatenate([plane, pad], axis=1)
            blocks[name].append(plane)
    return {n: mx.stack(b) for n, b in blocks.items()}, (len(pages) - 1) * size + tail

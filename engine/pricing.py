"""Pricing: the physical bytes a request will need, computed before anything is allocated.

Nouns:
  ModelProfile   what pricing needs to know about one served model: per layer its kind,
                 PageSpec and BlockPool (paged layers) or ring geometry (sliding
                 layers), the attention implementation its caches ask for, the sizes
                 of its activations, and the ExecutionKey its rates are learned under.
  Price          one request's bill, one line per priced object, with the literal
                 prompt-plus-generation tokens beside the bytes.

One function per priced object computes its nbytes; nothing else sums bytes:
  PageSpec.storage_nbytes     pool pages of a paged layer (whole blocks; engine/formats.py)
  ring_nbytes                 a sliding layer's RotatingKVCache (at most its window)
  block_table_nbytes          the per-page fixed cost (device block table entries)
  request_fixed_nbytes        the per-request fixed cost (last logits, token arrays)
  step_workspace_nbytes       the guaranteed workspace of one step: the attention
                              implementation that will run (kernels.attention.
                              workspace_nbytes) plus activations and the encode of new K/V
  restore_staging_nbytes      a restore's staging buffers (fetched pages, stacked planes)

Everything here is an upper estimate for batch size 1; what each term assumes is said
where it is computed. Prices do not depend on what is allocated now, only on the request
and the profile: the AdmissionController compares them with what is free.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn

from engine.formats import PageSpec
from engine.attention import GATHERED
from engine.geometry import LayerGeometry, probe_geometry
from engine.models import default_attention_impl
from engine.pool import BlockPool
from engine.rates import ExecutionKey
from kernels.attention import select_impl
from kernels.attention import workspace_nbytes as attention_workspace_nbytes

# mlx-lm's generate_step prefills in chunks of this many tokens (its default).
DEFAULT_PREFILL_STEP_TOKENS = 2048
# mlx-lm's generate_step launches step n+1 (mx.async_eval) before step n is consumed, so
# two steps of one request can hold workspace at once.
DEFAULT_STEPS_IN_FLIGHT = 2
# The device copy of a block table holds one int32 per block (PagedKVCache.block_table).
BLOCK_TABLE_ENTRY_NBYTES = 4
# kernels.attention.workspace_nbytes times this is what pricing charges per attention
# call, by (implementation, packed pages, prefill). Measured as MLX's peak active memory
# above inputs and output over the estimate, L queries over T tokens, T up to 4096
# (test_priced_attention_workspace_covers_the_measured_peak sweeps the shapes), the
# largest ratios were:
#                CPU (MLX 0.32.4)                      H200 (MLX 0.32.4, CUDA)
#   reference    native prefill 0.38, decode 0.98      native 0.10 / 0.98
#                packed prefill 0.85, decode 1.10      packed 0.85 / 1.10
#   partitioned  native prefill 2.09, decode 4.93      native 2.13 / 7.9
#                packed prefill 2.97, decode 1.23      packed 4.55 / 1.86
# "partitioned" runs its loop over partitions as one lazy graph, so the gathers of all
# partitions are alive at once rather than one partition's, and its score temporaries
# are more than the two the estimate counts. Reported to kernels/; until the estimate or
# the kernel changes, these margins (the largest ratio plus about 10-25%) keep the
# budget a real bound. The H200 figures were taken with strided (non-contiguous) test
# planes, which makes them an upper side. cuda/metal: the only H200 measurement used
# strided planes, which the launcher copies whole (kernels/direct.py says so), so it
# measured that copy, not the kernel; with a pool's contiguous planes the kernel's own
# estimate stands (1.0) until the sweep runs there again.
WORKSPACE_MARGIN = {
    ("reference", False, True): 1.0, ("reference", False, False): 1.25,
    ("reference", True, True): 1.1, ("reference", True, False): 1.4,
    ("partitioned", False, True): 2.7, ("partitioned", False, False): 8.7,
    ("partitioned", True, True): 5.0, ("partitioned", True, False): 2.1,
}
# Floats of activation per query row, in units of the model width and the MLP width:
# residual stream, normed input, attention output and q/k/v projections (~6 x hidden),
# the MLP's gate, up and product (3 x intermediate). Counted in float32 so that float32
# and bf16 models are both covered.
ACTIVATION_HIDDEN_FACTOR = 6
ACTIVATION_MLP_FACTOR = 3


@dataclass(frozen=True)
class LayerPlan:
    """One decoder layer as pricing sees it."""

    kind: str  # "full" | "sliding" | "state"
    geometry: LayerGeometry
    spec: PageSpec | None = None  # paged layers only
    pool: BlockPool | None = field(default=None, compare=False)
    attention_impl: str | None = None  # the cache's request, as make_cache sets it


@dataclass(frozen=True)
class ModelProfile:
    """What pricing knows about one served model (built by profile_model)."""

    layers: tuple[LayerPlan, ...]
    model_dtype_nbytes: int
    n_q_heads: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    key: ExecutionKey
    prefill_step_tokens: int = DEFAULT_PREFILL_STEP_TOKENS

    @property
    def paged(self) -> tuple[LayerPlan, ...]:
        return tuple(layer for layer in self.layers if layer.kind == "full")

    @property
    def pools(self) -> tuple[BlockPool, ...]:
        return tuple(layer.pool for layer in self.paged)


def profile_model(model: nn.Module, pools: list, *, model_fingerprint: str,
                  attention_impl: str | None = "auto",
                  prefill_step_tokens: int = DEFAULT_PREFILL_STEP_TOKENS,
                  device: str | None = None) -> ModelProfile:
    """The pricing profile of a model served from `pools` (from engine.make_pools).

    attention_impl is what make_cache will be given ("auto" resolves per pool exactly as
    make_cache does). The execution key names the implementation that decode runs.
    """
    probed = probe_geometry(model)  # sizes from the probe and the config, never model.args
    geometry = probed.layers
    if len(pools) != len(geometry):
        raise ValueError(f"{len(pools)} pools for {len(geometry)} layers")
    layers = []
    for layer, pool in zip(geometry, pools, strict=True):
        if layer.kind == "full":
            impl = default_attention_impl(pool) if attention_impl == "auto" else attention_impl
            if impl == GATHERED:  # mlx-lm's attention over the decoded history: what the
                impl = "reference"  # reference arm does (gather, decode, one attention)
            layers.append(LayerPlan("full", layer, pool.spec, pool, impl))
        else:
            layers.append(LayerPlan(layer.kind, layer))
    dtype = probed.kv_dtype
    paged = [layer for layer in layers if layer.kind == "full"]
    if paged:
        first = paged[0]
        decode_impl = select_impl(first.attention_impl, 1, None, first.spec.layout,
                                  first.spec.k_head_dim, first.spec.v_head_dim)
        page_format = first.spec.format.name
    else:
        decode_impl, page_format = "none", "none"
    key = ExecutionKey(model_fingerprint, page_format, decode_impl,
                       device or str(mx.default_device()))
    return ModelProfile(tuple(layers), dtype.size, probed.num_attention_heads,
                        probed.hidden_size, probed.intermediate_size, probed.vocab_size, key,
                        prefill_step_tokens)


# -- one nbytes function per priced object ---------------------------------------------
def ring_nbytes(geometry: LayerGeometry, dtype_nbytes: int, tokens: int) -> int:
    """A sliding layer's ring (mlx-lm RotatingKVCache) after `tokens` tokens: at most its
    window of K and V in the model dtype. The prefill chunk it briefly holds beyond the
    window is step workspace (see step_workspace_nbytes)."""
    kept = min(tokens, geometry.window)
    return geometry.kv_heads * kept * (geometry.k_head_dim + geometry.v_head_dim) * dtype_nbytes


def block_table_nbytes(num_blocks: int) -> int:
    """The fixed cost per page: its entry in the device copy of the block table."""
    return num_blocks * BLOCK_TABLE_ENTRY_NBYTES


def request_fixed_nbytes(profile: ModelProfile) -> int:
    """The fixed cost per request: the last step's logits and logprobs ([vocab] float32
    each) and its token arrays, which outlive the step that made them."""
    return 2 * profile.vocab_size * 4 + 64


def activation_nbytes(profile: ModelProfile, num_queries: int) -> int:
    """Activations of one layer's forward over num_queries rows (float32 upper bound),
    plus the logits of the last row."""
    per_row = (ACTIVATION_HIDDEN_FACTOR * profile.hidden_size
               + ACTIVATION_MLP_FACTOR * profile.intermediate_size)
    return num_queries * per_row * 4 + profile.vocab_size * 4


def encode_nbytes(spec: PageSpec, num_queries: int) -> int:
    """Temporaries of writing num_queries new tokens into a page: the float32 copy of
    K/V that rotation and quantization work on, and the encoded planes before the pool
    write (packed); the new K/V themselves for native pages."""
    dims = spec.k_head_dim + spec.v_head_dim
    encoded = spec.page_nbytes(num_queries)
    if not spec.format.packed:
        return encoded
    return spec.kv_heads * num_queries * dims * 4 * 2 + encoded


def attention_nbytes(impl: str, n_q_heads: int, spec: PageSpec, num_queries: int,
                     context_len: int, model_dtype_nbytes: int) -> int:
    """One paged attention call's workspace: the kernels' estimate for the implementation
    that runs, times its measured margin (WORKSPACE_MARGIN; 1.0 where none was measured)."""
    estimate = attention_workspace_nbytes(
        impl, n_q_heads, spec.kv_heads, num_queries, spec.k_head_dim, spec.v_head_dim,
        context_len, spec.block_size_tokens, spec.layout, model_dtype_nbytes=model_dtype_nbytes)
    margin = WORKSPACE_MARGIN.get((impl, spec.format.packed, num_queries > 1), 1.0)
    return math.ceil(estimate * margin)


def layer_attention_nbytes(profile: ModelProfile, layer: LayerPlan, num_queries: int,
                           context_len: int) -> int:
    """One layer's attention workspace for num_queries new queries over context_len
    tokens (new ones included), with the implementation that will run."""
    g = layer.geometry
    if layer.kind == "full":
        spec = layer.spec
        mask = "causal" if num_queries > 1 else None  # what mlx-lm passes (a string)
        impl = select_impl(layer.attention_impl, num_queries, mask, spec.layout,
                           spec.k_head_dim, spec.v_head_dim)
        return attention_nbytes(impl, profile.n_q_heads, spec, num_queries, context_len,
                                profile.model_dtype_nbytes) + encode_nbytes(spec, num_queries)
    if layer.kind == "sliding":
        # RotatingKVCache concatenates the chunk onto window - 1 kept tokens, then
        # mx.fast.scaled_dot_product_attention takes scores [Hq, L, keys] float32.
        keys = min(context_len, g.window - 1 + num_queries)
        ring = g.kv_heads * keys * (g.k_head_dim + g.v_head_dim) * profile.model_dtype_nbytes
        return ring + profile.n_q_heads * num_queries * keys * 4 * 2
    return 0


def step_workspace_nbytes(profile: ModelProfile, num_queries: int, context_len: int) -> int:
    """The guaranteed workspace of one step: the largest layer's attention workspace
    plus activations (MLX frees a layer's temporaries once the next layer consumed its
    output, so layers do not add up)."""
    attention = max((layer_attention_nbytes(profile, layer, num_queries, context_len)
                     for layer in profile.layers), default=0)
    return attention + activation_nbytes(profile, num_queries)


def restore_staging_nbytes(profile: ModelProfile, num_blocks: int, *, remote: bool) -> int:
    """Staging of a restore of num_blocks blocks per paged layer: every layer's pages
    become MLX arrays and are stacked into [n, H, block, width] planes before one
    mx.eval writes them into the pools (two copies per layer, all layers at once), plus
    the fetched page buffers for a remote store (a local store maps its pages)."""
    pages = sum(layer.spec.storage_nbytes(num_blocks * layer.spec.block_size_tokens)
                for layer in profile.paged)
    return 2 * pages + (pages if remote else 0)


# -- the bill ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Price:
    """One request's bill. `tokens` is the literal prompt plus generation length."""

    prompt_tokens: int
    max_new_tokens: int
    restore_blocks: int
    blocks: tuple[int, ...]  # per paged layer, in profile.paged order
    page_nbytes: int  # pool pages (whole blocks), taken from the pools' arenas
    ring_nbytes: int
    page_fixed_nbytes: int
    request_fixed_nbytes: int
    prefill_workspace_nbytes: int
    decode_workspace_nbytes: int
    workspace_nbytes: int  # guaranteed: steps_in_flight steps at once
    staging_nbytes: int

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.max_new_tokens

    @property
    def held_nbytes(self) -> int:
        """Bytes outside the pool arenas that the grant holds until it is closed."""
        return self.ring_nbytes + self.page_fixed_nbytes + self.request_fixed_nbytes

    @property
    def nbytes(self) -> int:
        """Everything: pages, held bytes, workspace and staging."""
        return self.page_nbytes + self.held_nbytes + self.workspace_nbytes + self.staging_nbytes

    def as_dict(self) -> dict:
        return {**self.__dict__, "tokens": self.tokens, "nbytes": self.nbytes}


def price_request(profile: ModelProfile, prompt_tokens: int, max_new_tokens: int, *,
                  restore_blocks: int = 0, restore_remote: bool = False,
                  restored_tokens: int = 0,
                  steps_in_flight: int = DEFAULT_STEPS_IN_FLIGHT) -> Price:
    """The bill of one request (see the module docstring); restored_tokens are not
    prefilled, so the prefill chunk shrinks by them."""
    if prompt_tokens < 0 or max_new_tokens < 0:
        raise ValueError("token counts are never negative")
    tokens = prompt_tokens + max_new_tokens
    blocks = tuple(layer.spec.num_blocks(tokens) for layer in profile.paged)
    page = sum(layer.spec.storage_nbytes(tokens) for layer in profile.paged)
    ring = sum(ring_nbytes(layer.geometry, profile.model_dtype_nbytes, tokens)
               for layer in profile.layers if layer.kind == "sliding")
    computed = max(1, prompt_tokens - restored_tokens)
    chunk = min(computed, profile.prefill_step_tokens)
    prefill = step_workspace_nbytes(profile, chunk, max(prompt_tokens, 1))
    decode = step_workspace_nbytes(profile, 1, max(tokens, 1))
    # In flight at once: the largest step and (steps_in_flight - 1) decode steps.
    workspace = max(prefill, decode) + (steps_in_flight - 1) * decode
    staging = restore_staging_nbytes(profile, restore_blocks, remote=restore_remote) \
        if restore_blocks else 0
    return Price(prompt_tokens, max_new_tokens, restore_blocks, blocks, page, ring,
                 block_table_nbytes(sum(blocks)), request_fixed_nbytes(profile), prefill,
                 decode, workspace, staging)

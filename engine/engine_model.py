"""EngineModel: one mlx-lm model bound to its id and KV policy, built once.

The values that used to travel together through every restore, publish and generate
call (model, policy, model id, tokenizer fingerprint) are one object here, as vLLM's
KVCacheManager is built once from its config. It computes once what each call used to
recompute:

  identity      kvstore's FormatIdentity of the model's pages under the policy
                (identity_for(N) is the same for mlx-qB pages converted at token N)
  geometry      the per-layer kinds and KV shapes, probed from the model
                (engine/geometry.py)
  attention     whether the paged router may attend for it (the load-time check,
                engine.models.check_paged_attention); when not, its paged caches are
                "gathered" (exact, the model's own attention over decoded history)

and owns what requests share:

  pools         one BlockPool per full-attention layer (paged policies only; made on
                first use, through the admission controller when there is one)
  admission     an AdmissionController pricing restores over those pools, or None
  resident      a ResidentIndex over those pools, or None

restore(engine_model, store, request), publish(engine_model, store, tokens, caches) and
generate_with_store(engine_model, tokenizer, prompt, store) take it first.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import mlx.nn as nn

from engine.errors import InvalidRequest
from engine.formats import format_identity, resolve_format
from engine.attention import GATHERED
from engine.geometry import LayerGeometry, probe_geometry
from engine.models import (
    PagedAttentionCheck,
    check_paged_attention,
    kv_dtype,
    make_cache,
    make_pools,
)
from engine.policy import KVPolicy
from engine.stock import make_stock_cache
from kvstore.errors import IncompatibleFormat
from kvstore.format import FormatIdentity, LayerSpec

if TYPE_CHECKING:  # imported for annotations only: admission imports nothing from here
    from engine.admission import AdmissionController
    from engine.pricing import ModelProfile
    from engine.resident import ResidentIndex


def check_pools(identity: FormatIdentity, pools: Sequence) -> None:
    """IncompatibleFormat (with the per-layer field diff) unless every paged layer's pool
    stores exactly the pages the identity names."""
    if len(pools) != len(identity.layers):
        raise IncompatibleFormat("pools do not match the model's format identity",
                                 [("len(layers)", len(identity.layers), len(pools))])
    problems = []
    for index, (layer, pool) in enumerate(zip(identity.layers, pools)):
        if layer.paged != (pool is not None):
            problems.append((f"layers[{index}].paged", layer.paged, pool is not None))
            continue
        if pool is None:
            continue
        theirs = pool.spec.layer_spec()
        for field_name in LayerSpec.__dataclass_fields__:
            a, b = getattr(layer, field_name), getattr(theirs, field_name)
            if a != b:
                problems.append((f"layers[{index}].{field_name}", a, b))
        if pool.spec.block_size_tokens != identity.block_size_tokens:
            problems.append((f"layers[{index}].block_size_tokens", identity.block_size_tokens,
                             pool.spec.block_size_tokens))
    if problems:
        raise IncompatibleFormat("the pools store pages of another format than the model's "
                                 "identity", problems)


class EngineModel:
    def __init__(self, model: nn.Module, model_id: str, *, policy: KVPolicy | None = None,
                 tokenizer_fingerprint: str = "", pools: list | None = None,
                 admission: AdmissionController | None = None,
                 resident: ResidentIndex | None = None, attention_impl: str | None = "auto"):
        """attention_impl is what the paged caches ask the kernels for ("auto": the
        reference arm for native pages, the kernels' dispatch for packed ones); a model
        that fails the load-time check gets "gathered" whatever is asked."""
        self.model = model
        self.model_id = model_id
        self.policy = policy or KVPolicy()
        # The policy bound to this model: its format chosen once, here, so nothing below
        # needs the model id to pick one (model_id reaches only format_identity).
        self.model_policy = self.policy.with_format(self.policy.format_for(model_id))
        self.tokenizer_fingerprint = tokenizer_fingerprint
        self.admission = admission
        self.resident = resident
        probed = probe_geometry(model)
        self.geometry: list[LayerGeometry] = list(probed.layers)
        self.identity: FormatIdentity = self._identity(0)
        self.paged = resolve_format(self.model_policy.default_format, probed.kv_dtype).paged
        self.attention: PagedAttentionCheck = (
            check_paged_attention(model) if self.paged and attention_impl != GATHERED
            else PagedAttentionCheck(False, "gathered by request" if self.paged else "unpaged"))
        self.attention_impl = attention_impl if self.attention.routed else GATHERED
        if resident is not None:
            if admission is not None:
                raise InvalidRequest("resident reuse serves paged caches without admission")
            if pools is not None and list(pools) != resident.pools:
                raise InvalidRequest("the resident index serves other pools than these")
            pools = resident.pools
        if pools is not None:
            check_pools(self.identity, pools)
        self._pools = list(pools) if pools is not None else None
        self._profile: ModelProfile | None = None

    def identity_for(self, converted_at_token: int) -> FormatIdentity:
        """The identity of this model's pages; for mlx-qB pages of a cache converted at
        converted_at_token (engine/stock.py), that conversion's identity."""
        return self.identity if converted_at_token == 0 else self._identity(converted_at_token)

    def _identity(self, converted_at_token: int) -> FormatIdentity:
        return format_identity(self.model, self.model_policy, model_id=self.model_id,
                               model_dtype=kv_dtype(self.model),
                               tokenizer_fingerprint=self.tokenizer_fingerprint,
                               converted_at_token=converted_at_token)

    @property
    def pools(self) -> list:
        """The model's BlockPools (None per non-paged layer), made on first use.
        UnpagedFormat for an mlx-qB policy, whose pages the paged engine does not hold."""
        if self._pools is None:
            make = self.admission.make_pools if self.admission is not None else make_pools
            self._pools = make(self.model, self.model_policy)
        return self._pools

    def profile(self) -> ModelProfile:
        """The admission controller's pricing profile of this model over its pools."""
        if self.admission is None:
            raise InvalidRequest("this engine model has no admission controller")
        if self._profile is None:
            self._profile = self.admission.profile(
                self.model, self.pools, model_fingerprint=self.identity.model_fingerprint,
                attention_impl=self.attention_impl)
        return self._profile

    def make_cache(self, grant=None) -> list:
        """Fresh caches of the model: paged layers in the pools (under `grant` when
        given), mlx-lm's caches for the rest."""
        return make_cache(self.model, self.model_policy, pools=self.pools,
                          attention_impl=self.attention_impl, grant=grant)

    def make_stock_cache(self) -> list:
        """Fresh mlx-lm caches (engine.stock: conversions are recorded)."""
        return make_stock_cache(self.model)

    def __repr__(self) -> str:
        return (f"EngineModel({self.model_id!r}, format {self.identity.format_id_hex[:12]}, "
                f"{'unpaged' if not self.paged else 'routed' if self.attention.routed else 'gathered'})")

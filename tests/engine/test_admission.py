"""Admission: byte budgets, fences, refunds, execution-scoped concurrency, deadlines, restore.

Models are tiny random-weight mlx-lm models (tests/engine/factories.py); pools are small
and fixed-size unless a test is about growth, so the budget binds quickly.
"""

from __future__ import annotations

import gc
import random

import mlx.core as mx
import pytest

from engine.admission import (
    AdmissionController,
    AdmissionRequest,
    AdmittedKVCache,
    Deferred,
    Granted,
    Refused,
    default_budget_nbytes,
)
from engine.attention import installed
from engine.engine_model import EngineModel
from engine.errors import GrantExceeded
from engine.formats import FORMATS, PageSpec, encode_tokens
from engine.models import make_cache, model_dtype
from engine.policy import KVPolicy
from engine.pricing import attention_nbytes, price_request, ring_nbytes
from engine.publish import publish
from engine.rates import ExecutionKey, RateBook
from engine.restore import RestoreRequest, restore
from kernels.attention import cuda_available, metal_available, paged_attention, select_impl
from kvstore.errors import IncompatibleFormat
from kvstore.store import Store
from tests.engine.factories import prompt_tokens, tiny_model

MODEL_ID = "test/tiny"
NATIVE = KVPolicy(block_size_tokens=16)
PACKED = KVPolicy(default_format="k4v4", block_size_tokens=16)
MiB = 1 << 20


class FakeClock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def _setup(model, policy=NATIVE, *, budget=64 * MiB, num_blocks=16, max_blocks="fixed",
           controller=None, **kwargs):
    """(controller, pools, profile) for one model under one policy."""
    controller = controller or AdmissionController(budget, **kwargs)
    pools = controller.make_pools(model, policy, num_blocks=num_blocks,
                                  max_blocks=num_blocks if max_blocks == "fixed" else max_blocks)
    fingerprint = EngineModel(model, MODEL_ID, policy=policy).identity.model_fingerprint
    return controller, pools, controller.profile(model, pools, model_fingerprint=fingerprint)


def _warm(rates: RateBook, key: ExecutionKey, samples: int, prefill=100.0, decode=10.0):
    for _ in range(samples):
        rates.record(key, "prefill_tokens_per_s", prefill, 1.0)
        rates.record(key, "decode_tokens_per_s", decode, 1.0)


def _run(model, grant, cache, tokens: list[int], new_tokens: int, *, retire=True):
    """Prefill then greedy decode under the grant's steps; mlx-lm's overlap (the next
    step built before the last is evaluated) is kept: steps are retired by the grant."""
    with grant.step("prefill", len(tokens)) as step:
        y = mx.argmax(model(mx.array([tokens]), cache=cache)[:, -1], axis=-1)
        step.fence(y)
    for _ in range(new_tokens - 1):
        with grant.step("decode", 1) as step:
            y = mx.argmax(model(y[None], cache=cache)[:, -1], axis=-1)
            step.fence(y)
    if retire:
        for s in list(grant.steps):
            s.retire()
    return y


# -- pricing ------------------------------------------------------------------------------
@pytest.mark.parametrize("policy", [NATIVE, PACKED], ids=["native", "k4v4"])
def test_price_lines_are_the_objects_own_nbytes(policy):
    model = tiny_model("llama", mx.bfloat16)
    controller, pools, profile = _setup(model, policy, warmup_samples=1)
    price = controller.price(profile, AdmissionRequest("r", 37, 12))
    assert price.tokens == 49  # literal prompt + generation, beside the bytes
    assert price.blocks == (4, 4)  # 49 tokens in whole blocks of 16
    assert price.page_nbytes == sum(p.spec.storage_nbytes(49) for p in pools)
    decision = controller.admit(profile, AdmissionRequest("r", 37, 12))
    assert isinstance(decision, Granted)
    cache = make_cache(model, policy, pools=pools, grant=decision.grant)
    with installed(model):
        _run(model, decision.grant, cache, prompt_tokens(37).tolist(), 13)
    assert all(isinstance(c, AdmittedKVCache) for c in cache)
    assert sum(c.nbytes for c in cache) == price.page_nbytes  # 49 tokens written: exact
    decision.grant.close()


def test_packed_pages_price_below_native_and_sliding_layers_cost_at_most_their_window():
    model = tiny_model("gemma3_text", mx.bfloat16)
    _, _, native = _setup(model, NATIVE)
    _, _, packed = _setup(model, PACKED)
    a, b = price_request(native, 300, 40), price_request(packed, 300, 40)
    assert b.page_nbytes * 3 < a.page_nbytes  # k4v4 at head_dim 64: 5 bits vs 16
    assert a.ring_nbytes == b.ring_nbytes  # rings hold the model dtype either way
    window = [layer for layer in native.layers if layer.kind == "sliding"]
    assert a.ring_nbytes == sum(ring_nbytes(layer.geometry, 2, 8) for layer in window)
    assert price_request(native, 3000, 40).ring_nbytes == a.ring_nbytes  # capped at the window
    assert native.key != packed.key  # rates of native pages are never used for packed ones


def test_workspace_is_the_implementation_that_will_run():
    model = tiny_model("llama", mx.bfloat16)
    _, _, reference = _setup(model, NATIVE)  # native pages attend through "reference"
    _, _, partitioned = _setup(model, PACKED)  # packed: the kernels' dispatch (CPU: quantized)
    # packed pages take the device's kernel: CUDA or Metal where present, else quantized
    expected = "cuda" if cuda_available() else "metal" if metal_available() else "quantized"
    assert reference.key.attention_impl == "reference"
    assert partitioned.key.attention_impl == expected
    grow_ref = (price_request(reference, 8000, 1).decode_workspace_nbytes
                - price_request(reference, 2000, 1).decode_workspace_nbytes)
    grow_part = (price_request(partitioned, 8000, 1).decode_workspace_nbytes
                 - price_request(partitioned, 2000, 1).decode_workspace_nbytes)
    assert grow_ref > 0  # the gather path expands the whole history
    # split partials (kernels), a few score rows per partition (quantized), never the
    # expanded history
    assert grow_part < grow_ref


# (format, L new queries, T context tokens): decode and prefill, one and several partitions
WORKSPACE_SHAPES = [
    ("native-bf16", 1, 4096), ("native-bf16", 256, 256), ("native-bf16", 512, 2048),
    ("k4v4", 1, 4096), ("k4v4", 256, 256), ("k4v4", 512, 2048), ("k8v4", 64, 1000),
]


@pytest.mark.parametrize("impl", ["reference", "partitioned", "cuda", "metal"])
def test_priced_attention_workspace_covers_the_measured_peak(impl):
    """MLX's peak active memory of one paged attention call, above its inputs and output,
    never exceeds what pricing charges for it (kernels' estimate times the margin), for
    the implementation that really runs (select_impl: kernels fall back to partitioned
    for many queries)."""
    available = {"cuda": cuda_available, "metal": metal_available}.get(impl, lambda: True)
    if not available():
        pytest.skip(f"SKIPPED LOUDLY: the {impl} backend is not available on this machine, "
                    f"so its workspace margin is not checked here")
    heads, q_heads, dim, block = 2, 4, 64, 16
    over = []
    for name, queries, tokens in WORKSPACE_SHAPES:
        fmt = FORMATS[name]
        spec = PageSpec(fmt, heads, dim, dim, block, 64, 0 if fmt.packed else None)
        keys = mx.random.normal((heads, tokens, dim)).astype(mx.bfloat16)
        planes = encode_tokens(spec, keys, keys * 0.5)
        planes = {n: p.reshape(heads, tokens // block, block, -1).transpose(1, 0, 2, 3)
                  for n, p in planes.items()} if tokens % block == 0 else None
        if planes is None:
            padded = -(-tokens // block) * block
            pad = mx.zeros((heads, padded - tokens, dim), mx.bfloat16)
            full = encode_tokens(spec, mx.concatenate([keys, pad], 1),
                                 mx.concatenate([keys * 0.5, pad], 1))
            planes = {n: p.reshape(heads, padded // block, block, -1).transpose(1, 0, 2, 3)
                      for n, p in full.items()}
        # row-contiguous, as a pool's own planes are (kernels/direct.py copies views)
        planes = {n: mx.contiguous(p) for n, p in planes.items()}
        q = mx.random.normal((1, q_heads, queries, dim)).astype(mx.bfloat16)
        table = mx.arange(-(-tokens // block), dtype=mx.int32)[None]
        mx.eval(planes, q, table)
        mx.synchronize()
        before = mx.get_active_memory()
        mx.reset_peak_memory()
        out = paged_attention(q, planes, table, [tokens], spec.layout, scale=dim ** -0.5,
                              mask="causal" if queries > 1 else None, impl=impl)
        mx.eval(out)
        measured = mx.get_peak_memory() - before - out.nbytes
        mask = "causal" if queries > 1 else None
        chosen = select_impl(impl, queries, mask, spec.layout, dim, dim)
        priced = attention_nbytes(chosen, q_heads, spec, queries, tokens, 2)
        print(f"workspace {impl}->{chosen} {name} L={queries} T={tokens}: measured "
              f"{measured} priced {priced} ratio {measured / priced:.2f}")
        if measured > priced:
            over.append((chosen, name, queries, tokens, measured, priced))
        del out, planes, q
    assert not over, over


# -- the budget ---------------------------------------------------------------------------
def test_budget_is_never_exceeded_across_randomized_request_mixes():
    """Requests of random lengths against two page formats in one budget; a scheduler
    admits, defers and runs them with overlapping steps. Measured: MLX's peak active
    memory above what was allocated before the pools, and the pools' counters."""
    model = tiny_model("llama", mx.bfloat16)
    rng = random.Random(7)
    mx.eval(mx.zeros(1))
    mx.synchronize()
    baseline = mx.get_active_memory()
    budget = 4 * MiB
    controller = AdmissionController(budget, warmup_samples=1, concurrency_ceiling=8)
    setups = [_setup(model, policy, controller=controller, num_blocks=n)
              for policy, n in ((NATIVE, 24), (PACKED, 48))]
    pending = [(f"r{i}", rng.choice(setups), rng.randint(3, 70), rng.randint(1, 12))
               for i in range(24)]
    mx.reset_peak_memory()
    running, deferred, done, peak_committed = [], [], 0, 0
    with installed(model):
        while pending or running:
            for item in list(pending):
                rid, (_, pools, profile), prompt, new = item
                policy = NATIVE if profile.key.page_format.startswith("native") else PACKED
                decision = controller.admit(profile, AdmissionRequest(rid, prompt, new))
                if isinstance(decision, Granted):
                    pending.remove(item)
                    cache = make_cache(model, policy, pools=pools,
                                       grant=decision.grant)
                    running.append([decision.grant, cache, prompt_tokens(prompt, seed=prompt)
                                    .tolist(), new, None])
                else:
                    assert isinstance(decision, Deferred), decision
                    deferred.append(decision.reason)
            if not running:  # what is deferred waits on fences: retire them, then retry
                assert controller.retire_all() > 0, "nothing running, nothing to retire: stuck"
                continue
            for entry in list(running):  # one step of every running request, round robin
                grant, cache, tokens, new, y = entry
                kind = "prefill" if y is None else "decode"
                with grant.step(kind, len(tokens) if y is None else 1) as step:
                    inputs = mx.array([tokens]) if y is None else y[None]
                    y = mx.argmax(model(inputs, cache=cache)[:, -1], axis=-1)
                    step.fence(y)
                mx.async_eval(y)
                entry[4], entry[3] = y, new - 1
                peak_committed = max(peak_committed, controller.committed_nbytes)
                for pool in setups[0][1] + setups[1][1]:
                    assert pool.num_used_blocks <= pool.num_blocks == pool.max_blocks
                if entry[3] == 0:
                    running.remove(entry)
                    grant.close()
                    done += 1
            controller.retire_all() if rng.random() < 0.3 else None
    controller.retire_all()
    mx.synchronize()
    assert done == 24 and "does not fit what is free now" in deferred  # the budget did bind
    assert peak_committed <= budget
    assert mx.get_peak_memory() - baseline <= budget, (mx.get_peak_memory() - baseline, budget)
    stats = controller.stats()
    assert stats["committed_nbytes"] == controller.arena_nbytes  # everything refunded
    assert stats["charged"] == stats["refunded"]
    assert all(p.num_used_blocks == 0 for _, pools, _ in setups for p in pools)


def test_a_request_larger_than_the_budget_is_refused_with_its_shortfall():
    model = tiny_model("llama", mx.bfloat16)
    controller, pools, profile = _setup(model, num_blocks=4)
    decision = controller.admit(profile, AdmissionRequest("big", 100, 10))  # 7 blocks > 4
    assert isinstance(decision, Refused)
    assert decision.shortfall_nbytes == 3 * sum(p.block_nbytes for p in pools)
    assert all(p.num_used_blocks == 0 and p.num_blocks == 4 for p in pools)


def test_growth_beyond_the_grant_is_priced_again_before_allocation():
    model = tiny_model("llama", mx.bfloat16)
    controller, pools, profile = _setup(model, num_blocks=3, warmup_samples=1,
                                        concurrency_ceiling=4)
    _warm(controller.rates, profile.key, 4)
    first = controller.admit(profile, AdmissionRequest("a", 10, 4)).grant  # 1 block
    cache = make_cache(model, NATIVE, pools=pools, grant=first)
    with installed(model):
        _run(model, first, cache, prompt_tokens(10).tolist(), 10)  # 20 tokens: 2 blocks
        # re-priced when token 17 needed a second block: 17 tokens, 2 blocks per layer
        assert first.price.tokens == 17 and first.reserved_blocks == [2, 2]
        other = controller.admit(profile, AdmissionRequest("b", 10, 4)).grant  # the last block
        used = [p.num_used_blocks for p in pools]
        with pytest.raises(GrantExceeded) as info:
            _run(model, first, cache, [1] * 14, 1)  # to 34 tokens: a third block each
        assert isinstance(info.value.decision, Deferred)
        assert [p.num_used_blocks for p in pools] == used  # refused before allocating
        other.close()
    first.close()
    controller.retire_all()
    assert controller.committed_nbytes == controller.arena_nbytes


def test_a_grant_grows_a_growable_pool_only_after_pricing_the_new_arena():
    model = tiny_model("llama", mx.bfloat16)
    block = 2 * 16 * (64 + 64) * 2  # kv heads * block tokens * (Dk + Dv) * bf16
    controller, pools, profile = _setup(model, budget=2 * 4 * block + 2 * MiB, num_blocks=2,
                                        max_blocks=None)
    assert controller.arena_nbytes == 2 * 2 * block
    granted = controller.admit(profile, AdmissionRequest("a", 40, 8))  # 3 blocks: grow to 4
    assert isinstance(granted, Granted)
    assert [p.num_blocks for p in pools] == [4, 4]
    assert controller.committed_nbytes <= controller.budget_nbytes
    deferred = controller.admit(profile, AdmissionRequest("b", 40, 8))
    assert isinstance(deferred, Deferred)  # concurrency 1 for a key with no samples
    granted.grant.close()
    controller.retire_all()
    big = controller.admit(profile, AdmissionRequest("c", 200, 8))  # 14 blocks: 16 per layer
    assert isinstance(big, Refused) and big.shortfall_nbytes > 0
    assert [p.num_blocks for p in pools] == [4, 4]  # nothing grown for a refusal


# -- fences -------------------------------------------------------------------------------
def test_workspace_is_refunded_only_after_the_step_outputs_are_evaluated():
    model = tiny_model("llama", mx.bfloat16)
    controller, pools, profile = _setup(model)
    grant = controller.admit(profile, AdmissionRequest("r", 20, 4)).grant
    cache = make_cache(model, NATIVE, pools=pools, grant=grant)
    workspace = grant.price.workspace_nbytes
    with installed(model):
        with grant.step("prefill", 20) as step:
            logits = model(prompt_tokens(20)[None], cache=cache)
            step.fence(logits)  # never evaluated by anyone but the fence
    grant.close()  # the request is over; its step is not
    assert controller.stats()["charges"] == {"workspace": workspace}
    assert controller.committed_nbytes == controller.arena_nbytes + workspace
    assert step.retire() is True  # mx.eval(outputs), then the refund
    assert controller.committed_nbytes == controller.arena_nbytes
    assert step.retire() is False  # once


def test_cancellation_mid_step_refunds_exactly_once_and_leaves_other_grants_alone():
    model = tiny_model("llama", mx.bfloat16)
    controller, pools, profile = _setup(model, warmup_samples=1)
    _warm(controller.rates, profile.key, 3)
    keep = controller.admit(profile, AdmissionRequest("same-id", 20, 4)).grant
    kept_charges = controller.stats()["charges"]
    gone = controller.admit(profile, AdmissionRequest("same-id", 30, 4)).grant  # id reused
    assert keep is not gone and len(controller.grants("same-id")) == 2
    cache = make_cache(model, NATIVE, pools=pools, grant=gone)
    with installed(model), pytest.raises(RuntimeError):
        with gone.step("prefill", 30) as step:
            y = model(prompt_tokens(30)[None], cache=cache)
            step.fence(y)
            mx.async_eval(y)
            raise RuntimeError("cancelled mid-step")
    assert step.failed
    gone.cancel()
    gone.cancel()
    assert controller.committed_nbytes > controller.arena_nbytes + sum(kept_charges.values())
    assert controller.retire_all() == 1 and controller.retire_all() == 0 and not step.retire()
    assert controller.stats()["charges"] == kept_charges  # exactly the other grant's
    assert controller.grants("same-id") == [keep]
    assert [p.num_used_blocks for p in pools] == [0, 0]
    keep.close()
    stats = controller.stats()
    assert stats["charged"] == stats["refunded"] == 6
    assert controller.committed_nbytes == controller.arena_nbytes


def test_storage_is_refunded_when_the_caches_are_freed_or_dropped():
    model = tiny_model("llama", mx.bfloat16)
    controller, pools, profile = _setup(model, num_blocks=4, warmup_samples=1,
                                        concurrency_ceiling=4)
    _warm(controller.rates, profile.key, 4)
    first = controller.admit(profile, AdmissionRequest("a", 40, 8)).grant  # 3 of 4 blocks
    assert isinstance(controller.admit(profile, AdmissionRequest("b", 40, 8)), Deferred)
    cache = make_cache(model, NATIVE, pools=pools, grant=first)
    with installed(model):
        _run(model, first, cache, prompt_tokens(40).tolist(), 2)
    held = first.price.held_nbytes
    assert controller.stats()["charges"]["held"] == held
    for c in cache:
        c.free()
    assert "held" not in controller.stats()["charges"]  # the grant is still open
    assert not first.closed and first.reserved_blocks == [0, 0]
    second = controller.admit(profile, AdmissionRequest("b", 40, 8))
    assert isinstance(second, Granted)  # the freed blocks are admissible again
    other = make_cache(model, NATIVE, pools=pools, grant=second.grant)
    assert controller.stats()["charges"]["held"] == second.price.held_nbytes
    del other  # dropped without free(): the finalizer gives the blocks back, then this
    gc.collect()
    assert "held" not in controller.stats()["charges"]
    first.close()
    second.grant.close()
    controller.retire_all()
    stats = controller.stats()
    assert stats["charged"] == stats["refunded"]
    assert controller.committed_nbytes == controller.arena_nbytes


# -- execution-scoped concurrency -------------------------------------------------------------
def test_unknown_identities_start_at_one_and_widen_only_with_their_own_samples():
    model = tiny_model("llama", mx.bfloat16)
    rates = RateBook()
    controller, pools, native = _setup(model, rates=rates, warmup_samples=2,
                                       concurrency_ceiling=2)
    _, packed_pools, packed = _setup(model, PACKED, controller=controller)
    first = controller.admit(native, AdmissionRequest("a", 20, 3))
    assert isinstance(first, Granted)
    second = controller.admit(native, AdmissionRequest("b", 20, 3))
    assert isinstance(second, Deferred) and second.shortfall_nbytes == 0
    assert "concurrency" in second.reason
    assert isinstance(controller.admit(packed, AdmissionRequest("c", 20, 3)), Granted)
    _warm(rates, packed.key, 10)  # samples of another identity do not count
    assert isinstance(controller.admit(native, AdmissionRequest("b", 20, 3)), Deferred)
    cache = make_cache(model, NATIVE, pools=pools, grant=first.grant)
    with installed(model):
        _run(model, first.grant, cache, prompt_tokens(20).tolist(), 1)  # 1 prefill sample
        assert controller.concurrency_limit(native.key) == 1
        assert isinstance(controller.admit(native, AdmissionRequest("b", 20, 3)), Deferred)
        _run(model, first.grant, cache, [5], 2)  # +1 prefill, +1 decode
        assert controller.concurrency_limit(native.key) == 1  # 2 prefill, 1 decode samples
        _run(model, first.grant, cache, [6], 2)
    assert rates.samples(native.key, "prefill_tokens_per_s") >= 2
    assert rates.samples(native.key, "decode_tokens_per_s") >= 2
    assert controller.concurrency_limit(native.key) == 2
    assert isinstance(controller.admit(native, AdmissionRequest("b", 20, 3)), Granted)
    _warm(rates, native.key, 50)
    third = controller.admit(native, AdmissionRequest("d", 20, 3))
    assert isinstance(third, Deferred)  # the ceiling holds however many samples
    assert rates.samples(native.key, "ttft_s") >= 1


# -- deadlines ------------------------------------------------------------------------------
def test_deadline_refusals_carry_the_forecast_and_no_deadline_is_unchanged():
    model = tiny_model("llama", mx.bfloat16)
    clock = FakeClock()
    rates = RateBook()
    controller, pools, profile = _setup(model, rates=rates, clock=clock, warmup_samples=1)
    _warm(rates, profile.key, 3, prefill=100.0, decode=10.0)
    now = clock.now
    # own work: 50 / 100 + 20 / 10 = 2.5 s
    refused = controller.admit(profile, AdmissionRequest("a", 50, 20, deadline=now + 2.0))
    assert isinstance(refused, Refused) and refused.forecast == pytest.approx(now + 2.5)
    assert "deadline" in refused.reason and refused.shortfall_nbytes == 0
    met = controller.admit(profile, AdmissionRequest("a", 50, 20, deadline=now + 3.0))
    assert isinstance(met, Granted) and met.forecast == pytest.approx(now + 2.5)
    # Work in flight counts: "a" has 2.5 s left, so 2.5 + 2.5 = 5 s for the next one.
    late = controller.admit(profile, AdmissionRequest("b", 50, 20, deadline=now + 4.0))
    assert isinstance(late, Refused) and late.forecast == pytest.approx(now + 5.0)
    # A running step is retired first: its remaining time counts, its tokens are not
    # counted twice. A 50-token prefill (0.5 s) began 0.2 s ago: 0.3 s of it left.
    step = met.grant.step("prefill", 50)
    clock.now += 0.2
    late = controller.admit(profile, AdmissionRequest("b", 50, 20, deadline=now + 4.0))
    assert late.forecast == pytest.approx(clock.now + 0.3 + 2.0 + 2.5)
    step.fence(mx.zeros(1))
    step.retire()
    # Without a deadline: no forecast, the same decision as with no rates at all.
    plain = controller.admit(profile, AdmissionRequest("c", 50, 20))
    fresh, _, fresh_profile = _setup(model, clock=clock, warmup_samples=1)
    baseline = fresh.admit(fresh_profile, AdmissionRequest("c", 50, 20))
    assert type(plain) is type(baseline) is Granted and plain.forecast is None
    assert plain.price == baseline.price


def test_default_budget_is_configurable_on_cpu(monkeypatch):
    monkeypatch.setenv("KVSTORE_ADMISSION_BUDGET_NBYTES", str(123 * MiB))
    assert default_budget_nbytes() == 123 * MiB
    assert AdmissionController().budget_nbytes == 123 * MiB
    monkeypatch.delenv("KVSTORE_ADMISSION_BUDGET_NBYTES")
    if mx.default_device() == mx.cpu:
        assert default_budget_nbytes() == 1 << 30


# -- restore --------------------------------------------------------------------------------
def _published(tmp_path, model, tokens):
    store = Store(tmp_path / "s")
    cache = make_cache(model, NATIVE)
    with installed(model):
        mx.eval(model(mx.array([tokens]), cache=cache))
    publish(EngineModel(model, MODEL_ID, policy=NATIVE), store, tokens, cache)
    return store


def test_a_restore_that_would_not_fit_is_refused_before_allocation(tmp_path):
    model = tiny_model("llama", mx.bfloat16)
    tokens = prompt_tokens(200, seed=9).tolist()
    with _published(tmp_path, model, tokens) as store:
        controller, pools, _ = _setup(model, num_blocks=8)  # 13 blocks per layer needed
        before = ([p.num_blocks for p in pools], [p.num_used_blocks for p in pools])
        mx.eval(mx.zeros(1))
        active = mx.get_active_memory()
        served = EngineModel(model, MODEL_ID, policy=NATIVE, pools=pools, admission=controller)
        result = restore(served, store, RestoreRequest(tokens + [1], max_new_tokens=8,
                                                       request_id="r"))
        assert isinstance(result.decision, Refused) and not result.admitted
        assert result.cache is None and result.grant is None
        assert result.decision.price.restore_blocks == 13  # 12 full blocks and the partial one
        assert result.decision.price.staging_nbytes > 0
        assert ([p.num_blocks for p in pools], [p.num_used_blocks for p in pools]) == before
        assert mx.get_active_memory() <= active
        # "incompatible identity" is still decided first, also before allocation
        with pytest.raises(IncompatibleFormat):
            restore(EngineModel(model, MODEL_ID, policy=PACKED, pools=pools, admission=controller),
                    store, RestoreRequest(tokens))
        assert controller.committed_nbytes == controller.arena_nbytes


def test_a_restore_that_fits_is_granted_and_its_staging_refunded(tmp_path):
    model = tiny_model("llama", mx.bfloat16)
    tokens = prompt_tokens(100, seed=10).tolist()
    with _published(tmp_path, model, tokens) as store:
        controller, pools, _ = _setup(model, num_blocks=16)
        served = EngineModel(model, MODEL_ID, policy=NATIVE, pools=pools, admission=controller)
        result = restore(served, store, RestoreRequest(tokens + [3], max_new_tokens=4,
                                                       request_id="r"))
        assert isinstance(result.decision, Granted) and result.tokens_restored == 100
        grant = result.grant
        assert "staging" not in controller.stats()["charges"]  # refunded after the eval
        assert all(isinstance(c, AdmittedKVCache) for c in result.cache)
        assert [p.num_used_blocks for p in pools] == [7, 7]
        with installed(model):
            _run(model, grant, result.cache, [3], 4)
        grant.close()
        controller.retire_all()
        assert [p.num_used_blocks for p in pools] == [0, 0]
        assert controller.committed_nbytes == controller.arena_nbytes
        assert model_dtype(model) == mx.bfloat16


def test_a_remote_restore_is_priced_with_the_buffers_it_fetches_into(tmp_path):
    # Issue 17: RemoteStore over HTTP fetches every page into a buffer (maps_pages False),
    # a local Store maps them; the staging price must say so.
    from fastapi.testclient import TestClient

    from api.app import create_app
    from api.settings import Settings
    from engine.pricing import restore_staging_nbytes
    from kvstore.client import RemoteStore

    model = tiny_model("llama", mx.bfloat16)
    tokens = prompt_tokens(100, seed=11).tolist()
    with _published(tmp_path, model, tokens) as store:
        app = create_app(store=store, settings=Settings(data_dir=store.path))
        with TestClient(app) as client:
            remote = RemoteStore("http://testserver", None, client=client)
            prices = {}
            for name, source in (("local", store), ("remote", remote)):
                controller, pools, profile = _setup(model, num_blocks=16)
                served = EngineModel(model, MODEL_ID, policy=NATIVE, pools=pools,
                                     admission=controller)
                result = restore(served, source, RestoreRequest(tokens + [3], max_new_tokens=4,
                                                                request_id=name))
                assert isinstance(result.decision, Granted) and result.tokens_restored == 100
                prices[name] = result.decision.price
                result.grant.close()
                controller.retire_all()
    assert (store.maps_pages, remote.maps_pages) == (True, False)
    assert prices["local"].restore_blocks == prices["remote"].restore_blocks == 7
    assert prices["local"].staging_nbytes == restore_staging_nbytes(profile, 7, remote=False)
    assert prices["remote"].staging_nbytes == restore_staging_nbytes(profile, 7, remote=True)
    assert prices["remote"].staging_nbytes > prices["local"].staging_nbytes

"""Admission: physical-byte budgets, guaranteed workspace, completion fences, deadlines.

Nouns:
  AdmissionController  one process's byte budget and the ledger of what is committed
                       against it: the pool arenas it serves (read live from the
                       pools), and every open grant's held bytes, guaranteed workspace
                       and restore staging.
  AdmissionRequest     what a request asks for: prompt and generation tokens, an
                       optional absolute deadline, and the blocks a restore will stage.
  Decision             Granted (with a Grant), Deferred (may fit later) or Refused
                       (cannot fit, or cannot meet its deadline); Deferred and Refused
                       carry the reason and the shortfall in bytes. Returned, never
                       raised.
  Grant                the handle of one admitted request: its blocks reserved in each
                       pool, its charges, the caches it bound, its steps in flight.
                       Its storage is refunded once every bound cache is freed or
                       dropped (or at close(), which frees them).
  Step                 one forward pass of a grant; its workspace is fenced by the
                       step's outputs and only released once they are evaluated.

Accounting (all in physical bytes, engine/pricing.py computes every term):
  committed = bytes of the attached pool arenas (free blocks included: they are
              allocated) + held bytes of open grants (sliding rings, block tables,
              last logits) + guaranteed workspace of grants that are open or still
              have unfenced steps + restore staging not yet evaluated.
  Pages come out of the arenas: a grant reserves whole blocks per pool, and admission
  counts a pool's free blocks minus what other grants reserved and have not used yet,
  so a cache under a grant never meets PoolExhausted (that would be an accounting
  bug). A pool that must grow is grown when the grant is made, after its new arena
  (and the copy growth makes of the old one) was priced against the budget.

Fences: the Python call that builds a step returns long before MLX has computed it
(lazy graphs, mx.async_eval). A grant's workspace is refunded only when the grant is
closed and every step it began has been retired; Step.retire() evaluates the outputs
the step was fenced with (mx.eval), or synchronizes when the step failed or was
cancelled without outputs, and only then counts it done. Retiring twice, closing
twice, or closing while steps run refund each charge exactly once.

Rates (engine/rates.py) are recorded per ExecutionKey when steps retire. A key with
few samples of its own admits one request at a time. A request with a deadline is
refused, with the forecast, when the forecast completion (work in flight, what is
left of running steps, then its own prefill and decode at its key's rates) is later
than the deadline; without samples there is no forecast and concurrency 1 applies.
Without a deadline nothing of this runs.
"""

from __future__ import annotations

import itertools
import math
import os
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass, field

import mlx.core as mx

from engine.cache import PagedKVCache
from engine.errors import GrantExceeded, InvalidRequest
from engine.models import make_pools as _make_pools
from engine.pricing import (
    DEFAULT_PREFILL_STEP_TOKENS,
    DEFAULT_STEPS_IN_FLIGHT,
    ModelProfile,
    Price,
    price_request,
    profile_model,
)
from engine.rates import ExecutionKey, RateBook

BUDGET_ENV = "KVSTORE_ADMISSION_BUDGET_NBYTES"
DEFAULT_BUDGET_FRACTION = 0.7  # of the device's memory, where MLX reports it
DEFAULT_CPU_BUDGET_NBYTES = 1 << 30  # CPU: MLX reports no device memory; configure it
DEFAULT_WARMUP_SAMPLES = 3
DEFAULT_CONCURRENCY_CEILING = 8


def default_budget_nbytes(fraction: float = DEFAULT_BUDGET_FRACTION) -> int:
    """$KVSTORE_ADMISSION_BUDGET_NBYTES, else fraction of the GPU memory MLX reports
    (Metal's recommended working set, or the memory size), else the CPU default."""
    configured = os.environ.get(BUDGET_ENV)
    if configured:
        return int(configured)
    if mx.default_device() == mx.gpu:
        info = mx.device_info()
        memory = (info.get("max_recommended_working_set_size") or info.get("memory_size")
                  or info.get("total_memory"))
        if memory:
            return int(memory * fraction)
    return DEFAULT_CPU_BUDGET_NBYTES


# -- requests and decisions -------------------------------------------------------------
@dataclass(frozen=True)
class AdmissionRequest:
    request_id: str
    prompt_tokens: int
    max_new_tokens: int
    deadline: float | None = None  # absolute, on the controller's clock (time.time)
    restore_blocks: int = 0  # blocks per paged layer a restore will stage
    restored_tokens: int = 0  # prompt tokens the restore provides (not prefilled)
    restore_remote: bool = False  # pages are fetched into buffers (not mapped)


@dataclass(frozen=True)
class Granted:
    request_id: str
    price: Price
    grant: "Grant"
    forecast: float | None = None  # absolute forecast completion, when one was made
    granted = True


@dataclass(frozen=True)
class Deferred:
    """Does not fit now; may fit once other grants are released."""

    request_id: str
    price: Price
    reason: str
    shortfall_nbytes: int
    forecast: float | None = None
    granted = False


@dataclass(frozen=True)
class Refused:
    """Cannot be served: larger than the budget itself, or its deadline cannot be met."""

    request_id: str
    price: Price
    reason: str
    shortfall_nbytes: int
    forecast: float | None = None
    granted = False


Decision = Granted | Deferred | Refused


# -- the ledger -------------------------------------------------------------------------
class _Ledger:
    """Charges by id; each is refunded at most once."""

    def __init__(self):
        self._ids = itertools.count(1)
        self.open: dict[int, tuple[str, int]] = {}
        self.charged = 0
        self.refunded = 0

    def charge(self, category: str, nbytes: int) -> int:
        charge_id = next(self._ids)
        self.open[charge_id] = (category, nbytes)
        self.charged += 1
        return charge_id

    def refund(self, charge_id: int | None) -> bool:
        if charge_id is None or charge_id not in self.open:
            return False
        del self.open[charge_id]
        self.refunded += 1
        return True

    @property
    def nbytes(self) -> int:
        return sum(n for _, n in self.open.values())

    def by_category(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for category, n in self.open.values():
            out[category] = out.get(category, 0) + n
        return out


# -- steps and grants -------------------------------------------------------------------
class Step:
    """One forward pass of a grant. Use as a context manager around building the step,
    call fence(outputs) with the arrays whose evaluation completes it, and retire() when
    they are needed (or let the grant retire it). Leaving the `with` does not refund."""

    def __init__(self, grant: "Grant", kind: str, tokens: int, started: float):
        self.grant = grant
        self.kind = kind
        self.tokens = tokens
        self.started = started
        self.outputs = None
        self.failed = False
        self.retired = False

    def fence(self, outputs) -> None:
        self.outputs = outputs

    def retire(self) -> bool:
        """Evaluate the outputs (or synchronize after a failure), then count the step
        done. True the first time, False after."""
        return self.grant.controller._retire(self)

    def __enter__(self) -> "Step":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.failed = True


class Grant:
    """The handle of one admitted request (see the module docstring)."""

    def __init__(self, controller: "AdmissionController", serial: int, request: AdmissionRequest,
                 profile: ModelProfile, price: Price, created: float):
        self.controller = controller
        self.serial = serial
        self.request_id = request.request_id
        self.request = request
        self.profile = profile
        self.price = price
        self.created = created
        self.reserved_blocks: list[int] = list(price.blocks)  # per paged layer
        self.charges: dict[str, int | None] = {}
        self.steps: deque[Step] = deque()
        self.prefilled = 0
        self.decoded = 0
        self.closed = False
        self.storage_released = False
        self._caches: list[weakref.ref] = []

    def __repr__(self) -> str:
        return f"<Grant #{self.serial} {self.request_id!r} {self.price.tokens} tokens>"

    @property
    def key(self) -> ExecutionKey:
        return self.profile.key

    @property
    def prompt_to_compute(self) -> int:
        return max(0, self.request.prompt_tokens - self.request.restored_tokens)

    # -- caches ----------------------------------------------------------------------
    def new_cache(self, pool, **kwargs) -> "AdmittedKVCache":
        self.check_pool(pool)
        return AdmittedKVCache(pool, grant=self, **kwargs)

    def cache_from_pages(self, pool, pages, **kwargs) -> "AdmittedKVCache":
        """PagedKVCache.from_pages under this grant (the restore path)."""
        self.check_pool(pool)
        cache = AdmittedKVCache.from_pages(pool, pages, grant=self, **kwargs)
        self.bind([cache])
        return cache

    def check_pool(self, pool) -> None:
        if not any(pool is p for p in self.profile.pools):
            raise InvalidRequest("this pool is not one the grant was priced for")

    def bind(self, caches) -> None:
        """Caches whose blocks this grant pays for. close() frees them; once every one
        of them was freed (AdmittedKVCache.free) or dropped, the storage is refunded."""
        for cache in caches:
            if isinstance(cache, PagedKVCache):
                self.check_pool(cache.pool)
                if isinstance(cache, AdmittedKVCache):
                    cache.grant = self
                if not any(ref() is cache for ref in self._caches):
                    self._caches.append(weakref.ref(cache, self._cache_dropped))

    def _cache_dropped(self, ref) -> None:
        self.cache_freed()

    def cache_freed(self) -> None:
        """A bound cache was freed or dropped: with none of them holding storage any
        more, the storage goes back (blocks reserved, held bytes)."""
        if all(getattr(c, "freed", False) for c in self.caches()):
            self.controller._release_storage(self)

    def caches(self) -> list[PagedKVCache]:
        return [c for c in (ref() for ref in self._caches) if c is not None]

    def held_blocks(self, pool) -> int:
        return sum(len(c.block_ids) for c in self.caches() if c.pool is pool)

    def unused_reservation(self, pool) -> int:
        index = next(i for i, p in enumerate(self.profile.pools) if p is pool)
        return max(0, self.reserved_blocks[index] - self.held_blocks(pool))

    def before_allocate(self, cache: PagedKVCache, count: int, stop_tokens: int) -> None:
        """Called by AdmittedKVCache before it allocates `count` blocks: beyond the
        reservation, the growth is priced again (extend) or GrantExceeded is raised,
        before anything was allocated."""
        if self.closed:
            raise GrantExceeded("the grant was closed; its caches may not grow", None)
        index = next(i for i, p in enumerate(self.profile.pools) if p is cache.pool)
        if self.held_blocks(cache.pool) + count <= self.reserved_blocks[index]:
            return
        # Enough tokens that every paged layer gets the blocks this grant's caches hold
        # plus the new ones (several caches may share one grant: clones).
        size = cache.spec.block_size_tokens
        wanted = max(stop_tokens, (self.held_blocks(cache.pool) + count - 1) * size + 1)
        extra = max(1, wanted - self.price.tokens)
        decision = self.extend(extra)
        if not decision.granted or self.held_blocks(cache.pool) + count > self.reserved_blocks[index]:
            raise GrantExceeded(f"grant #{self.serial} ({self.request_id!r}) holds "
                                f"{self.reserved_blocks[index]} blocks per layer; growing to "
                                f"{stop_tokens} tokens was not admitted", decision)

    # -- growth, steps, release ------------------------------------------------------
    def extend(self, extra_new_tokens: int) -> Decision:
        """Price a longer generation before allocating it: Granted (this grant, larger)
        or Deferred/Refused (the grant unchanged)."""
        return self.controller._extend(self, extra_new_tokens)

    def step(self, kind: str, tokens: int) -> Step:
        """Begin a step ("prefill" or "decode") of `tokens` tokens. With
        steps_in_flight steps unfenced, the oldest is retired first."""
        return self.controller._begin_step(self, kind, tokens)

    def staging_done(self) -> None:
        """The restore's pages were evaluated into the pools: refund the staging."""
        self.controller._refund(self, "staging")

    def close(self) -> None:
        """Free the bound caches, refund storage and held bytes; the workspace follows
        once every step has been retired. Idempotent; cancel is the same."""
        self.controller._close(self)

    cancel = close


class AdmittedKVCache(PagedKVCache):
    """A PagedKVCache whose allocations are checked against its grant first."""

    def __init__(self, pool, *, grant: Grant | None = None, **kwargs):
        super().__init__(pool, **kwargs)
        self.grant = grant
        self.freed = False

    def free(self) -> None:
        super().free()
        self.freed = True
        if self.grant is not None:
            self.grant.cache_freed()

    def _make_writable(self, start: int, stop: int) -> None:
        self.freed = False
        if self.grant is not None:
            size = self.spec.block_size_tokens
            needed = max(0, math.ceil(stop / size) - len(self._blocks))
            shared = sum(1 for i in range(start // size, len(self._blocks))
                         if self.pool.refcount(self._blocks[i]) > 1)
            if needed + shared:
                self.grant.before_allocate(self, needed + shared, stop)
        super()._make_writable(start, stop)

    def clone(self) -> "AdmittedKVCache":
        other = super().clone()
        other.grant = self.grant
        if self.grant is not None:
            self.grant.bind([other])
        return other

    __copy__ = clone

    def __deepcopy__(self, memo) -> "AdmittedKVCache":
        return self.clone()


# -- the controller -----------------------------------------------------------------------
@dataclass
class _Pending:
    """What admitting a request would commit, computed under the lock."""

    dynamic_nbytes: int
    growth: list[tuple[object, int]] = field(default_factory=list)  # (pool, blocks to add)
    growth_nbytes: int = 0  # permanent arena bytes growth adds
    transient_nbytes: int = 0  # the largest old arena copied while growing
    block_shortfall_nbytes: int = 0  # blocks no growth can provide


class AdmissionController:
    def __init__(self, budget_nbytes: int | None = None, *, rates: RateBook | None = None,
                 warmup_samples: int = DEFAULT_WARMUP_SAMPLES,
                 concurrency_ceiling: int = DEFAULT_CONCURRENCY_CEILING,
                 steps_in_flight: int = DEFAULT_STEPS_IN_FLIGHT, clock=time.time):
        self.budget_nbytes = default_budget_nbytes() if budget_nbytes is None else int(budget_nbytes)
        self.rates = rates if rates is not None else RateBook()
        self.warmup_samples = warmup_samples
        self.concurrency_ceiling = concurrency_ceiling
        self.steps_in_flight = steps_in_flight
        self.clock = clock
        self._lock = threading.RLock()
        self._ledger = _Ledger()
        self._pools: list = []
        self._grants: dict[int, Grant] = {}  # open, or closed with steps still in flight
        self._serials = itertools.count(1)

    # -- pools and profiles ----------------------------------------------------------
    @property
    def arena_nbytes(self) -> int:
        return sum(pool.nbytes for pool in self._pools)

    @property
    def committed_nbytes(self) -> int:
        with self._lock:
            return self.arena_nbytes + self._ledger.nbytes

    @property
    def free_nbytes(self) -> int:
        return self.budget_nbytes - self.committed_nbytes

    def attach_pools(self, pools) -> None:
        """Serve these (already allocated) pools; their arenas count from now on.
        Raises InvalidRequest when they alone exceed the budget."""
        with self._lock:
            new = [p for p in pools if p is not None and not any(p is q for q in self._pools)]
            added = sum(p.nbytes for p in new)
            if self.committed_nbytes + added > self.budget_nbytes:
                raise InvalidRequest(f"pool arenas of {added} bytes exceed the admission budget "
                                     f"({self.free_nbytes} of {self.budget_nbytes} bytes free)")
            self._pools.extend(new)

    def make_pools(self, model, policy=None, *, num_blocks: int = 16,
                   max_blocks: int | None = None, growth: float = 2.0) -> list:
        """engine.make_pools, with the arenas priced against the budget before they are
        allocated (InvalidRequest when they do not fit), then attached."""
        from engine.formats import page_spec_for, resolve_format
        from engine.geometry import layer_geometry
        from engine.models import kv_dtype
        from engine.policy import KVPolicy

        policy = policy or KVPolicy()
        fmt = resolve_format(policy.default_format, kv_dtype(model))
        arenas = sum(num_blocks * page_spec_for(g, fmt, policy).block_nbytes
                     for g in layer_geometry(model) if g.kind == "full")
        with self._lock:
            if self.committed_nbytes + arenas > self.budget_nbytes:
                raise InvalidRequest(f"pool arenas of {arenas} bytes exceed the admission budget "
                                     f"({self.free_nbytes} of {self.budget_nbytes} bytes free)")
            pools = _make_pools(model, policy, num_blocks=num_blocks,
                                max_blocks=max_blocks, growth=growth)
            self.attach_pools(pools)
        return pools

    def profile(self, model, pools, *, model_fingerprint: str, attention_impl: str | None = "auto",
                prefill_step_tokens: int = DEFAULT_PREFILL_STEP_TOKENS) -> ModelProfile:
        for pool in pools:
            if pool is not None and not any(pool is p for p in self._pools):
                raise InvalidRequest("price requests only over pools attached to this controller")
        return profile_model(model, pools, model_fingerprint=model_fingerprint,
                             attention_impl=attention_impl, prefill_step_tokens=prefill_step_tokens)

    # -- admission -------------------------------------------------------------------
    def price(self, profile: ModelProfile, request: AdmissionRequest) -> Price:
        return price_request(profile, request.prompt_tokens, request.max_new_tokens,
                             restore_blocks=request.restore_blocks,
                             restore_remote=request.restore_remote,
                             restored_tokens=request.restored_tokens,
                             steps_in_flight=self.steps_in_flight)

    def concurrency_limit(self, key: ExecutionKey) -> int:
        return self.rates.concurrency_limit(key, warmup_samples=self.warmup_samples,
                                            ceiling=self.concurrency_ceiling)

    def grants(self, request_id: str | None = None) -> list[Grant]:
        with self._lock:
            return [g for g in self._grants.values()
                    if not g.closed and (request_id is None or g.request_id == request_id)]

    def admit(self, profile: ModelProfile, request: AdmissionRequest) -> Decision:
        """Granted, Deferred or Refused; nothing is allocated unless Granted."""
        for pool in profile.pools:
            if not any(pool is p for p in self._pools):
                raise InvalidRequest("the profile's pools are not attached to this controller")
        price = self.price(profile, request)
        rid = request.request_id
        with self._lock:
            idle = self._pending(profile, price, idle=True)
            idle_short = (idle.dynamic_nbytes + idle.growth_nbytes + idle.transient_nbytes
                          - (self.budget_nbytes - self.arena_nbytes))
            if idle.block_shortfall_nbytes or idle_short > 0:
                return Refused(rid, price, "larger than the budget even with nothing else admitted",
                               max(idle_short, 0) + idle.block_shortfall_nbytes)
            running = [g for g in self.grants() if g.key == profile.key]
            limit = self.concurrency_limit(profile.key)
            if len(running) >= limit:
                return Deferred(rid, price, f"execution identity at its concurrency limit "
                                f"({len(running)} of {limit}; it widens with samples)", 0)
            now = self._pending(profile, price, idle=False)
            short = (now.dynamic_nbytes + now.growth_nbytes + now.transient_nbytes
                     - self.free_nbytes)
            if now.block_shortfall_nbytes or short > 0:
                return Deferred(rid, price, "does not fit what is free now",
                                max(short, 0) + now.block_shortfall_nbytes)
            forecast = None
            if request.deadline is not None:
                forecast = self._forecast(profile, request)
                if forecast is not None and forecast > request.deadline:
                    return Refused(rid, price, f"forecast completion {forecast:.3f} is "
                                   f"{forecast - request.deadline:.3f} s after the deadline",
                                   0, forecast)
            self._grow(now)
            grant = Grant(self, next(self._serials), request, profile, price, self.clock())
            grant.charges = {
                "held": self._ledger.charge("held", price.held_nbytes),
                "workspace": self._ledger.charge("workspace", price.workspace_nbytes),
                "staging": self._ledger.charge("staging", price.staging_nbytes),
            }
            self._grants[grant.serial] = grant
            self._check_budget()
            return Granted(rid, price, grant, forecast)

    def _pending(self, profile: ModelProfile, price: Price, *, idle: bool,
                 grant: Grant | None = None) -> _Pending:
        """What granting `price` needs beyond the pools' blocks: dynamic bytes, growth.
        idle: as if nothing else were admitted. grant: an extension of that grant."""
        pending = _Pending(price.held_nbytes + price.workspace_nbytes + price.staging_nbytes)
        for index, (pool, need) in enumerate(zip(profile.pools, price.blocks, strict=True)):
            if grant is not None:
                need = max(0, need - grant.reserved_blocks[index])
            if idle:
                free = pool.num_blocks
            else:
                reserved = sum(g.unused_reservation(pool) for g in self.grants()
                               if any(pool is p for p in g.profile.pools))
                free = pool.num_free_blocks - reserved
            missing = need - free
            if missing <= 0:
                continue
            cap = pool.max_blocks if pool.max_blocks is not None else math.inf
            old = pool.num_blocks
            if old + missing > cap:
                pending.block_shortfall_nbytes += (old + missing - cap) * pool.block_nbytes
                continue
            new = int(min(cap, max(old + missing, math.ceil(old * pool.growth))))
            pending.growth.append((pool, pool.num_free_blocks + missing))
            pending.growth_nbytes += (new - old) * pool.block_nbytes
            pending.transient_nbytes = max(pending.transient_nbytes, old * pool.block_nbytes)
        return pending

    def _grow(self, pending: _Pending) -> None:
        """Grow pools to what a grant needs (priced already); the growth's copy is
        evaluated inside BlockPool.allocate, so it is over when this returns."""
        for pool, count in pending.growth:
            pool.decref(pool.allocate(count))

    def _check_budget(self) -> None:
        assert self.committed_nbytes <= self.budget_nbytes, (
            f"accounting bug: committed {self.committed_nbytes} > budget {self.budget_nbytes} "
            f"({self._ledger.by_category()}, arenas {self.arena_nbytes})")

    def _extend(self, grant: Grant, extra_new_tokens: int) -> Decision:
        request = grant.request
        longer = AdmissionRequest(request.request_id, request.prompt_tokens,
                                  request.max_new_tokens + extra_new_tokens, request.deadline,
                                  request.restore_blocks, request.restored_tokens,
                                  request.restore_remote)
        price = self.price(grant.profile, longer)
        rid = request.request_id
        with self._lock:
            if grant.closed:
                return Refused(rid, price, "the grant was closed", 0)
            old = grant.price
            held_now = 0 if grant.storage_released else old.held_nbytes
            delta = price.held_nbytes + price.workspace_nbytes - held_now - old.workspace_nbytes
            pending = self._pending(grant.profile, price, idle=False, grant=grant)
            pending.dynamic_nbytes = max(0, delta)
            short = (pending.dynamic_nbytes + pending.growth_nbytes + pending.transient_nbytes
                     - self.free_nbytes)
            if pending.block_shortfall_nbytes or short > 0:
                return Deferred(rid, price, "the longer generation does not fit what is free now",
                                max(short, 0) + pending.block_shortfall_nbytes)
            self._grow(pending)
            for name, nbytes in (("held", price.held_nbytes), ("workspace", price.workspace_nbytes)):
                self._ledger.refund(grant.charges.get(name))
                grant.charges[name] = self._ledger.charge(name, nbytes)
            grant.request, grant.price = longer, price
            grant.reserved_blocks = [max(a, b) for a, b in zip(grant.reserved_blocks, price.blocks, strict=True)]
            grant.storage_released = False
            self._check_budget()
            return Granted(rid, price, grant)

    # -- steps and fences --------------------------------------------------------------
    def _begin_step(self, grant: Grant, kind: str, tokens: int) -> Step:
        if kind not in ("prefill", "decode"):
            raise InvalidRequest(f"step kind must be 'prefill' or 'decode', got {kind!r}")
        if grant.closed:
            raise InvalidRequest(f"grant #{grant.serial} is closed")
        while len(grant.steps) >= self.steps_in_flight:
            grant.steps[0].retire()  # its workspace slot is needed again
        step = Step(grant, kind, tokens, self.clock())
        with self._lock:
            grant.steps.append(step)
        return step

    def _retire(self, step: Step) -> bool:
        if step.retired:
            return False
        error = None
        if step.outputs is not None and not step.failed:
            try:
                mx.eval(step.outputs)
            except Exception as exc:  # the step failed while computing
                step.failed, error = True, exc
        if step.outputs is None or step.failed:
            mx.synchronize()  # whatever the failed or cancelled step scheduled is done
        try:
            return self._count_retired(step)
        finally:
            if error is not None:
                raise error

    def _count_retired(self, step: Step) -> bool:
        with self._lock:
            if step.retired:
                return False
            step.retired = True
            grant = step.grant
            grant.steps.remove(step)
            if not step.failed:
                self._record(step)
            if grant.closed and not grant.steps:
                self._finish(grant)
            return True

    def _record(self, step: Step) -> None:
        grant, now = step.grant, self.clock()
        seconds = now - step.started
        if step.kind == "prefill":
            grant.prefilled += step.tokens
            self.rates.record(grant.key, "prefill_tokens_per_s", step.tokens, seconds)
            if grant.prefilled >= grant.prompt_to_compute and grant.decoded == 0:
                self.rates.record_value(grant.key, "ttft_s", now - grant.created)
        else:
            grant.decoded += step.tokens
            self.rates.record(grant.key, "decode_tokens_per_s", step.tokens, seconds)

    def retire_all(self) -> int:
        """Fence every step in flight (oldest first); the number retired."""
        with self._lock:
            steps = [s for g in list(self._grants.values()) for s in list(g.steps)]
        return sum(step.retire() for step in sorted(steps, key=lambda s: s.started))

    def _refund(self, grant: Grant, name: str) -> bool:
        with self._lock:
            return self._ledger.refund(grant.charges.get(name))

    def _close(self, grant: Grant) -> None:
        with self._lock:
            if grant.closed:
                return
            grant.closed = True
            caches = grant.caches()
        for cache in caches:
            cache.free()
        with self._lock:
            self._release_storage(grant)
            self._ledger.refund(grant.charges.get("staging"))
            if not grant.steps:
                self._finish(grant)

    def _release_storage(self, grant: Grant) -> None:
        """The grant's caches are freed: its block reservation and held bytes go back
        (once; a later write under the grant is priced again by extend)."""
        with self._lock:
            if grant.storage_released:
                return
            grant.storage_released = True
            grant.reserved_blocks = [0] * len(grant.reserved_blocks)
            self._ledger.refund(grant.charges.get("held"))

    def _finish(self, grant: Grant) -> None:
        """Closed and fenced: the workspace goes back."""
        self._ledger.refund(grant.charges.get("workspace"))
        self._grants.pop(grant.serial, None)

    # -- forecasts -----------------------------------------------------------------------
    def _forecast(self, profile: ModelProfile, request: AdmissionRequest) -> float | None:
        """Absolute completion forecast: the running steps' remainder, the rest of the
        work in flight, then this request; None while a needed rate has no samples."""
        now = self.clock()
        own = self.rates.forecast_s(profile.key, max(0, request.prompt_tokens
                                                     - request.restored_tokens),
                                    request.max_new_tokens)
        if own is None:
            return None
        ahead = 0.0
        for grant in self.grants():
            flying = {"prefill": 0, "decode": 0}
            for step in grant.steps:
                flying[step.kind] += step.tokens
                expected = self.rates.forecast_s(
                    grant.key, step.tokens if step.kind == "prefill" else 0,
                    step.tokens if step.kind == "decode" else 0)
                if expected is None:
                    return None
                ahead += max(0.0, expected - (now - step.started))
            rest = self.rates.forecast_s(
                grant.key, max(0, grant.prompt_to_compute - grant.prefilled - flying["prefill"]),
                max(0, grant.request.max_new_tokens - grant.decoded - flying["decode"]))
            if rest is None:
                return None
            ahead += rest
        return now + ahead + own

    # -- introspection -------------------------------------------------------------------
    def stats(self) -> dict:
        with self._lock:
            return {"budget_nbytes": self.budget_nbytes, "committed_nbytes": self.committed_nbytes,
                    "arena_nbytes": self.arena_nbytes, "charges": self._ledger.by_category(),
                    "charged": self._ledger.charged, "refunded": self._ledger.refunded,
                    "open_grants": len(self.grants()), "grants_in_flight": len(self._grants)}


__all__ = ["AdmissionController", "AdmissionRequest", "AdmittedKVCache", "Decision", "Deferred",
           "Grant", "Granted", "Refused", "Step", "default_budget_nbytes"]

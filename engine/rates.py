"""Execution-scoped rates: measured throughputs keyed by what produced them.

An ExecutionKey names the model (fingerprint), the page format, the attention
implementation and the device. A rate measured under one key is never used for
another: native pages and packed pages, or CPU and GPU, learn separately.

Each metric keeps an exponentially weighted mean of (amount / seconds) and a sample
count. Metrics used so far: "prefill_tokens_per_s", "decode_tokens_per_s",
"restore_bytes_per_s" (keyed with the store kind as the device), "ttft_s".

decide_restore() compares restoring a prefix with recomputing it. A key with no
restore samples starts from a deliberately low prior (DEFAULT_RESTORE_BYTES_PER_S),
so early decisions lean to recompute only for prefixes whose bytes outweigh a prefill
we have measured; with no prefill samples there is nothing to compare and the engine
restores (which also measures the restore rate).

Admission (engine/admission.py) reads two more things from here: concurrency_limit()
(a key with fewer than `warmup_samples` samples of its own runs one request at a time;
each further `warmup_samples` samples admit one more, up to a ceiling) and forecast_s()
(seconds to prefill and decode some tokens at a key's rates; None while either rate
has no samples, because a rate learned under another key is never borrowed).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

DEFAULT_RESTORE_BYTES_PER_S = 100e6
EWMA_WEIGHT = 0.3


@dataclass(frozen=True)
class ExecutionKey:
    model: str
    page_format: str
    attention_impl: str
    device: str


@dataclass
class Rate:
    mean: float = 0.0
    samples: int = 0

    def add(self, value: float) -> None:
        self.mean = value if self.samples == 0 else (1 - EWMA_WEIGHT) * self.mean + EWMA_WEIGHT * value
        self.samples += 1


@dataclass(frozen=True)
class RestoreDecision:
    restore: bool
    restore_s: float
    recompute_s: float | None
    reason: str


class RateBook:
    def __init__(self):
        self._rates: dict[tuple[ExecutionKey, str], Rate] = {}
        self._lock = threading.Lock()

    def record(self, key: ExecutionKey, metric: str, amount: float, seconds: float) -> None:
        """Record `amount` units done in `seconds` (ignored when seconds <= 0)."""
        if seconds <= 0 or amount <= 0:
            return
        with self._lock:
            self._rates.setdefault((key, metric), Rate()).add(amount / seconds)

    def record_value(self, key: ExecutionKey, metric: str, value: float) -> None:
        with self._lock:
            self._rates.setdefault((key, metric), Rate()).add(value)

    def rate(self, key: ExecutionKey, metric: str) -> Rate | None:
        with self._lock:
            found = self._rates.get((key, metric))
            return Rate(found.mean, found.samples) if found else None

    def samples(self, key: ExecutionKey, metric: str) -> int:
        found = self.rate(key, metric)
        return found.samples if found else 0

    def concurrency_limit(self, key: ExecutionKey, *, warmup_samples: int, ceiling: int) -> int:
        """Requests of this key allowed at once: 1 until the key has warmup_samples
        prefill and decode samples of its own, then one more per warmup_samples, up to
        ceiling."""
        samples = min(self.samples(key, "prefill_tokens_per_s"),
                      self.samples(key, "decode_tokens_per_s"))
        return max(1, min(ceiling, 1 + samples // max(1, warmup_samples)))

    def forecast_s(self, key: ExecutionKey, prefill_tokens: int, decode_tokens: int) -> float | None:
        """Seconds to prefill then decode the given tokens at this key's own rates."""
        seconds = 0.0
        for metric, tokens in (("prefill_tokens_per_s", prefill_tokens),
                               ("decode_tokens_per_s", decode_tokens)):
            if tokens <= 0:
                continue
            rate = self.rate(key, metric)
            if rate is None or rate.mean <= 0:
                return None
            seconds += tokens / rate.mean
        return seconds

    def decide_restore(self, compute_key: ExecutionKey, restore_key: ExecutionKey,
                       tokens: int, nbytes: int) -> RestoreDecision:
        restore = self.rate(restore_key, "restore_bytes_per_s")
        restore_bps = restore.mean if restore else DEFAULT_RESTORE_BYTES_PER_S
        restore_s = nbytes / restore_bps
        prefill = self.rate(compute_key, "prefill_tokens_per_s")
        if prefill is None:
            return RestoreDecision(True, restore_s, None, "no prefill samples for this execution "
                                   "identity yet: restore, and learn")
        recompute_s = tokens / prefill.mean
        if restore_s <= recompute_s:
            return RestoreDecision(True, restore_s, recompute_s, "restoring is forecast faster")
        return RestoreDecision(False, restore_s, recompute_s, "recomputing is forecast faster")

    def snapshot(self) -> list[dict]:
        with self._lock:
            return [{**key.__dict__, "metric": metric, "mean": r.mean, "samples": r.samples}
                    for (key, metric), r in self._rates.items()]

"""Helpers the benchmark suites share: the machine line, interleaved timing, summary
numbers (median, min-max, ratio to a peer), markdown tables, and the raw memory-copy
bandwidth that bounds every byte-moving case.

Nouns: a *sample* is one timed call in seconds; a *case* is a named callable timed
`repeats` times, interleaved with the other cases of its run so that drift in the load
of a shared machine lands on all of them alike; the *peer* of a case is the alternative
a user would pick instead, measured in the same run.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable

import numpy as np


def machine_line() -> str:
    """One line naming the machine and its load average when the table was made.

    The load average is printed with every table because the machines this project
    runs on are shared: a table made under load 6 on 2 cores is not a quiet one."""
    one, five, fifteen = os.getloadavg()
    return (f"machine: {platform.machine()}, {os.cpu_count()} cores, {platform.system()} "
            f"{platform.release()}, python {platform.python_version()}; load average "
            f"{one:.2f} / {five:.2f} / {fifteen:.2f} (1/5/15 min) at {time.strftime('%Y-%m-%d %H:%M:%S %Z')}")


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def interleaved(cases: dict[str, Callable[[], object]], repeats: int) -> dict[str, list[float]]:
    """Seconds per sample of each case; each repetition runs every case once, in an order
    rotated by one each time, so no case always follows the same neighbour."""
    samples: dict[str, list[float]] = {name: [] for name in cases}
    order = list(cases.items())
    for rep in range(repeats):
        shift = rep % len(order)
        for name, fn in order[shift:] + order[:shift]:
            samples[name].append(timed(fn))
    return samples


def summary(values: list[float]) -> tuple[float, float, float]:
    """(median, min, max)."""
    return statistics.median(values), min(values), max(values)


def fmt_ms(values: list[float]) -> tuple[str, str]:
    """(median ms, "min-max" ms), with precision fitted to the size."""
    med, lo, hi = summary(values)
    digits = 2 if med < 0.01 else 1
    return f"{1e3 * med:.{digits}f}", f"{1e3 * lo:.{digits}f}-{1e3 * hi:.{digits}f}"


def ratio(peer_s: float, ours_s: float) -> str:
    """How many times faster ours is than the peer (medians): "2.31x"."""
    return f"{peer_s / ours_s:.2f}x" if ours_s > 0 else "-"


def markdown_table(header: list[str], rows: list[list[object]], align_right_from: int = 1) -> str:
    lines = ["| " + " | ".join(header) + " |",
             "|" + "|".join("---" if i < align_right_from else "---:" for i in range(len(header))) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def memcopy_bandwidth(nbytes: int = 64 << 20, repeats: int = 5) -> float:
    """Bytes per second of numpy copying `nbytes` between two preallocated buffers
    (counting the bytes copied once, not read + write): the physical limit for any
    restore that must land its bytes in fresh memory on this machine."""
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    best = statistics.median(timed(lambda: np.copyto(dst, src)) for _ in range(repeats))
    return nbytes / best

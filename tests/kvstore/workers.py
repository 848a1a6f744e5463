"""Subprocess entry points for crash, crash-point and concurrency tests (and issue 8's).

    python -m tests.kvstore.workers writer STORE LOG SEED [MAP_NBYTES]
        Save random prefixes until killed. After each save returns (it is durable then),
        append one JSON line {"ns", "tokens", "checkpoint"} to LOG and fsync it: the
        acknowledged-save log a crash test replays. About 30% of saves extend a prefix
        saved before, so blocks are shared and re-saves dedup.

    python -m tests.kvstore.workers crash-scenario STORE STEP SEED
        Set up a store (prefix A with a checkpoint, loose pages for GC), then set
        KVSTORE_CRASH_AT=STEP and run the operation that reaches it. Exits with
        faults.CRASH_EXIT_CODE when the crash point fires, 0 when it never did.

concurrent_worker() is a multiprocessing target (spawn start method).
"""

from __future__ import annotations

import json
import os
import random
import sys
import traceback

from tests.kvstore.factories import (
    gc_now,
    make_identity,
    make_store,
    restore_prefix,
    save_prefix,
)

IDENTITY = make_identity()
NAMESPACES = ("tenant-a", "tenant-b")


def random_prompt(rng: random.Random, history: list[tuple[str, list[int]]]) -> tuple[str, list[int]]:
    """A new prompt; ~30% extend an earlier one (shared blocks)."""
    if history and rng.random() < 0.3:
        ns, base = rng.choice(history)
        cut = rng.randrange(0, len(base) + 1)
        return ns, base[:cut] + [rng.randrange(50_000) for _ in range(rng.randrange(1, 10))]
    return rng.choice(NAMESPACES), [rng.randrange(50_000) for _ in range(rng.randrange(1, 30))]


def writer(store_dir: str, log_path: str, seed: int, map_nbytes: int = 64 * 1024) -> None:
    rng = random.Random(seed)
    history: list[tuple[str, list[int]]] = []
    store = make_store(store_dir, map_nbytes=map_nbytes)
    with open(log_path, "a") as log:
        for i in range(10**9):
            ns, tokens = random_prompt(rng, history)
            name = f"s{seed}-{i}" if rng.random() < 0.3 else None
            save_prefix(store, IDENTITY, ns, tokens, checkpoint=name)
            log.write(json.dumps({"ns": ns, "tokens": tokens, "checkpoint": name}) + "\n")
            log.flush()
            os.fsync(log.fileno())
            history.append((ns, tokens))


def read_log(log_path: str) -> list[dict]:
    """Acknowledged saves; a torn last line (killed mid-write) was never acknowledged."""
    entries = []
    if not os.path.exists(log_path):
        return entries
    with open(log_path) as f:
        for line in f:
            if not line.endswith("\n"):
                break
            entries.append(json.loads(line))
    return entries


def verify_acknowledged(store, entries: list[dict]) -> None:
    """Every acknowledged save restores in full and byte-identically (restore_prefix
    compares every page); every acknowledged checkpoint exists and names its tokens."""
    for e in entries:
        matched, _ = restore_prefix(store, IDENTITY, e["ns"], e["tokens"])
        assert matched == len(e["tokens"]), f"acknowledged save lost: {e} matched {matched}"
        if e["checkpoint"]:
            ckpt = store.get_checkpoint(e["ns"], e["checkpoint"])
            assert list(ckpt.tokens) == e["tokens"]


# -- crash points ------------------------------------------------------------------------
PREFIX_A = list(range(1, 14))
LOOSE_PAGES = 300  # more than one GC batch (kvstore.gc.BATCH = 256)


def prefix_b(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [100_000 + rng.randrange(100_000) for _ in range(13)]


def loose_pages(seed: int) -> dict:
    from kvstore.ids import page_digest
    rng = random.Random(seed ^ 0x5EED)
    pages = [rng.randbytes(300) for _ in range(LOOSE_PAGES)]
    return {page_digest(p): p for p in pages}


def crash_scenario(store_dir: str, step: str, seed: int) -> int:
    from kvstore import faults
    store = make_store(store_dir)
    save_prefix(store, IDENTITY, "ns", PREFIX_A, checkpoint="a")
    store.put_pages(loose_pages(seed))
    os.environ["KVSTORE_CRASH_AT"] = step
    if step.split(":")[0].startswith("gc_"):
        gc_now(store)
    else:
        save_prefix(store, IDENTITY, "ns", prefix_b(seed), checkpoint="b")
    assert faults.STEPS  # the crash point never fired
    return 0


# -- concurrency ---------------------------------------------------------------------------
def concurrent_worker(store_dir: str, seed: int, saves: int, map_nbytes: int, layers: int = 0) -> None:
    """Save and restore at once with other processes. Prompts come from a pool shared by
    every worker (same seed for the pool), so processes race on the same chain keys and
    pages. Raises (exit code 1) on any wrong byte or lost save."""
    try:
        identity = IDENTITY if not layers else big_identity(layers)
        pool_rng, rng = random.Random(1234), random.Random(seed)
        history: list[tuple[str, list[int]]] = []
        pool = []
        for _ in range(12):
            pool.append(random_prompt(pool_rng, pool))
        store = make_store(store_dir, map_nbytes=map_nbytes)
        mine = []
        for i in range(saves):
            ns, tokens = rng.choice(pool) if rng.random() < 0.5 else random_prompt(rng, history)
            save_prefix(store, identity, ns, tokens, checkpoint=f"w{seed}-{i}" if i % 5 == 0 else None)
            mine.append((ns, tokens))
            history.append((ns, tokens))
            for ns2, tokens2 in rng.sample(pool, 2):  # restore what others may have saved
                restore_prefix(store, identity, ns2, tokens2)
        for ns, tokens in mine:
            matched, _ = restore_prefix(store, identity, ns, tokens)
            assert matched == len(tokens), f"own save lost: {ns} {tokens}"
        store.close()
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)


def big_identity(num_layers: int):
    """8 KV heads x head dim 128 bf16 layers: 16 KiB pages per 4-token block."""
    from tests.kvstore.factories import make_layer
    return make_identity(layers=(make_layer(kv_heads=8, k_head_dim=128, v_head_dim=128),) * num_layers)


def main(argv: list[str]) -> int:
    command, args = argv[0], argv[1:]
    if command == "writer":
        writer(args[0], args[1], int(args[2]), *(int(a) for a in args[3:]))
        return 0
    if command == "crash-scenario":
        return crash_scenario(args[0], args[1], int(args[2]))
    raise SystemExit(f"unknown command {command!r}")


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

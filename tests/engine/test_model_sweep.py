"""Every model type in the installed mlx_lm.models: publish, restore, decode, compare.

Per type (a tiny random float32 config from tests/engine/model_configs.py; MoE types
need float32 on CPU, where MLX's expert kernel refuses bf16):
  stock        mlx-lm's caches: prefill PROMPT-1 tokens, publish them with a checkpoint,
               continue (the recompute), restore into fresh stock caches, continue the
               same way; tokens and logits must be equal (tolerance 0).
  paged        the same through the engine's paged caches with native pages, and the
               continuation must also equal the stock one exactly (tolerance 0).
  k4v4         the same with k4v4 pages: restore equals k4v4 computed from scratch
               exactly (it is not compared with native; quantization changes logits).
Paged cases run where the model has a full-attention layer; its attention is "routed"
(the paged router attends) or "gathered" (engine.models.check_paged_attention failed:
the model's own attention over the decoded history).

A type that cannot be served is listed in UNSERVED with its reason (and in
docs/engine.md); test_every_type_is_swept_or_listed fails for a type in neither, so a new
mlx-lm release fails here until its types are handled or listed.

Cost: about 45 s for the whole file on 2 cores, 0.4 s per type (a 21-token prompt, 8
decoded tokens, blocks of 8; one model per type shared by its three cases; no config
above ~3.3M parameters). It fits the budget, so the full sweep is the default run (no
KVSTORE_SOAK subset). `python -m tests.engine.test_model_sweep` prints the
supported-models table of docs/engine.md.
"""

from __future__ import annotations

import importlib
import math
import sys
from dataclasses import dataclass, field

import mlx.core as mx
import pytest

from engine.attention import installed
from engine.engine_model import EngineModel
from engine.errors import UnsupportedModel
from engine.policy import KVPolicy
from engine.publish import publish
from engine.restore import RestoreRequest, restore
from kvstore.store import Store
from tests.engine.model_configs import model_types, tiny_config

PROMPT_TOKENS = 21  # crosses two blocks of BLOCK_TOKENS and several sliding windows of 8
DECODE_TOKENS = 8
BLOCK_TOKENS = 8
VOCAB = 97

# Types the engine does not serve, and why. Each one is checked to fail as described
# (test_unserved_types_still_fail), so a fixed one shows up.
UNSERVED: dict[str, str] = {
    "olmo": "mlx-lm's olmo needs the ai2-olmo package (not a dependency)",
    "bitnet": "its BitLinear layers run a Metal kernel; no CPU path to test on",
    "deepseek_v41": "builds its own LayerCache class (mlx_lm.models.deepseek_v41), which the "
                    "engine refuses by name rather than guess how to store",
    "prism_hadamard_qwen35": "loads only 2-bit Hadamard weight packs; no random-weight model",
    "muse_spark": "its forward runs a Metal kernel (mlx_lm.kernels); no CPU path to test on",
    "phi3small": "aborts the process on CPU (heap corruption inside MLX during mlx-lm's own "
                 "forward, after the paged check ran); not run, so not checked either",
}
# Listed types that take the process down: never run, not even to see them fail.
CRASHES = frozenset({"phi3small"})


@dataclass
class Row:
    model_type: str
    kinds: str = ""
    attention: str = "-"  # routed | gathered | - (no paged layer)
    stock: str = "-"
    paged: str = "-"
    k4v4: str = "-"
    notes: list[str] = field(default_factory=list)

    def line(self) -> str:
        return (f"{self.model_type:22s} {self.kinds:18s} attention={self.attention:8s} "
                f"stock={self.stock:5s} paged={self.paged:5s} k4v4={self.k4v4:5s} "
                f"{'; '.join(self.notes)}")


def build(model_type: str):
    module = importlib.import_module(f"mlx_lm.models.{model_type}")
    mx.random.seed(0)
    model = module.Model(module.ModelArgs.from_dict(tiny_config(model_type)))
    mx.eval(model.parameters())
    return model


def _continue(model, cache, tokens, steps):
    """Feed tokens, then decode greedily: (tokens, last-position logits per step)."""
    out, logits_seen = [], []
    inputs = mx.array([tokens], dtype=mx.int32)
    for _ in range(steps):
        logits = model(inputs, cache=cache)[:, -1, :]
        mx.eval(logits)
        token = int(mx.argmax(logits, axis=-1).item())
        out.append(token)
        logits_seen.append(logits)
        inputs = mx.array([[token]], dtype=mx.int32)
    return out, logits_seen


def _equal(a, b) -> bool:
    return a[0] == b[0] and all(mx.array_equal(x, y).item() for x, y in zip(a[1], b[1]))


def _case(model, store, policy: KVPolicy, cache_kind: str, model_id: str, prompt):
    """(recompute, restored) continuations, and the engine model."""
    engine_model = EngineModel(model, model_id, policy=policy)
    head = prompt[:-1]
    caches = engine_model.make_cache() if cache_kind == "paged" else engine_model.make_stock_cache()
    mx.eval(model(mx.array([head], dtype=mx.int32), cache=caches))
    publish(engine_model, store, head, caches, checkpoint=f"sweep-{cache_kind}")
    want = _continue(model, caches, prompt[-1:], DECODE_TOKENS)
    restored = restore(engine_model, store, RestoreRequest(prompt, cache_kind=cache_kind))
    assert restored.tokens_restored == len(head), (
        f"{model_id}: restored {restored.tokens_restored} of {len(head)} tokens")
    got = _continue(model, restored.cache, prompt[-1:], DECODE_TOKENS)
    return want, got, engine_model


def _group_size(engine_model: EngineModel) -> int:
    dims = [d for g in engine_model.geometry if g.kind == "full"
            for d in (g.k_head_dim, g.v_head_dim)]
    return min(32, math.gcd(*dims))


def sweep_one(model_type: str, store) -> Row:
    """Every case of the module docstring for one type; assertion errors say which."""
    row = Row(model_type)
    model = build(model_type)
    prompt = [(7 * i + 3) % VOCAB for i in range(PROMPT_TOKENS)]
    native = KVPolicy(block_size_tokens=BLOCK_TOKENS)
    with installed(model):
        stock_want, stock_got, engine_model = _case(model, store, native, "kvcache",
                                                    f"sweep/{model_type}/stock", prompt)
        row.kinds = "".join({"full": "F", "sliding": "S", "state": "R"}[g.kind]
                            for g in engine_model.geometry)
        assert _equal(stock_want, stock_got), f"{model_type}: stock restore differs"
        row.stock = "exact"
        if not any(g.kind == "full" for g in engine_model.geometry):
            return row
        row.attention = "routed" if engine_model.attention.routed else "gathered"
        if not engine_model.attention.routed:
            row.notes.append(engine_model.attention.reason[:60])
        want, got, _ = _case(model, store, native, "paged", f"sweep/{model_type}/paged", prompt)
        assert _equal(want, got), f"{model_type}: paged native restore differs"
        assert _equal(want, stock_want), f"{model_type}: paged native differs from stock caches"
        row.paged = "exact"
        group = _group_size(engine_model)
        packed = KVPolicy(default_format="k4v4", block_size_tokens=BLOCK_TOKENS, group_size=group)
        want, got, _ = _case(model, store, packed, "paged", f"sweep/{model_type}/k4v4", prompt)
        assert _equal(want, got), f"{model_type}: paged k4v4 restore differs"
        row.k4v4 = "exact"
    return row


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    with Store(str(tmp_path_factory.mktemp("sweep") / "store")) as opened:
        yield opened


SERVED = [t for t in model_types() if t not in UNSERVED]


@pytest.mark.parametrize("model_type", SERVED)
def test_model_type_restores_exactly(model_type, store):
    print("\n" + sweep_one(model_type, store).line())


def test_every_type_is_swept_or_listed():
    listed = set(UNSERVED)
    assert listed <= set(model_types()), f"UNSERVED names types mlx-lm no longer has: " \
                                          f"{sorted(listed - set(model_types()))}"
    assert len(SERVED) + len(UNSERVED) == len(model_types())


@pytest.mark.parametrize("model_type", sorted(set(UNSERVED) - CRASHES))
def test_unserved_types_still_fail(model_type, store):
    """A listed type that starts working fails here, so the list stays true."""
    # olmo's module exits the interpreter (SystemExit) when ai2-olmo is missing
    with pytest.raises((UnsupportedModel, Exception, SystemExit)) as raised:
        sweep_one(model_type, store)
    assert not isinstance(raised.value, AssertionError), raised.value  # a wrong result


def test_cachelist_sub_caches_are_layers_of_their_own(store):
    """falcon_h1 keeps CacheList(ArraysCache, KVCache) per layer: its KVCaches are paged
    layers (pages in every block record), its ArraysCaches checkpoint attachments, and a
    paged restore puts both back into the model's CacheLists."""
    model = build("falcon_h1")
    engine_model = EngineModel(model, "sweep/cachelist/falcon_h1",
                               policy=KVPolicy(block_size_tokens=BLOCK_TOKENS))
    assert [layer.paged for layer in engine_model.identity.layers] == [False, True, False, True]
    prompt = [(7 * i + 3) % VOCAB for i in range(PROMPT_TOKENS)]
    head = prompt[:-1]
    with installed(model):
        caches = engine_model.make_cache()
        assert [[type(c).__name__ for c in cache.caches] for cache in caches] == [
            ["ArraysCache", "PagedKVCache"]] * 2
        mx.eval(model(mx.array([head], dtype=mx.int32), cache=caches))
        publish(engine_model, store, head, caches, checkpoint="cachelist")
        want = _continue(model, caches, prompt[-1:], DECODE_TOKENS)
        ckpt = store.get_checkpoint("default", "cachelist")
        assert sorted(ckpt.attachments) == ["layer.0", "layer.2"]
        assert [len(b.pages) for b in store.get_blocks(ckpt.chain_keys)] == [2] * len(ckpt.chain_keys)
        restored = restore(engine_model, store, RestoreRequest(prompt, cache_kind="paged"))
        assert restored.tokens_restored == len(head)
        assert [[type(c).__name__ for c in cache.caches] for cache in restored.cache] == [
            ["ArraysCache", "PagedKVCache"]] * 2
        assert _equal(want, _continue(model, restored.cache, prompt[-1:], DECODE_TOKENS))


def test_a_restored_cachelist_round_trips_through_mlx_lm_prompt_cache_files(store, tmp_path):
    """A CacheList restored into stock caches holds mlx-lm's own classes, so mlx-lm's
    save_prompt_cache / load_prompt_cache (which look sub-caches up by class name in
    mlx_lm.models.cache) take it, and the loaded cache continues like recompute."""
    from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

    from engine.stock import to_mlx_lm

    model = build("falcon_h1")
    engine_model = EngineModel(model, "sweep/cachelist/falcon_h1/stock",
                               policy=KVPolicy(block_size_tokens=BLOCK_TOKENS))
    prompt = [(5 * i + 2) % VOCAB for i in range(PROMPT_TOKENS)]
    caches = engine_model.make_stock_cache()
    mx.eval(model(mx.array([prompt[:-1]], dtype=mx.int32), cache=caches))
    publish(engine_model, store, prompt[:-1], caches, checkpoint="cachelist-stock")
    want = _continue(model, caches, prompt[-1:], DECODE_TOKENS)
    restored = restore(engine_model, store, RestoreRequest(prompt, cache_kind="kvcache"))
    assert restored.tokens_restored == len(prompt) - 1
    save_prompt_cache(str(tmp_path / "prompt.safetensors"), to_mlx_lm(restored.cache))
    loaded = load_prompt_cache(str(tmp_path / "prompt.safetensors"))
    assert _equal(want, _continue(model, loaded, prompt[-1:], DECODE_TOKENS))


def test_a_kvcache_whose_arrays_the_model_touches_is_not_paged():
    """deepseek_v32 reads and sets its caches' keys itself (mx.depends, the indexer's
    zero values), which a PagedKVCache does not hold: every sub-cache is an attachment.
    longcat_flash only calls update_and_fetch: every sub-cache is paged."""
    from engine.geometry import probe_geometry

    assert {g.kind for g in probe_geometry(build("deepseek_v32")).layers} == {"state"}
    assert {g.kind for g in probe_geometry(build("longcat_flash")).layers} == {"full"}


def main(argv) -> None:
    """Print the supported-models table (markdown) of docs/engine.md."""
    import tempfile

    print("| type | layers | attention | stock | paged native | paged k4v4 |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp, Store(tmp + "/store") as opened:
        for model_type in (argv or model_types()):
            if model_type in UNSERVED:
                print(f"| {model_type} | - | not served: {UNSERVED[model_type]} | - | - | - |")
                continue
            try:
                row = sweep_one(model_type, opened)
            except Exception as exc:  # printed as the row, the test says the same
                print(f"| {model_type} | - | FAILED: {type(exc).__name__}: {str(exc)[:80]} "
                      "| - | - | - |")
                continue
            print(f"| {row.model_type} | {row.kinds} | {row.attention} | {row.stock} | "
                  f"{row.paged} | {row.k4v4} |")


if __name__ == "__main__":
    main(sys.argv[1:])

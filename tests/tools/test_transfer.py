"""export / import: byte-identical round trips, refusals that write nothing, mlx-lm files."""

from __future__ import annotations

import json
import struct
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.numpy import load_file, save_file

from kvstore.records import Checkpoint
from kvstore.store import Store
from tests.kvstore.factories import make_identity, make_layer, save_prefix
from tests.tools.helpers import IDENTITY, build_store, run
from tools.commands.common import EXIT_INCOMPATIBLE, EXIT_OK
from tools.portable import export_checkpoint, import_export, read_export


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    root = tmp_path_factory.mktemp("transfer")
    saved = build_store(root / "store")
    out = root / "system-prompt.safetensors"
    assert run("export", "default/system-prompt", out, "-d", root / "store").code == EXIT_OK
    return root / "store", saved, out


def store_is_empty(path) -> bool:
    if not (path / "data.mdb").exists():
        return True
    with Store(path) as store:
        s = store.stats()
    return (s.page_count, s.block_count, s.checkpoint_count, s.format_count) == (0, 0, 0, 0)


def test_round_trip_is_byte_identical(source, tmp_path):
    src, saved, first = source
    dst = tmp_path / "other"
    ran = run("import", first, "--json", "-d", dst)
    assert ran.code == EXIT_OK, ran.stderr
    distinct = {bytes(d) for r in saved["system-prompt"].records for d in r.pages}
    assert ran.json()["new_pages"] == ran.json()["pages"] == len(distinct)
    second = tmp_path / "again.safetensors"
    assert run("export", "system-prompt", second, "-d", dst).code == EXIT_OK
    assert first.read_bytes() == second.read_bytes()
    records = saved["system-prompt"].records
    digests = [d for r in records for d in r.pages]
    with Store(src) as a, Store(dst) as b:
        assert a.read_pages(digests) == b.read_pages(digests)
        assert a.get_checkpoint("default", "system-prompt").chain_keys == \
            b.get_checkpoint("default", "system-prompt").chain_keys
        match = b.lookup_prefix(IDENTITY.format_id, "default", list(range(40)))
        assert match.tokens_matched == 40
    assert run("check", "--read-data", "-d", dst).code == EXIT_OK
    again = run("import", first, "--replace", "--json", "-d", dst).json()
    assert again["new_pages"] == 0 and again["new_blocks"] == 0, "re-import must dedup"


def test_file_reads_with_plain_safetensors(source):
    _, saved, path = source
    tensors = load_file(str(path))
    records = saved["system-prompt"].records
    assert tensors["tokens"].tolist() == list(range(40))
    assert tensors["block_table"].shape == (10, 2, 32)
    assert bytes(tensors["block_table"][3, 1]) == bytes(records[3].pages[1])
    with Store(source[0]) as store:
        page = store.read_pages([records[3].pages[1]])[0]
    assert tensors["page/" + records[3].pages[1].hex()].tobytes() == page
    header_len = struct.unpack("<Q", path.read_bytes()[:8])[0]
    meta = json.loads(path.read_bytes()[8 : 8 + header_len])["__metadata__"]
    assert meta["kvstore.format_id"] == IDENTITY.format_id_hex
    assert json.loads(meta["kvstore.format_identity"]) == IDENTITY.to_dict()
    assert json.loads(meta["kvstore.manifest"])["name"] == "system-prompt"


def rewrite(src, dst, *, tensors=None, metadata=None):
    """Re-save an export with changed tensors or metadata through plain safetensors."""
    data = load_file(str(src))
    header_len = struct.unpack("<Q", src.read_bytes()[:8])[0]
    meta = json.loads(src.read_bytes()[8 : 8 + header_len])["__metadata__"]
    data.update(tensors or {})
    meta.update(metadata or {})
    save_file({k: v for k, v in data.items() if v is not None}, str(dst), metadata=meta)
    return dst


def damaged_files(path, saved, tmp):
    records = saved["system-prompt"].records
    name = "page/" + records[2].pages[0].hex()
    page = load_file(str(path))[name].copy()
    page[7] ^= 0x10
    identity = json.loads(rewrite_meta(path)["kvstore.format_identity"])
    identity["block_size_tokens"] = 8
    truncated = tmp / "truncated.safetensors"
    truncated.write_bytes(path.read_bytes()[:-100])
    return {
        "page bit flip": rewrite(path, tmp / "flip.safetensors", tensors={name: page}),
        "page missing": rewrite(path, tmp / "missing.safetensors", tensors={name: None}),
        "newer export version": rewrite(path, tmp / "v9.safetensors", metadata={"kvstore.export_version": "9"}),
        "identity not its id": rewrite(path, tmp / "ident.safetensors",
                                       metadata={"kvstore.format_identity": json.dumps(identity)}),
        "foreign file": _foreign(tmp / "foreign.safetensors"),
        "tokens edited": rewrite(path, tmp / "tokens.safetensors",
                                 tensors={"tokens": np.arange(1, 41, dtype=np.uint32)}),
        "truncated": truncated,
        "not safetensors": _text(tmp / "text.safetensors"),
    }


def rewrite_meta(path):
    header_len = struct.unpack("<Q", path.read_bytes()[:8])[0]
    return json.loads(path.read_bytes()[8 : 8 + header_len])["__metadata__"]


def _foreign(path):
    save_file({"weight": np.zeros(4, dtype=np.float32)}, str(path), metadata={"format": "pt"})
    return path


def _text(path):
    path.write_text("hello")
    return path


def test_import_refuses_corrupt_or_incompatible_files_and_writes_nothing(source, tmp_path):
    _, saved, path = source
    for label, bad in damaged_files(path, saved, tmp_path).items():
        dst = tmp_path / f"dst-{label.replace(' ', '-')}"
        ran = run("import", bad, "-d", dst)
        assert ran.code == EXIT_INCOMPATIBLE, (label, ran.code, ran.stderr)
        assert store_is_empty(dst), f"{label}: import wrote into the store"
        assert run("import", bad, "--verify-only", "-d", dst).code == EXIT_INCOMPATIBLE, label


def test_import_into_another_namespace_rechains(source, tmp_path):
    _, _, path = source
    dst = tmp_path / "ns"
    ran = run("import", path, "--namespace", "staging", "--name", "sp2", "--json", "-d", dst)
    assert ran.code == EXIT_OK and ran.json()["checkpoint"] == "staging/sp2"
    with Store(dst) as store:
        ckpt = store.get_checkpoint("staging", "sp2")
        assert store.lookup_prefix(IDENTITY.format_id, "staging", list(range(40))).tokens_matched == 40
        assert store.lookup_prefix(IDENTITY.format_id, "default", list(range(40))).tokens_matched == 0
        assert len(ckpt.chain_keys) == 10


def test_mlx_lm_export_loads_in_mlx_lm(source, tmp_path):
    mx = pytest.importorskip("mlx.core")
    from mlx_lm.models.cache import load_prompt_cache

    src, saved, _ = source
    out = tmp_path / "native.safetensors"
    ran = run("export", "native", out, "--mlx-lm", "--json", "-d", src)
    assert ran.code == EXIT_OK, ran.stderr
    caches, meta = load_prompt_cache(str(out), return_metadata=True)
    assert [type(c).__name__ for c in caches] == ["KVCache", "KVCache"]
    assert caches[0].offset == 10 and caches[1].keys.shape == (1, 2, 10, 32)
    # the K plane of block 0, layer 0 is the first half of its page, [heads, tokens, dim] bf16
    records = saved["native"].records
    with Store(src) as store:
        page = store.read_pages([records[0].pages[0]])[0]
    keys = np.array(caches[0].keys[0, :, :4, :].view(mx.uint16))
    assert keys.tobytes() == page[: 2 * 4 * 16 * 2]
    assert meta["kvstore_checkpoint"] == "default/native"


def test_mlx_lm_export_of_an_engine_checkpoint_equals_the_live_cache(tmp_path):
    """gemma3: full layers from pages, sliding-window layers from their attachments;
    what load_prompt_cache reads back equals the cache the model filled."""
    mx = pytest.importorskip("mlx.core")
    from mlx_lm.models.cache import load_prompt_cache

    from engine import EngineModel, KVPolicy, publish
    from tests.engine.factories import prompt_tokens, tiny_model

    model = tiny_model("gemma3_text", dtype=mx.bfloat16)
    tokens = prompt_tokens(300).tolist()
    caches = model.make_cache()
    model(mx.array(tokens)[None], cache=caches)
    mx.eval([c.state for c in caches])
    engine_model = EngineModel(model, "test/gemma3", policy=KVPolicy(block_size_tokens=64))
    with Store(tmp_path / "store") as store:
        publish(engine_model, store, tokens, caches, checkpoint="g")
    out = tmp_path / "g.safetensors"
    assert run("export", "g", out, "--mlx-lm", "-d", tmp_path / "store").code == EXIT_OK
    loaded = load_prompt_cache(str(out))
    kinds = [type(c).__name__ for c in caches]
    assert [type(c).__name__ for c in loaded] == kinds and "RotatingKVCache" in kinds
    for live, back in zip(caches, loaded, strict=True):
        for x, y in zip(live.state, back.state, strict=True):
            if not isinstance(x, mx.array):
                assert x == y
                continue
            if type(live).__name__ == "KVCache":  # live arrays are allocated in steps of 256
                x = x[..., : live.offset, :]
            assert x.shape == y.shape and mx.array_equal(x, y).item(), type(live).__name__
        assert getattr(live, "meta_state", None) == getattr(back, "meta_state", None)


# -- the portable file is a codec: round trip over generated checkpoints -----------------------
LAYER_CHOICES = [
    dict(page_format="native-bf16"),
    dict(page_format="native-f32", kv_heads=1, k_head_dim=8, v_head_dim=8),
    dict(page_format="k8v4", group_size=8, scale_dtype="float32", rotation="signed-hadamard:7"),
    dict(page_format="k4v4", group_size=16, scale_dtype="float32"),
]


@st.composite
def checkpoints(draw):
    layers = draw(st.lists(st.sampled_from(LAYER_CHOICES), min_size=1, max_size=3))
    identity = make_identity(layers=tuple(make_layer(**spec) for spec in layers),
                             block_size_tokens=draw(st.sampled_from([1, 4, 16])))
    tokens = draw(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=70))
    namespace = draw(st.sampled_from(["default", "team-a", "x.y_z-1"]))
    name = draw(st.from_regex(r"[a-z][a-z0-9._-]{0,20}", fullmatch=True))
    metadata = draw(st.dictionaries(st.text(max_size=8), st.integers() | st.text(max_size=8), max_size=3))
    return identity, tokens, namespace, name, metadata


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(checkpoints())
def test_portable_round_trip_over_generated_checkpoints(case):
    identity, tokens, namespace, name, metadata = case
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        with Store(tmp / "a") as store:
            saved = save_prefix(store, identity, namespace, tokens)
            store.create_checkpoint(Checkpoint(name, namespace, identity.format_id, tuple(tokens),
                                               saved.chain_keys, metadata=metadata))
            first = export_checkpoint(store, store.get_checkpoint(namespace, name), tmp / "1.st")
            digests = [d for r in saved.records for d in r.pages]
            pages = store.read_pages(digests)
        pf = read_export(tmp / "1.st")
        assert pf.checkpoint.metadata == metadata and pf.identity == identity
        with Store(tmp / "b") as store:
            import_export(store, pf)
            assert store.read_pages(digests) == pages
            export_checkpoint(store, store.get_checkpoint(namespace, name), tmp / "2.st")
        assert (tmp / "1.st").read_bytes() == (tmp / "2.st").read_bytes()
        assert first.nbytes == (tmp / "1.st").stat().st_size


def test_mlx_lm_export_of_a_quantized_kvcache_checkpoint_is_byte_for_byte(tmp_path):
    """mlx-qB pages come back as the QuantizedKVCache they were published from."""
    mx = pytest.importorskip("mlx.core")
    from mlx_lm.models.cache import QuantizedKVCache, load_prompt_cache

    from engine import EngineModel, KVPolicy, publish
    from tests.engine.factories import prompt_tokens, tiny_model

    model = tiny_model("llama", dtype=mx.bfloat16)
    tokens = prompt_tokens(100).tolist()
    caches = [QuantizedKVCache(group_size=32, bits=4) for _ in model.layers]
    mx.eval(model(mx.array(tokens)[None], cache=caches))
    policy = KVPolicy(default_format="mlx-q4", group_size=32, block_size_tokens=64)
    with Store(tmp_path / "store") as store:
        publish(EngineModel(model, "test/q4", policy=policy), store, tokens, caches,
                checkpoint="q")
    out = tmp_path / "q.safetensors"
    assert run("export", "q", out, "--mlx-lm", "-d", tmp_path / "store").code == EXIT_OK
    loaded = load_prompt_cache(str(out))
    assert [type(c) for c in loaded] == [QuantizedKVCache] * 2
    for live, back in zip(caches, loaded, strict=True):
        assert (back.offset, back.bits, back.group_size) == (100, 4, 32)
        for x, y in zip((*live.keys, *live.values), (*back.keys, *back.values), strict=True):
            x = x[..., :100, :]  # live arrays are allocated in steps of 256
            assert x.dtype == y.dtype and x.shape == y.shape and mx.array_equal(x, y).item()


USER_METADATA = {"owner": "ops", "prompt_version": 3, "tags": ["sys", "ünïcode"],
                 "nested": {"a": None, "b": 1.5}}


def _checkpoint_with_metadata(path: Path, identity, name: str) -> Checkpoint:
    with Store(path) as store:
        saved = save_prefix(store, identity, "default", list(range(12)))
        return store.create_checkpoint(Checkpoint(name, "default", identity.format_id,
                                                  tuple(range(12)), saved.chain_keys, {},
                                                  USER_METADATA))


def test_export_and_import_keep_the_checkpoints_user_metadata(tmp_path):
    """Issue 17: the portable file carries the metadata in its manifest, import stores
    them again, and a second export is byte-identical."""
    _checkpoint_with_metadata(tmp_path / "a", IDENTITY, "meta")
    first, second = tmp_path / "first.safetensors", tmp_path / "second.safetensors"
    assert run("export", "default/meta", first, "-d", tmp_path / "a").code == EXIT_OK
    assert read_export(first).checkpoint.metadata == USER_METADATA
    for namespace in (None, "elsewhere"):  # rechained into another namespace too
        args = ["--namespace", namespace] if namespace else []
        assert run("import", first, *args, "-d", tmp_path / "b").code == EXIT_OK
        with Store(tmp_path / "b") as store:
            assert store.get_checkpoint(namespace or "default", "meta").metadata == USER_METADATA
    shown = run("show", "default/meta", "--json", "-d", tmp_path / "b").json()
    assert shown["manifest"]["metadata"] == USER_METADATA
    assert run("export", "default/meta", second, "-d", tmp_path / "b").code == EXIT_OK
    assert first.read_bytes() == second.read_bytes()


def test_mlx_lm_export_keeps_the_checkpoints_user_metadata(tmp_path):
    pytest.importorskip("mlx.core")
    from mlx_lm.models.cache import load_prompt_cache

    native = make_identity(layers=(make_layer(), make_layer(k_head_dim=32)))
    _checkpoint_with_metadata(tmp_path / "a", native, "meta")
    out = tmp_path / "meta.safetensors"
    assert run("export", "default/meta", out, "--mlx-lm", "-d", tmp_path / "a").code == EXIT_OK
    _, meta = load_prompt_cache(str(out), return_metadata=True)
    assert json.loads(meta["kvstore_metadata"]) == USER_METADATA

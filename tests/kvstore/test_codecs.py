"""Round trips of every codec, strict parsing of client names, and the golden vectors
that docs/format.md lists (the test recomputes each one; the doc and this file must
carry the same literals)."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import blake3
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore.errors import InvalidInput
from kvstore.format import (
    FORMAT_DOMAIN_TAG,
    MLX_AFFINE_FORMATS,
    MLX_SCALE_DTYPES,
    PACKED_FORMATS,
    PAGE_FORMATS,
    FormatIdentity,
    LayerSpec,
)
from kvstore.ids import (
    CHAIN_DOMAIN_TAG,
    ROOT_KEY,
    ChainKey,
    PageDigest,
    chain_key,
    chain_keys,
    check_name,
    check_namespace,
    page_digest,
)
from kvstore.pages import (
    CODEC_RAW,
    CODEC_ZSTD,
    HEADER_NBYTES,
    Compression,
    PageHeader,
    accounted_nbytes,
    decode_stored,
    encode_page,
    verify_stored,
)
from kvstore.records import BlockRecord, Checkpoint

FORMAT_DOC = Path(__file__).resolve().parents[2] / "docs" / "format.md"
FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# -- strategies -----------------------------------------------------------------------------
digests = st.binary(min_size=32, max_size=32)
namespaces = st.from_regex(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,63}", fullmatch=True)
names = st.from_regex(r"[A-Za-z0-9_][A-Za-z0-9_.\-:@+]{0,127}", fullmatch=True)
token_ids = st.integers(0, 2**32 - 1)
short_text = st.text(max_size=40)


@st.composite
def layer_specs(draw):
    kind = draw(st.sampled_from(["full", "sliding", "state"]))
    page_format = draw(st.sampled_from(PAGE_FORMATS))
    if page_format in PACKED_FORMATS:
        group = draw(st.sampled_from([8, 16, 32, 64]))
        k_dim, v_dim = group * draw(st.integers(1, 4)), group * draw(st.integers(1, 4))
        return LayerSpec(kind, draw(st.integers(1, 16)), k_dim, v_dim, page_format, group, "float32",
                         draw(st.sampled_from(["none", "signed-hadamard:1", "signed-hadamard:99"])),
                         draw(st.integers(0, 4096)))
    if page_format in MLX_AFFINE_FORMATS:
        group = draw(st.sampled_from([32, 64, 128]))
        k_dim, v_dim = group * draw(st.integers(1, 4)), group * draw(st.integers(1, 4))
        return LayerSpec(kind, draw(st.integers(1, 16)), k_dim, v_dim, page_format, group,
                         draw(st.sampled_from(MLX_SCALE_DTYPES)), "none", draw(st.integers(0, 4096)))
    return LayerSpec(kind, draw(st.integers(0, 64)), draw(st.integers(0, 256)), draw(st.integers(0, 256)),
                     page_format, 0, "", "none", draw(st.integers(0, 4096)))


@st.composite
def identities(draw):
    return FormatIdentity(draw(short_text), draw(short_text), draw(st.integers(1, 65536)),
                          tuple(draw(st.lists(layer_specs(), min_size=1, max_size=6))),
                          draw(short_text))


# -- round trips -------------------------------------------------------------------------------
@FAST
@given(identities())
def test_format_identity_canonical_json_round_trips(identity):
    raw = identity.canonical()
    back = FormatIdentity.from_json(raw)
    assert back == identity
    assert back.canonical() == raw
    assert back.format_id == identity.format_id == blake3.blake3(FORMAT_DOMAIN_TAG + raw).digest()
    # canonical: sorted keys, no whitespace between tokens, ASCII only
    assert raw == json.dumps(json.loads(raw), sort_keys=True, separators=(",", ":")).encode()
    assert raw.isascii()
    assert raw == FormatIdentity.from_json(raw.decode()).canonical()


@FAST
@given(digests, namespaces, st.one_of(st.just(ROOT_KEY), digests),
       st.lists(token_ids, min_size=1, max_size=64), st.lists(digests, max_size=8),
       st.integers(0, 2**63), st.integers(0, 2**63))
def test_block_record_round_trips(fid, ns, parent, tokens, pages, created, used):
    record = BlockRecord(fid, ns, parent, tuple(tokens), tuple(pages), created, used)
    raw = record.encode()
    back = BlockRecord.decode(raw)
    assert back == record and back.key == record.key == chain_key(fid, ns, parent, tokens)
    assert (back.created_ns, back.last_used_ns) == (created, used)
    with pytest.raises(ValueError):
        BlockRecord.decode(raw + b"\x00")  # trailing bytes are refused


@FAST
@given(names, namespaces, digests, st.lists(token_ids, max_size=64), st.lists(digests, max_size=5),
       st.dictionaries(st.text(min_size=1, max_size=20), digests, max_size=4),
       st.dictionaries(st.text(max_size=10), st.one_of(st.integers(-2**53, 2**53), st.text(max_size=10),
                                                       st.booleans(), st.none()), max_size=4),
       st.integers(0, 2**63))
def test_checkpoint_round_trips(name, ns, fid, tokens, keys, attachments, metadata, created):
    ckpt = Checkpoint(name, ns, fid, tuple(tokens), tuple(keys), attachments, metadata, created)
    raw = ckpt.encode()
    back = Checkpoint.decode(raw)
    assert back == ckpt
    assert back.encode() == raw


@FAST
@given(st.sampled_from([CODEC_RAW, CODEC_ZSTD]), st.integers(0, 2**40), st.integers(0, 2**40),
       st.binary(min_size=16, max_size=16))
def test_page_header_round_trips(codec, raw_nbytes, stored_nbytes, xxh):
    if codec == CODEC_RAW:
        stored_nbytes = raw_nbytes
    header = PageHeader(codec, raw_nbytes, stored_nbytes, xxh)
    packed = header.pack()
    assert len(packed) == HEADER_NBYTES and packed[:4] == b"KVP1"
    assert PageHeader.unpack(packed) == header


@FAST
@given(st.one_of(st.binary(max_size=4096),
                 st.builds(lambda b, n: b * n, st.binary(min_size=1, max_size=8), st.integers(1, 2000))),
       st.sampled_from([0.0, 0.1, 0.5, 0.9]), st.booleans())
def test_encode_page_round_trips_and_picks_zstd_only_when_it_pays(raw, min_saving, enabled):
    policy = Compression(enabled=enabled, min_saving=min_saving)
    header_bytes, stored = encode_page(raw, policy)
    value = header_bytes + bytes(stored)
    header, body = verify_stored(value)
    assert bytes(decode_stored(header, body)) == raw
    assert accounted_nbytes(value) == (len(raw), len(value))
    if header.codec == CODEC_ZSTD:
        assert enabled and len(raw) >= 256
        assert len(stored) <= len(raw) * (1 - min_saving)
    else:
        assert bytes(stored) == raw


def test_zstd_choice_on_known_inputs():
    zeros, noise = bytes(1 << 20), blake3.blake3(b"noise").digest(length=1 << 20)
    assert PageHeader.unpack(encode_page(zeros, Compression())[0]).codec == CODEC_ZSTD
    assert PageHeader.unpack(encode_page(noise, Compression())[0]).codec == CODEC_RAW
    assert PageHeader.unpack(encode_page(zeros, Compression(enabled=False))[0]).codec == CODEC_RAW
    # half zeros, half noise saves ~50%: zstd under a 10% threshold, raw under a 60% one.
    # (Whether to try at all is decided on the first 64 KiB, here zeros.)
    half = zeros[: 1 << 19] + noise[: 1 << 19]
    assert PageHeader.unpack(encode_page(half, Compression(min_saving=0.1))[0]).codec == CODEC_ZSTD
    assert PageHeader.unpack(encode_page(half, Compression(min_saving=0.6))[0]).codec == CODEC_RAW


# -- strict parsing -------------------------------------------------------------------------------
GOOD_HEX = "ab" * 32
BAD_DIGESTS = [
    "", "ab" * 31, "ab" * 33, GOOD_HEX.upper(), "AB" + GOOD_HEX[2:], "../" + GOOD_HEX[3:],
    GOOD_HEX[:-1] + "\x00", GOOD_HEX[:-1] + "g", " " + GOOD_HEX[1:], GOOD_HEX + "\n",
    "0x" + GOOD_HEX[2:], GOOD_HEX[:-1] + "/", GOOD_HEX[:32] + "\u0660" * 32,  # Arabic-Indic digits
    "ab" * 16 + "/.." + "a" * 29, None, 12, b"\xab" * 32,
]


@pytest.mark.parametrize("text", BAD_DIGESTS, ids=lambda t: repr(t)[:30])
def test_digest_parsing_is_strict(text):
    for kind in (PageDigest, ChainKey):
        with pytest.raises(InvalidInput):
            kind.parse(text)


def test_digest_parse_and_display():
    d = PageDigest.parse(GOOD_HEX)
    assert bytes(d) == bytes.fromhex(GOOD_HEX) and str(d) == GOOD_HEX and d.short == GOOD_HEX[:12]
    assert PageDigest.coerce(bytes(d)) == d and PageDigest.coerce(GOOD_HEX) == d
    for raw in (b"", b"\x00" * 31, b"\x00" * 33):
        with pytest.raises(InvalidInput):
            PageDigest(raw)


@pytest.mark.parametrize("ns", ["", ".", "..", "../etc", "a/b", "a\\b", ".hidden", "-x", "a\x00b",
                                "a b", "x" * 65, "caf\u00e9", "a\nb", None, 7])
def test_bad_namespaces_are_refused(ns):
    with pytest.raises(InvalidInput):
        check_namespace(ns)


@pytest.mark.parametrize("name", ["", ".", "..", "../x", "a/b", ".x", "-x", "a\x00", "n" * 129,
                                  "a b", "\u0430bc", None])
def test_bad_checkpoint_names_are_refused(name):
    with pytest.raises(InvalidInput):
        check_name(name)


@FAST
@given(namespaces, names)
def test_good_names_pass_unchanged(ns, name):
    assert check_namespace(ns) == ns and check_name(name) == name


@pytest.mark.parametrize("tokens", [[-1], [2**32], [1.5], [[1, 2]], ["7"], [True]])
def test_bad_token_ids_are_refused(tokens):
    with pytest.raises(InvalidInput):
        chain_key(bytes(32), "ns", ROOT_KEY, tokens)


@pytest.mark.parametrize("tokens", [(-1,), (2**32,), (1.5,), (3, 2.0), ("7",), (True,), ()])
def test_a_block_record_refuses_what_is_not_a_token_id(tokens):
    """A float, a bool or a numeric string is refused, never truncated or parsed into a
    token id (BlockRecord made them int() before: (1.5,) became (1,), ("7",) became (7,);
    kvstore/wire.py block_from_json reads records from JSON, the HTTP client from a
    server's reply)."""
    with pytest.raises(InvalidInput):
        BlockRecord(bytes(32), "ns", ROOT_KEY, tokens, ())


def test_a_block_record_holds_python_ints_whatever_it_was_given():
    """Tokens as numpy integers (or the u32 array decode() hands over) come out as a tuple
    of Python ints, equal to and hashing like the record made from a plain tuple."""
    plain = BlockRecord(bytes(32), "ns", ROOT_KEY, (1, 2, 2**32 - 1), ())
    for value in (np.array([1, 2, 2**32 - 1], dtype=np.uint32), [np.int64(1), np.int64(2), 2**32 - 1]):
        record = BlockRecord(bytes(32), "ns", ROOT_KEY, value, ())
        assert record == plain and record.key == plain.key and hash(record) == hash(plain)
        assert all(type(t) is int for t in record.tokens)
    back = BlockRecord.decode(plain.encode())
    assert back == plain and all(type(t) is int for t in back.tokens)


# -- golden vectors (also in docs/format.md) ------------------------------------------------------
GOLDEN_PAGE_EMPTY = "af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262"
GOLDEN_PAGE_RANGE256 = "4a495ba42461748eca8fdad618f976aa726cc2903de9fcb40735a786ac1c196b"
GOLDEN_CHAIN_1 = "a61d3aa6717d63271703d9987a4833f7edd6fdb12e3659f769c06d4983937f31"
GOLDEN_CHAIN_2 = "e48080f4c9cb21a216f739853161c2eb0ac25607547b19da70d10fa376edd0bc"
GOLDEN_CHAIN_3 = "a5b097a6c0d328d58e34db0f7878a3dbf33aa3d5cc6e9fdb2a6713482e0b3a0d"
GOLDEN_FORMAT_ID = "97d50c3b2b1de55a89b0788c84ece1d46b5d76e113cdffe13860c8255c874666"
GOLDEN_FORMAT_JSON = (
    '{"block_size_tokens":256,"layers":[{"group_size":0,"k_head_dim":128,"kind":"full",'
    '"kv_heads":8,"page_format":"native-bf16","rotation":"none","scale_dtype":"","v_head_dim":128,'
    '"window":0},{"group_size":64,"k_head_dim":128,"kind":"full","kv_heads":8,"page_format":"k8v4",'
    '"rotation":"signed-hadamard:1234","scale_dtype":"float32","v_head_dim":128,"window":0}],'
    '"model_fingerprint":"0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",'
    '"model_id":"example/model-8b","schema_version":1,'
    '"tokenizer_fingerprint":"fedcba9876543210fedcba9876543210fedcba9876543210fedcba9876543210"}'
)
GOLDEN_BLOCK_RECORD = (  # docs/format.md section 8
    "01000000000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f0000000000000000"
    "00000000000000000000000000000000000000000000000000000000000003e800000000000007d000000004"
    "00000001000764656661756c7401000000020000000300000004000000af1349b9f5f9a1a6a0404dea36dcc9"
    "499bcb25c9adc112b7cc9a93cae41f3262"
)
GOLDEN_HEADER_RAW = (  # encode_page(bytes(range(256)), Compression(enabled=False))[0]
    "4b5650310000000000000000000001000000000000000100f1f8a93f50849ac39408a4433b952d710000000000000000"
)
GOLDEN_HEADER_STORED = (  # the same with the page's digest, as the store writes it
    "4b5650310000000000000000000001000000000000000100f1f8a93f50849ac39408a4433b952d714a495ba42461748e"
)
# docs/format.md section 7: an mlx-q4 page (1 KV head, 1 token, head dims 32, groups of 32,
# bfloat16 scales). K codes j % 16, scale 1, bias -8; V codes 15 - j % 16, scale 0.5, bias 0.25.
GOLDEN_MLX_Q4_PAGE = (
    "1032547698badcfe1032547698badcfe803f00c1efcdab8967452301efcdab8967452301003f803e"
)
GOLDEN_MLX_Q4_DIGEST = "1c7bedbc83e933a82d185d4b2fcf687e964ed32831e9f074eda702b5ca804259"


# Schema 2 (docs/format.md section 5): the same identity, and an mlx-q4 one converted at
# token 5000. The schema-1 vector above must keep its id: stores hold chains under it.
GOLDEN_FORMAT_ID_V2 = "8fe5d61efad02375a88fe18d1e44c181517de7b3b217b3d428d48b7e73c38d9b"
GOLDEN_FORMAT_ID_CONVERTED = "6b8a978f0b37e698b61508264ad2af50106ff6fa1251c44e6af79028cc236dc7"


def golden_identity(schema_version: int = 1) -> FormatIdentity:
    native = LayerSpec("full", 8, 128, 128, "native-bf16")
    packed = LayerSpec("full", 8, 128, 128, "k8v4", 64, "float32", "signed-hadamard:1234")
    return FormatIdentity("example/model-8b", "0123456789abcdef" * 4, 256, (native, packed),
                          tokenizer_fingerprint="fedcba9876543210" * 4,
                          schema_version=schema_version)


def spec_chain_key(format_id: bytes, namespace: str, parent: bytes, tokens: list[int]) -> str:
    """docs/format.md's definition, written out independently of kvstore.ids."""
    ns = namespace.encode("utf-8")
    message = (b"mlx-kvstore/chain/v1\x00" + format_id + struct.pack("<H", len(ns)) + ns + parent
               + struct.pack("<I", len(tokens)) + b"".join(struct.pack("<I", t) for t in tokens))
    return blake3.blake3(message).hexdigest()


def test_golden_page_digests():
    assert page_digest(b"").hex() == GOLDEN_PAGE_EMPTY
    assert page_digest(bytes(range(256))).hex() == GOLDEN_PAGE_RANGE256


def test_golden_chain_keys():
    fid = bytes(range(32))
    k1 = chain_key(fid, "default", ROOT_KEY, [1, 2, 3, 4])
    k2 = chain_key(fid, "default", k1, [5, 6, 7, 8])
    k3 = chain_key(bytes.fromhex(GOLDEN_FORMAT_ID), "tenant-a", ROOT_KEY, [0, 2**32 - 1])
    assert [k1.hex(), k2.hex(), k3.hex()] == [GOLDEN_CHAIN_1, GOLDEN_CHAIN_2, GOLDEN_CHAIN_3]
    assert spec_chain_key(fid, "default", ROOT_KEY, [1, 2, 3, 4]) == GOLDEN_CHAIN_1
    assert spec_chain_key(fid, "default", bytes(k1), [5, 6, 7, 8]) == GOLDEN_CHAIN_2
    assert chain_keys(fid, "default", list(range(1, 11)), 4) == [k1, k2]  # the tail gets no key
    assert CHAIN_DOMAIN_TAG == b"mlx-kvstore/chain/v1\x00"


def test_golden_format_id():
    identity = golden_identity()
    assert identity.canonical().decode() == GOLDEN_FORMAT_JSON
    assert identity.format_id_hex == GOLDEN_FORMAT_ID
    assert blake3.blake3(b"mlx-kvstore/format/v1\x00" + GOLDEN_FORMAT_JSON.encode()).hexdigest() == GOLDEN_FORMAT_ID


def test_golden_format_ids_of_schema_2():
    v2 = golden_identity(schema_version=2)
    assert v2.canonical().decode() == GOLDEN_FORMAT_JSON.replace(
        '{"block_size_tokens":256,', '{"block_size_tokens":256,"converted_at_token":0,').replace(
        '"schema_version":1', '"schema_version":2')
    assert v2.format_id_hex == GOLDEN_FORMAT_ID_V2
    q4 = LayerSpec("full", 8, 128, 128, "mlx-q4", 64, "bfloat16")
    converted = FormatIdentity("example/model-8b", "0123456789abcdef" * 4, 256, (q4, q4),
                               tokenizer_fingerprint="fedcba9876543210" * 4,
                               converted_at_token=5000)
    assert '"converted_at_token":5000' in converted.canonical().decode()
    assert converted.format_id_hex == GOLDEN_FORMAT_ID_CONVERTED
    assert blake3.blake3(b"mlx-kvstore/format/v1\x00" + converted.canonical()).hexdigest() \
        == GOLDEN_FORMAT_ID_CONVERTED


def test_golden_page_header():
    data = bytes(range(256))
    header, stored = encode_page(data, Compression(enabled=False))
    assert header.hex() == GOLDEN_HEADER_RAW and bytes(stored) == data
    header, _ = encode_page(data, Compression(enabled=False), page_digest(data))
    assert header.hex() == GOLDEN_HEADER_STORED


def test_golden_block_record():
    record = BlockRecord(bytes(range(32)), "default", ROOT_KEY, (1, 2, 3, 4), (page_digest(b""),), 1000, 2000)
    assert record.encode().hex() == GOLDEN_BLOCK_RECORD
    assert record.key.hex() == GOLDEN_CHAIN_1


def spec_mlx_codes(codes: list[int], bits: int) -> bytes:
    """docs/format.md's mlx-qB code packing, written out: code j of a row occupies bits
    j*B .. j*B+B-1 of the row's bit stream, bit i of the stream being bit i % 8 of byte
    i // 8 (the row's u32 words little-endian, least significant bit first)."""
    stream = 0
    for j, code in enumerate(codes):
        assert 0 <= code < 2**bits
        stream |= code << (j * bits)
    return stream.to_bytes(len(codes) * bits // 8, "little")


def test_golden_mlx_q4_page():
    layer = LayerSpec("full", 1, 32, 32, "mlx-q4", 32, "bfloat16")
    bf16 = {1.0: "803f", -8.0: "00c1", 0.5: "003f", 0.25: "803e"}  # u16le bit patterns
    page = (spec_mlx_codes([j % 16 for j in range(32)], 4) + bytes.fromhex(bf16[1.0] + bf16[-8.0])
            + spec_mlx_codes([15 - j % 16 for j in range(32)], 4)
            + bytes.fromhex(bf16[0.5] + bf16[0.25]))
    assert page.hex() == GOLDEN_MLX_Q4_PAGE
    assert layer.page_nbytes(1) == len(page) == 40
    assert page_digest(page).hex() == GOLDEN_MLX_Q4_DIGEST


@pytest.mark.parametrize("page_format,bits", sorted(MLX_AFFINE_FORMATS.items()))
@pytest.mark.parametrize("scale_dtype,scale_nbytes", [("bfloat16", 2), ("float16", 2), ("float32", 4)])
def test_mlx_affine_page_nbytes(page_format, bits, scale_dtype, scale_nbytes):
    layer = LayerSpec("full", 3, 128, 64, page_format, 32, scale_dtype)
    # per token and head: codes (128 + 64) * bits / 8 bytes, one scale and one bias per 32
    assert layer.page_nbytes(5) == 3 * 5 * ((128 + 64) * bits // 8 + 2 * scale_nbytes * (4 + 2))


@pytest.mark.parametrize("fields", [
    dict(page_format="mlx-q4", group_size=32, scale_dtype=""),          # scales need a dtype
    dict(page_format="mlx-q4", group_size=0, scale_dtype="bfloat16"),   # and groups
    dict(page_format="mlx-q4", group_size=24, scale_dtype="bfloat16"),  # that divide head dims
    dict(page_format="mlx-q8", group_size=32, scale_dtype="int8"),
    dict(page_format="k8v4", group_size=32, scale_dtype="bfloat16"),    # kXvY scales are FP32
    # 3-bit codes of a 16-wide head are 48 bits: not whole 32-bit words
    dict(page_format="mlx-q3", group_size=16, scale_dtype="float16", k_head_dim=16, v_head_dim=16),
])
def test_malformed_quantized_layers_are_refused(fields):
    with pytest.raises(InvalidInput):
        LayerSpec(**{"kind": "full", "kv_heads": 2, "k_head_dim": 64, "v_head_dim": 64, **fields})


def test_format_doc_lists_the_same_golden_vectors():
    text = FORMAT_DOC.read_text()
    for value in (GOLDEN_PAGE_EMPTY, GOLDEN_PAGE_RANGE256, GOLDEN_CHAIN_1, GOLDEN_CHAIN_2,
                  GOLDEN_CHAIN_3, GOLDEN_FORMAT_ID, GOLDEN_HEADER_RAW, GOLDEN_HEADER_STORED,
                  GOLDEN_BLOCK_RECORD, GOLDEN_MLX_Q4_PAGE, GOLDEN_MLX_Q4_DIGEST):
        assert value in text, f"docs/format.md lacks golden vector {value}"
    assert GOLDEN_FORMAT_JSON in re.sub(r"\s*\n\s*", "", text) or GOLDEN_FORMAT_JSON in text

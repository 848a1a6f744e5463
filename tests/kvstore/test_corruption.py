"""Damage one bit of one stored page inside the LMDB data file.

For a bit in every field of the page record (header fields and body), the contract is:
  - check(read_data=True) lists exactly that page, as page_damaged, and nothing else;
  - get_pages raises IntegrityError naming it and quarantines it;
  - the page is never returned again, and check then lists exactly that page, as
    page_quarantined (the block naming it lost its page);
  - re-publishing the page heals the store; GC clears the quarantine.
"""

from __future__ import annotations

import pytest

from kvstore.errors import IntegrityError
from kvstore.pages import CODEC_RAW, CODEC_ZSTD, HEADER_NBYTES, PageHeader
from tests.kvstore.factories import (
    assert_check_clean,
    assert_no_garbage,
    flip_bit,
    gc_now,
    header_field_bits,
    make_identity,
    make_store,
    plan_prefix,
    restore_prefix,
    save_prefix,
    stored_value,
)


def _tokens_with_both_codecs(n: int = 13) -> list[int]:
    """n tokens (three full blocks and a partial tail) whose pages include an all-zero
    one (stored zstd) and a random one (stored raw). Page bytes follow from the chain
    keys, so from the format id: found by search, not hard-coded to one identity."""
    identity = make_identity()
    for start in range(100, 100_000, n):
        tokens = list(range(start, start + n))
        _, payload = plan_prefix(identity, "ns", tokens)
        zeros = sum(1 for data in payload.values() if not any(data))
        if 0 < zeros < len(payload):
            return tokens
    raise AssertionError("no prefix with both a zero page and a random page")


TOKENS = _tokens_with_both_codecs()


def _page(store, saved, codec=CODEC_RAW):
    """A stored page of the given codec: random bytes (raw) or all zeros (zstd)."""
    for record in saved.records:
        for d in record.pages:
            value = stored_value(store, d)
            if PageHeader.unpack(value).codec == codec:
                return d, value
    raise AssertionError(f"no page with codec {codec}")


@pytest.mark.parametrize("codec", [CODEC_RAW, CODEC_ZSTD], ids=["raw", "zstd"])
@pytest.mark.parametrize("field,bit", sorted(header_field_bits().items()))
def test_one_flipped_bit_is_found_refused_and_quarantined(tmp_path, field, bit, codec):
    identity = make_identity()
    with make_store(tmp_path) as store:
        saved = save_prefix(store, identity, "ns", TOKENS)
        target, value = _page(store, saved, codec)
        others = [d for r in saved.records for d in r.pages if d != target]
    if field == "body":  # a bit in the middle of the stored body (zstd bodies are short)
        bit = 8 * (HEADER_NBYTES + (len(value) - HEADER_NBYTES) // 2) + 5
    flip_bit(tmp_path, value, bit)

    with make_store(tmp_path) as store:
        report = store.check(read_data=True)
        assert [(p.kind, p.object) for p in report.problems] == [("page_damaged", target.hex())]

        with pytest.raises(IntegrityError) as err:
            store.read_pages([target])
        assert err.value.digest == target.hex()
        assert target.hex() in str(err.value)
        with pytest.raises(IntegrityError):  # quarantined: never returned again
            with store.get_pages([target]):
                pass
        assert store.stats().quarantined_count == 1
        assert store.missing([target]) == [target]
        report = store.check(read_data=True)
        assert [(p.kind, p.object) for p in report.problems] == [("page_quarantined", target.hex())]
        # every other page still reads back intact
        assert len(store.read_pages(others)) == len(others)

        # re-publishing heals it: the page is uploaded again, GC drops the quarantined copy
        _, payload = plan_prefix(identity, "ns", TOKENS)
        store.put_pages({target: payload[target]})
        gc_now(store)
        assert_check_clean(store, read_data=True)
        assert_no_garbage(store)
        assert restore_prefix(store, identity, "ns", TOKENS)[0] == len(TOKENS)


def test_flip_is_refused_before_any_view_is_handed_out(tmp_path):
    """One damaged page among many: get_pages yields nothing, names the damaged one."""
    identity = make_identity()
    with make_store(tmp_path) as store:
        saved = save_prefix(store, identity, "ns", TOKENS)
        target, value = _page(store, saved)
        digests = [d for r in saved.records for d in r.pages]
    flip_bit(tmp_path, value, header_field_bits()["body"])
    with make_store(tmp_path) as store:
        entered = False
        with pytest.raises(IntegrityError) as err:
            with store.get_pages(digests):
                entered = True
        assert not entered
        assert err.value.digest == target.hex()

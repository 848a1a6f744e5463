"""kvstore/format.py schema 2: converted_at_token, and schema-1 identities still read."""

from __future__ import annotations

import json

import pytest

from kvstore.errors import InvalidInput
from kvstore.format import SCHEMA_VERSION, FormatIdentity, LayerSpec, diff

Q4 = LayerSpec("full", 2, 64, 64, "mlx-q4", 64, "bfloat16")
NATIVE = LayerSpec("full", 2, 64, 64, "native-bf16")


def _identity(layers=(Q4,), **kwargs) -> FormatIdentity:
    return FormatIdentity("m", "f" * 64, 16, layers, **kwargs)


def test_conversion_offset_names_another_format():
    zero, converted = _identity(), _identity(converted_at_token=32)
    assert SCHEMA_VERSION == 2 and zero.schema_version == 2
    assert zero.format_id != converted.format_id
    assert diff(zero, converted) == [("converted_at_token", 0, 32)]
    again = FormatIdentity.from_json(converted.canonical())
    assert again == converted and again.format_id == converted.format_id


def test_a_schema_1_identity_keeps_its_encoding_and_id():
    old = _identity(layers=(NATIVE,), schema_version=1)
    stored = old.canonical()
    assert b"converted_at_token" not in stored
    assert json.loads(stored)["schema_version"] == 1
    read = FormatIdentity.from_json(stored)
    assert read.format_id == old.format_id and read.converted_at_token == 0
    # an API body spelling out the default (0) is the same record
    spelled = {**json.loads(stored), "converted_at_token": 0}
    assert FormatIdentity.from_dict(spelled).format_id == old.format_id
    # and a schema-1 record is not the same format as today's
    assert _identity(layers=(NATIVE,)).format_id != old.format_id


@pytest.mark.parametrize("kwargs", [
    {"schema_version": 1, "converted_at_token": 32},   # schema 1 has no conversion
    {"layers": (NATIVE,), "converted_at_token": 32},   # only mlx-qB pages are converted
    {"converted_at_token": -1},
    {"converted_at_token": True},
    {"converted_at_token": 2**40},
])
def test_bad_conversion_offsets_are_refused(kwargs):
    with pytest.raises(InvalidInput):
        _identity(**kwargs)


def test_only_pages_that_cannot_be_converted_have_an_older_equivalent():
    native = _identity(layers=(NATIVE,))
    older = native.equivalent_older()
    assert older is not None and older.schema_version == 1
    assert (older.layers, older.model_id, older.block_size_tokens) == (
        native.layers, native.model_id, native.block_size_tokens)
    assert _identity().equivalent_older() is None  # mlx-q4: its history is unknown at schema 1
    assert _identity(converted_at_token=32).equivalent_older() is None
    assert older.equivalent_older() is None

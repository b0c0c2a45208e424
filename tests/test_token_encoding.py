"""Token ids are encoded as little-endian uint32, and a bool among them is refused, naming the
first one -- whatever else the prompt holds (zeros and ones, padding, entries whose bytes
look like a 0 or 1 across two entries)."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from statekv import UsageError
from statekv.hashing import MAX_TOKEN_ID, token_bytes

# Entries whose bytes hold a 0 or 1 pattern on or across entry boundaries, and plain ones.
_TRICKY = st.sampled_from([0, 1, 256, 65536, 16777216, 1 << 24 | 1, MAX_TOKEN_ID, 2, 255])
_TOKEN = st.one_of(_TRICKY, st.integers(0, MAX_TOKEN_ID))


@given(st.lists(_TOKEN, min_size=1, max_size=300))
def test_integers_encode_as_little_endian_uint32(tokens: list[int]) -> None:
    assert token_bytes(tokens) == struct.pack(f"<{len(tokens)}I", *tokens)
    assert token_bytes(tuple(tokens)) == token_bytes(tokens)


@given(st.lists(st.one_of(_TOKEN, st.booleans()), min_size=1, max_size=300))
def test_a_bool_anywhere_is_refused_naming_the_first(tokens: list[int]) -> None:
    first = next((i for i, t in enumerate(tokens) if type(t) is bool), None)
    if first is None:
        assert token_bytes(tokens) == struct.pack(f"<{len(tokens)}I", *tokens)
        return
    with pytest.raises(UsageError) as info:
        token_bytes(tokens)
    assert info.value.field == "token_ids"
    assert f"token_ids[{first}] is {tokens[first]!r}" in str(info.value)


@pytest.mark.parametrize("padding", [0, 1, 5, 40, 2000])
@pytest.mark.parametrize("value", [True, False])
def test_a_bool_after_padding_is_found(padding: int, value: bool) -> None:
    tokens: list[int] = [0] * padding + [7, 65536, 256] * 50
    tokens.insert(len(tokens) - 3, value)
    with pytest.raises(UsageError, match=rf"token_ids\[{len(tokens) - 4}\] is {value!r}"):
        token_bytes(tokens)

"""The on-disk slot format: header fields, alignment, and every way a slot can be wrong."""

from __future__ import annotations

import os
import struct
import zlib

import crc32c
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from io_actors.storage.slot_format import (
    ALIGN,
    FORMAT_VERSION,
    HEADER_SIZE,
    MAGIC,
    OLDEST_READ_VERSION,
    MacMismatch,
    SlotHeader,
    SlotMeta,
    pack_slot,
    payload_checksum,
    payload_checksum_torch,
    slot_nbytes,
    unpack_slot,
    verify_header,
)
from statekv.errors import TransferFailed, UsageError
from statekv.ids import BlockHash, SlotId

KEY = BlockHash(bytes(range(32)))
OTHER_KEY = BlockHash(bytes(range(1, 33)))


def _flip(image: bytes, index: int, bit: int) -> bytes:
    data = bytearray(image)
    data[index] ^= 1 << bit
    return bytes(data)


def test_header_round_trips_every_field() -> None:
    header = SlotHeader(slot=7, key=KEY, payload_len=12345, payload_crc=0xDEADBEEF)
    block = header.pack()
    assert len(block) == HEADER_SIZE
    assert block.startswith(MAGIC)
    assert SlotHeader.unpack(block, what="slot 7") == header


_METAS = st.none() | st.builds(
    SlotMeta, parent=st.binary(min_size=32, max_size=32), depth=st.integers(0, 2**32 - 1),
    reuse_count=st.integers(0, 2**32 - 1),
    expiry=st.none() | st.floats(allow_nan=False, allow_infinity=False),
    written_at=st.floats(allow_nan=False, allow_infinity=False) | st.integers(-2**40, 2**40),
    sequence=st.integers(0, 2**64 - 1),
)


@given(
    slot=st.integers(0, 2**64 - 1), key=st.binary(min_size=32, max_size=32),
    payload_len=st.integers(1, 2**64 - 1), crc=st.integers(0, 2**32 - 1),
    version=st.sampled_from([OLDEST_READ_VERSION, FORMAT_VERSION]),
    config=st.binary(min_size=16, max_size=16), meta=_METAS,
    mac=st.none() | st.binary(min_size=32, max_size=32),
)
def test_an_unchecked_header_packs_as_the_checked_one_and_unpacks_equal(
    slot: int, key: bytes, payload_len: int, crc: int, version: int, config: bytes,
    meta: SlotMeta | None, mac: bytes | None,
) -> None:
    """The store packs its spills' headers unchecked (it checked the batch) and unpack
    builds them unchecked: the bytes and the parsed header are those of a checked one."""
    fields = dict(slot=slot, key=key, payload_len=payload_len, payload_crc=crc,
                  version=version, config=config, meta=meta, mac=mac)
    checked = SlotHeader(**fields)  # type: ignore[arg-type]
    unchecked = SlotHeader.unchecked(**fields)  # type: ignore[arg-type]
    assert unchecked == checked
    assert unchecked.pack() == checked.pack()
    parsed = SlotHeader.unpack(checked.pack(), what="slot")
    assert parsed == checked
    if meta is not None and isinstance(meta.written_at, int):
        assert parsed.meta is not None and parsed.meta.written_at == float(meta.written_at)


@pytest.mark.parametrize(("field", "value"), [
    ("depth", True), ("depth", 1.0), ("depth", -1), ("depth", 2**32), ("reuse_count", 2**32),
    ("reuse_count", False), ("sequence", 2**64), ("sequence", 1.5), ("expiry", float("nan")),
    ("expiry", float("inf")), ("expiry", True), ("written_at", None),
    ("written_at", float("-inf")), ("written_at", "1"),
])
def test_a_bad_restore_field_is_named(field: str, value: object) -> None:
    fields: dict[str, object] = dict(parent=KEY, depth=1, reuse_count=0, expiry=None,
                                     written_at=1.0, sequence=0)
    fields[field] = value
    with pytest.raises(UsageError) as info:
        SlotMeta(**fields)  # type: ignore[arg-type]
    assert info.value.field == field


@pytest.mark.parametrize(
    ("payload_len", "expected"),
    [(1, HEADER_SIZE + ALIGN), (ALIGN, HEADER_SIZE + ALIGN), (ALIGN + 1, HEADER_SIZE + 2 * ALIGN)],
)
def test_slot_size_pads_payload_to_the_alignment(payload_len: int, expected: int) -> None:
    assert slot_nbytes(payload_len) == expected
    image = pack_slot(slot=SlotId(0), key=KEY, payload=bytes(payload_len))
    assert len(image) == expected
    assert len(image) % ALIGN == 0


@settings(max_examples=60, deadline=None)
@given(payload=st.binary(min_size=1, max_size=3 * ALIGN), slot=st.integers(0, 2**40))
def test_unpacked_payload_is_byte_identical(payload: bytes, slot: int) -> None:
    image = pack_slot(slot=SlotId(slot), key=KEY, payload=payload)
    got = unpack_slot(image, slot=SlotId(slot), key=KEY, payload_len=len(payload))
    assert bytes(got) == payload


def test_wrong_key_is_refused() -> None:
    image = pack_slot(slot=SlotId(3), key=KEY, payload=b"kv" * 100)
    with pytest.raises(TransferFailed, match="key mismatch"):
        unpack_slot(image, slot=SlotId(3), key=OTHER_KEY, payload_len=200)


def test_header_of_another_slot_is_refused_as_misdirected() -> None:
    image = pack_slot(slot=SlotId(3), key=KEY, payload=b"kv" * 100)
    with pytest.raises(TransferFailed, match="misdirected"):
        unpack_slot(image, slot=SlotId(4), key=KEY, payload_len=200)


def test_unexpected_payload_length_is_refused() -> None:
    image = pack_slot(slot=SlotId(3), key=KEY, payload=b"kv" * 100)
    with pytest.raises(TransferFailed, match="payload length 200, expected 201"):
        unpack_slot(image, slot=SlotId(3), key=KEY, payload_len=201)


@pytest.mark.parametrize("version", [0, 1, FORMAT_VERSION + 1])
def test_other_format_version_is_refused(version: int) -> None:
    header = SlotHeader(
        slot=0, key=KEY, payload_len=4, payload_crc=payload_checksum(b"abcd", version=version),
        version=version,
    )
    image = header.pack() + b"abcd" + bytes(ALIGN - 4)
    with pytest.raises(TransferFailed, match=f"version {version}, this build reads versions 2 "):
        unpack_slot(image, slot=SlotId(0), key=KEY, payload_len=4)


# --- version 2 slots (zlib CRC-32), as the previous build wrote them: still read ------------


def test_the_versions_read_are_2_and_3() -> None:
    assert (OLDEST_READ_VERSION, FORMAT_VERSION) == (2, 3)


@settings(max_examples=30, deadline=None)
@given(payload=st.binary(min_size=1, max_size=3 * ALIGN))
def test_a_version_2_slot_is_read_and_verified_with_zlib_crc32(payload: bytes) -> None:
    image = pack_slot(slot=SlotId(4), key=KEY, payload=payload, meta=META, version=2)
    header = SlotHeader.unpack(image, what="slot 4")
    assert header.version == 2
    assert header.payload_crc == zlib.crc32(payload)
    assert bytes(unpack_slot(image, slot=SlotId(4), key=KEY, payload_len=len(payload))) == (
        payload
    )


@settings(max_examples=100, deadline=None)
@given(index=st.integers(0, HEADER_SIZE + 2 * ALIGN - 1), bit=st.integers(0, 7))
def test_any_flipped_bit_of_a_version_2_slot_is_detected(index: int, bit: int) -> None:
    image = pack_slot(slot=SlotId(5), key=KEY, payload=os.urandom(2 * ALIGN), meta=META,
                      version=2)
    with pytest.raises(TransferFailed):
        unpack_slot(_flip(image, index, bit), slot=SlotId(5), key=KEY, payload_len=2 * ALIGN)


@pytest.mark.parametrize(("written", "claimed"), [(2, 3), (3, 2)])
def test_a_version_field_changed_to_the_other_version_fails_the_header_checksum(
    written: int, claimed: int
) -> None:
    # The version picks the checksum function: a version rotted into the other readable one
    # must not make the reader check the wrong CRC and pass (the header CRC covers it).
    image = bytearray(pack_slot(slot=SlotId(1), key=KEY, payload=b"kv" * 64, version=written))
    struct.pack_into("<I", image, 8, claimed)
    with pytest.raises(TransferFailed, match="header checksum mismatch"):
        unpack_slot(bytes(image), slot=SlotId(1), key=KEY, payload_len=128)


def test_a_version_2_payload_under_a_crc32c_checksum_is_refused() -> None:
    # A version 2 header whose payload_crc is CRC-32C (a writer that mixed them up) fails.
    payload = os.urandom(ALIGN)
    header = SlotHeader(slot=0, key=KEY, payload_len=ALIGN, payload_crc=crc32c.crc32c(payload),
                        version=2)
    with pytest.raises(TransferFailed, match="payload checksum mismatch"):
        unpack_slot(header.pack() + payload, slot=SlotId(0), key=KEY, payload_len=ALIGN)


def test_zeroed_slot_reads_as_never_written() -> None:
    with pytest.raises(TransferFailed, match="never written"):
        unpack_slot(bytes(2 * ALIGN), slot=SlotId(0), key=KEY, payload_len=ALIGN)


@pytest.mark.parametrize("length", [0, 100, HEADER_SIZE - 1])
def test_truncated_header_is_refused(length: int) -> None:
    image = pack_slot(slot=SlotId(0), key=KEY, payload=b"x")
    with pytest.raises(TransferFailed, match="truncated"):
        SlotHeader.unpack(image[:length], what="slot 0")


def test_truncated_payload_is_refused() -> None:
    image = pack_slot(slot=SlotId(0), key=KEY, payload=bytes(3 * ALIGN))
    with pytest.raises(TransferFailed, match="short slot"):
        unpack_slot(image[: HEADER_SIZE + ALIGN], slot=SlotId(0), key=KEY, payload_len=3 * ALIGN)


@settings(max_examples=200, deadline=None)
@given(index=st.integers(0, HEADER_SIZE - 1), bit=st.integers(0, 7))
@example(index=HEADER_SIZE - 1, bit=7)  # the last padding byte is covered too
def test_any_flipped_header_bit_is_detected(index: int, bit: int) -> None:
    image = pack_slot(slot=SlotId(5), key=KEY, payload=b"payload")
    with pytest.raises(TransferFailed):
        unpack_slot(_flip(image, index, bit), slot=SlotId(5), key=KEY, payload_len=7)


@settings(max_examples=200, deadline=None)
@given(index=st.integers(0, 2 * ALIGN - 1), bit=st.integers(0, 7))
def test_any_flipped_payload_bit_fails_the_checksum(index: int, bit: int) -> None:
    image = pack_slot(slot=SlotId(5), key=KEY, payload=os.urandom(2 * ALIGN))
    with pytest.raises(TransferFailed, match="checksum mismatch"):
        unpack_slot(
            _flip(image, HEADER_SIZE + index, bit), slot=SlotId(5), key=KEY,
            payload_len=2 * ALIGN,
        )


def test_verify_header_accepts_the_expected_header() -> None:
    header = SlotHeader(slot=2, key=KEY, payload_len=10, payload_crc=1)
    verify_header(header, what="slot 2", slot=SlotId(2), key=KEY, payload_len=10)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"slot": -1}, "slot"),
        ({"slot": True}, "slot"),
        ({"key": b"short"}, "key"),
        ({"key": "x" * 32}, "key"),
        ({"payload_len": 0}, "payload_len"),
        ({"payload_len": 1.5}, "payload_len"),
        ({"payload_crc": 2**32}, "payload_crc"),
        ({"version": -1}, "version"),
    ],
)
def test_bad_header_fields_raise_usage_error_naming_the_field(
    kwargs: dict[str, object], field: str
) -> None:
    base: dict[str, object] = {"slot": 0, "key": KEY, "payload_len": 1, "payload_crc": 0}
    base.update(kwargs)
    with pytest.raises(UsageError) as info:
        SlotHeader(**base)  # type: ignore[arg-type]
    assert info.value.field == field


def test_slot_size_of_a_bad_length_names_the_field() -> None:
    with pytest.raises(UsageError) as info:
        slot_nbytes(0)
    assert info.value.field == "payload_len"


def test_pack_into_a_short_buffer_names_the_field() -> None:
    header = SlotHeader(slot=0, key=KEY, payload_len=1, payload_crc=0)
    with pytest.raises(UsageError) as info:
        header.pack_into(bytearray(100))
    assert info.value.field == "block"


def test_host_checksum_is_crc32c_known_answers() -> None:
    # The check values of the CRC catalogue (CRC-32C, "CRC-32/ISCSI") and RFC 3720 B.4.
    assert payload_checksum(b"123456789") == 0xE3069283
    assert payload_checksum(bytes(32)) == 0x8A9136AA
    assert payload_checksum(b"\xff" * 32) == 0x62A8AB43
    assert payload_checksum(bytes(range(32))) == 0x46DD794E
    # Version 2's: zlib's CRC-32 ("CRC-32/ISO-HDLC").
    assert payload_checksum(b"123456789", version=2) == 0xCBF43926


@pytest.mark.parametrize(("version", "reference"), [(3, crc32c.crc32c), (2, zlib.crc32)])
def test_host_checksum_is_the_reference_and_runs_on(version: int, reference: object) -> None:
    assert callable(reference)
    data = os.urandom(10_000)
    whole = payload_checksum(data, version=version)
    assert whole == reference(data)
    first = payload_checksum(data[:5000], version=version)
    assert payload_checksum(data[5000:], first, version=version) == whole


_REFERENCE = {3: crc32c.crc32c, 2: zlib.crc32}


@settings(max_examples=40, deadline=None)
@given(data=st.binary(min_size=0, max_size=3 * 4096 + 5), version=st.sampled_from([2, 3]))
@example(data=b"\x00", version=3)
@example(data=b"\xff" * 4096, version=3)
@example(data=b"\x01" * 4097, version=3)
@example(data=b"123456789", version=3)
@example(data=b"\x01" * 4097, version=2)
def test_device_checksum_equals_the_host_checksum(data: bytes, version: int) -> None:
    tensor = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(
        0, dtype=torch.uint8
    )
    assert payload_checksum_torch(tensor, version=version) == _REFERENCE[version](data)
    if version == FORMAT_VERSION:
        assert payload_checksum_torch(tensor) == payload_checksum(data)


@pytest.mark.parametrize("version", [2, 3])
@pytest.mark.parametrize("length", [256 * 4096, 256 * 4096 + 1, 300 * 4096 + 17])
def test_device_checksum_equals_the_host_checksum_across_slices(length: int,
                                                               version: int) -> None:
    data = os.urandom(length)
    tensor = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    assert payload_checksum_torch(tensor, version=version) == _REFERENCE[version](data)


def test_device_checksum_refuses_non_byte_tensors() -> None:
    with pytest.raises(UsageError) as info:
        payload_checksum_torch(torch.zeros(4, dtype=torch.float32))
    assert info.value.field == "data"


def test_the_slot_format_is_stable_byte_for_byte() -> None:
    # Slot files outlive the process that wrote them: a change to any byte of the format
    # (field order, either checksum's input, the MAC's input) makes existing files unreadable,
    # so it must be a new FORMAT_VERSION, never an accident.  The images below are version 3;
    # the checksums are crc32c.crc32c of the payload, and of the header with its CRC zeroed.
    image = pack_slot(slot=SlotId(3), key=BlockHash(bytes(range(32))),
                      payload=bytes(range(256)) * 16)
    assert len(image) == 8192
    assert image[:72].hex() == (
        "53544b56534c4f54" "03000000" "00100000" "0300000000000000" "0010000000000000"
        "000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f" "32fe719c"
        "333f160b"
    )
    assert image[68:72] == struct.pack(
        "<I", crc32c.crc32c(bytes(image[:68]) + bytes(4) + bytes(image[72:4096]))
    )
    assert image[72:4096] == bytes(4096 - 72)
    assert image[4096:] == bytes(range(256)) * 16
    meta = SlotMeta(parent=bytes(range(32, 64)), depth=5, reuse_count=2, expiry=1.5e9,
                    written_at=1.4e9, sequence=9)
    image = pack_slot(slot=SlotId(3), key=BlockHash(bytes(range(32))),
                      payload=bytes(range(256)) * 16, config=bytes(range(16)), meta=meta,
                      mac_key=b"k" * 16)
    assert image[64:72].hex() == "32fe719cd6e61fdb"
    assert image[72:188].hex() == (
        "000102030405060708090a0b0c0d0e0f"
        "202122232425262728292a2b2c2d2e2f303132333435363738393a3b3c3d3e3f"
        "000000c00b5ad641" "0000008093dcd441" "0900000000000000" "05000000" "02000000"
        "07000000"
        "bea0160266b6643ee77711ecd0f44f5983b5095b96110e1d33cffc852af0b301"
    )
    assert image[188:4096] == bytes(4096 - 188)


def test_the_version_2_slot_format_is_read_as_it_was_written() -> None:
    # Exactly the images the version 2 build wrote (its golden bytes, unchanged): this build
    # must read them, so existing slot files and Redis values keep serving after the upgrade.
    image = pack_slot(slot=SlotId(3), key=BlockHash(bytes(range(32))),
                      payload=bytes(range(256)) * 16, version=2)
    assert len(image) == 8192
    assert image[:72].hex() == (
        "53544b56534c4f54" "02000000" "00100000" "0300000000000000" "0010000000000000"
        "000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f" "822091a2"
        "369fecca"
    )
    assert image[72:4096] == bytes(4096 - 72)
    assert image[4096:] == bytes(range(256)) * 16
    meta = SlotMeta(parent=bytes(range(32, 64)), depth=5, reuse_count=2, expiry=1.5e9,
                    written_at=1.4e9, sequence=9)
    image = pack_slot(slot=SlotId(3), key=BlockHash(bytes(range(32))),
                      payload=bytes(range(256)) * 16, config=bytes(range(16)), meta=meta,
                      mac_key=b"k" * 16, version=2)
    assert image[64:72].hex() == "822091a289b2c743"
    assert bytes(unpack_slot(image, slot=SlotId(3), key=BlockHash(bytes(range(32))),
                             payload_len=4096, mac_key=b"k" * 16)) == bytes(range(256)) * 16
    header = SlotHeader.unpack(image, what="slot 3")
    assert (header.version, header.meta, header.config) == (2, meta, bytes(range(16)))
    assert image[72:188].hex() == (
        "000102030405060708090a0b0c0d0e0f"
        "202122232425262728292a2b2c2d2e2f303132333435363738393a3b3c3d3e3f"
        "000000c00b5ad641" "0000008093dcd441" "0900000000000000" "05000000" "02000000"
        "07000000"
        "4fa1e4577988785cd8357e5c4585af3797823e2a1b69c67bab0aac165dc1b205"
    )
    assert image[188:4096] == bytes(4096 - 188)


META = SlotMeta(parent=bytes(32), depth=3, reuse_count=1, expiry=None, written_at=10.0,
                sequence=4)


def test_header_round_trips_meta_config_and_mac() -> None:
    with_ttl = SlotMeta(parent=OTHER_KEY, depth=7, reuse_count=9, expiry=123.25,
                        written_at=100.5, sequence=2**40)
    for meta in (META, with_ttl):
        header = SlotHeader(slot=1, key=KEY, payload_len=8, payload_crc=5,
                            config=b"c" * 16, meta=meta, mac=b"m" * 32)
        assert SlotHeader.unpack(header.pack(), what="slot 1") == header


def test_a_keyed_mac_round_trips_and_a_wrong_or_missing_key_is_refused() -> None:
    image = pack_slot(slot=SlotId(2), key=KEY, payload=b"kv" * 50, meta=META,
                      mac_key=b"secret-key-16byt")
    got = unpack_slot(image, slot=SlotId(2), key=KEY, payload_len=100,
                      mac_key=b"secret-key-16byt")
    assert bytes(got) == b"kv" * 50
    with pytest.raises(MacMismatch, match="MAC mismatch"):
        unpack_slot(image, slot=SlotId(2), key=KEY, payload_len=100, mac_key=b"other-key-16byte")
    plain = pack_slot(slot=SlotId(2), key=KEY, payload=b"kv" * 50, meta=META)
    with pytest.raises(MacMismatch, match="no MAC"):
        unpack_slot(plain, slot=SlotId(2), key=KEY, payload_len=100, mac_key=b"secret-key-16byt")


def test_a_forger_with_valid_checksums_but_no_key_is_refused() -> None:
    # What a CRC cannot stop: rewrite the payload and fix both checksums up.
    mac_key = b"secret-key-16byt"
    genuine = pack_slot(slot=SlotId(2), key=KEY, payload=b"a" * 64, mac_key=mac_key)
    header = SlotHeader.unpack(genuine, what="slot 2")
    forged_payload = b"b" * 64
    forged = bytearray(genuine)
    attrs_evolve = SlotHeader(slot=2, key=KEY, payload_len=64,
                              payload_crc=payload_checksum(forged_payload), mac=header.mac)
    forged[:HEADER_SIZE] = attrs_evolve.pack()
    forged[HEADER_SIZE:HEADER_SIZE + 64] = forged_payload
    with pytest.raises(MacMismatch):
        unpack_slot(bytes(forged), slot=SlotId(2), key=KEY, payload_len=64, mac_key=mac_key)
    # Without a MAC key the forgery would pass: that is exactly why the MAC exists.
    assert bytes(unpack_slot(bytes(forged), slot=SlotId(2), key=KEY, payload_len=64)) == (
        forged_payload
    )

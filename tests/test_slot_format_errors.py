"""Every way a slot image can be wrong is refused with an error naming the slot and saying
what is wrong (mutation testing showed messages and the slot named in them unchecked: a
TransferFailed without its slot sends the operator to the wrong file)."""

from __future__ import annotations

import struct
from collections.abc import Callable

import pytest

from io_actors.storage import slot_format
from io_actors.storage.slot_format import (
    HEADER_SIZE,
    SlotHeader,
    pack_slot,
    unpack_slot,
)
from statekv.errors import TransferFailed, UsageError
from statekv.ids import BlockHash, SlotId

KEY = BlockHash(bytes(range(32)))
OTHER_KEY = BlockHash(bytes(range(1, 33)))
PAYLOAD = bytes(range(256)) * 20
SLOT = SlotId(7)
U64 = 2**64 - 1


def _image() -> bytearray:
    return bytearray(pack_slot(slot=SLOT, key=KEY, payload=PAYLOAD))


def _with_fields(**fields: int) -> bytearray:
    """The image with header fields rewritten and the header checksum made right again."""
    image = _image()
    layout = {"version": (8, "<I"), "header_size": (12, "<I"), "payload_len": (24, "<Q")}
    for name, value in fields.items():
        offset, fmt = layout[name]
        struct.pack_into(fmt, image, offset, value)
    struct.pack_into("<I", image, slot_format._CRC_AT, slot_format._header_crc(image))
    return image


def _flipped(index: int) -> bytearray:
    image = _image()
    image[index] ^= 0x10
    return image


CASES: list[tuple[str, Callable[[], bytearray], dict[str, object], str]] = [
    ("truncated header", lambda: _image()[:100], {}, "header truncated: 100 of 4096 bytes"),
    ("no magic", lambda: _flipped(0), {}, "no slot header (magic b'CTKVSLOT'): never "
                                          "written, or overwritten"),
    ("other version", lambda: _with_fields(version=slot_format.FORMAT_VERSION + 1), {},
     f"slot format version {slot_format.FORMAT_VERSION + 1}, this build reads versions "
     f"{slot_format.OLDEST_READ_VERSION} to {slot_format.FORMAT_VERSION}"),
    ("header size", lambda: _with_fields(header_size=8192), {},
     "header size 8192, expected 4096"),
    ("header checksum", lambda: _flipped(HEADER_SIZE - 1), {}, "header checksum mismatch"),
    ("empty payload", lambda: _with_fields(payload_len=0), {},
     "header claims an empty payload"),
    ("misdirected", _image, {"slot": SlotId(8)}, "header names slot 7: misdirected write"),
    ("other key", _image, {"key": OTHER_KEY},
     f"key mismatch: slot holds {KEY.hex()[:16]}..., expected {OTHER_KEY.hex()[:16]}..."),
    ("payload length", _image, {"payload_len": 4096},
     f"payload length {len(PAYLOAD)}, expected 4096"),
    ("short slot", lambda: _image()[:HEADER_SIZE + 100], {},
     f"short slot: {HEADER_SIZE + 100} bytes, needs {HEADER_SIZE + len(PAYLOAD)}"),
    ("payload checksum", lambda: _flipped(HEADER_SIZE + 3), {}, "payload checksum mismatch"),
]


@pytest.mark.parametrize(("image", "args", "cause"), [case[1:] for case in CASES],
                         ids=[case[0] for case in CASES])
def test_a_wrong_slot_names_itself_and_what_is_wrong(
        image: Callable[[], bytearray], args: dict[str, object], cause: str) -> None:
    kwargs: dict[str, object] = {"slot": SLOT, "key": KEY, "payload_len": len(PAYLOAD)}
    kwargs.update(args)
    with pytest.raises(TransferFailed) as info:
        unpack_slot(image(), **kwargs)  # type: ignore[arg-type]
    assert info.value.what == f"slot {kwargs['slot']}"
    assert info.value.cause.startswith(cause), info.value.cause
    assert str(info.value) == f"{info.value.what}: {info.value.cause}"


def test_the_largest_values_each_field_holds_are_accepted() -> None:
    header = SlotHeader(slot=U64, key=KEY, payload_len=U64, payload_crc=0xFFFFFFFF,
                        version=0xFFFFFFFF)
    assert (header.slot, header.payload_len) == (U64, U64)


@pytest.mark.parametrize(("fields", "field", "message"), [
    ({"slot": -1}, "slot", f"must be in [0, {U64}], got -1"),
    ({"slot": U64 + 1}, "slot", f"must be in [0, {U64}], got {U64 + 1}"),
    ({"slot": "7"}, "slot", "must be an integer, got '7'"),
    ({"payload_len": 0}, "payload_len", "must be in [1, 2**64), got 0"),
    ({"payload_len": U64 + 1}, "payload_len", f"must be in [1, 2**64), got {U64 + 1}"),
    ({"payload_len": 1.0}, "payload_len", "must be an integer, got 1.0"),
    ({"key": b"short"}, "key", "must be 32 bytes (a BlockHash), got b'short'"),
    ({"payload_crc": 1 << 32}, "payload_crc", f"must be in [0, {0xFFFFFFFF}], got {1 << 32}"),
])
def test_a_bad_header_field_is_named_with_its_range(
        fields: dict[str, object], field: str, message: str) -> None:
    args: dict[str, object] = {"slot": 7, "key": KEY, "payload_len": 10, "payload_crc": 0}
    args.update(fields)
    with pytest.raises(UsageError) as info:
        SlotHeader(**args)  # type: ignore[arg-type]
    assert info.value.field == field
    assert str(info.value) == f"{field}: {message}"


def test_packing_into_a_short_block_says_how_much_it_needs() -> None:
    header = SlotHeader(slot=7, key=KEY, payload_len=10, payload_crc=0)
    with pytest.raises(UsageError) as info:
        header.pack_into(bytearray(100))
    assert str(info.value) == "block: needs 4096 bytes, got 100"

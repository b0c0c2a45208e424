"""The on-disk slot format: one block's KV behind a self-describing, checksummed header.

Layout of one slot (integers little-endian)::

    offset 0      header block, HEADER_SIZE bytes
                    magic        8s   b"STKVSLOT"
                    version      u32  FORMAT_VERSION (3; this build reads 2 and 3)
                    header_size  u32  HEADER_SIZE
                    slot         u64  the slot number the writer meant
                    payload_len  u64  bytes of KV that follow
                    key          32s  the block's BlockHash
                    payload_crc  u32  CRC-32C of the payload (version 2: CRC-32, below)
                    header_crc   u32  CRC-32C of the whole header block, this field read as
                                      zero (version 2: CRC-32)
                  (version 2: what an index rebuild after a restart needs)
                    config       16s  config fingerprint: model, layout, block size, version
                    parent       32s  the key of the previous block of the chain
                    expiry       f64  retention deadline, wall-clock seconds (flags bit 1)
                    written_at   f64  wall-clock seconds when the spill was issued
                    sequence     u64  the writer's transfer number (order within a second)
                    depth        u32  position in the chain
                    reuse_count  u32  prefix hits on the content when it was spilled
                    flags        u32  bit 0: parent..reuse_count are set (restorable);
                                      bit 1: expiry is set; bit 2: mac is set
                    mac          32s  keyed BLAKE2b-256 of the header block (mac and
                                      header_crc read as zero) and the payload, or zeros
                    zeros up to HEADER_SIZE
    offset 4096   payload, payload_len bytes, zero padded to a multiple of ALIGN

Why these fields:

- Everything is a multiple of 4096 bytes so that O_DIRECT (which wants file offsets, lengths
  and buffer addresses aligned to the device's logical block, 512 or 4096) and GPUDirect
  Storage (4 KiB GPU pages) can move a slot without bounce copies.
- The key binds the bytes to the block they belong to: a slot recycled for another block, a
  write that never landed, or a stale file from another run reads as a key mismatch.  Keys
  are content hashes (statekv.hashing), so bytes that carry the right key *and* a valid
  checksum are the right KV wherever they are found.
- The slot number catches misdirected I/O (a wrong offset) and a data file reopened with
  another slot geometry.
- The header checksum covers the whole 4 KiB header block, so no byte of it can rot
  unnoticed; the payload checksum covers every payload byte.

Checksum choice: CRC-32C (the Castagnoli polynomial, as iSCSI, ext4 and SCTP use it), as
computed by the ``crc32c`` package, which runs the CPU's CRC32 instruction (SSE4.2, ARMv8).
Every spill checksums its whole payload on a writer thread before the write, so the
checksum's rate bounds the spill's: measured by ``python -m bench.checksum`` on this
project's 2-vCPU CPU machine (AMD EPYC; BENCHMARKS.md, "Payload checksum"), CRC-32C runs
at 2.1-3.0x zlib's CRC-32 on 256 KiB - 4 MiB buffers read from memory (10-15 GB/s against
4-6.5 GB/s a thread), which takes the checksum's share of a spilled block's writer-thread
time from 29-47% to 16-25%.  Both release the GIL on large buffers (zlib above 5 KiB,
crc32c from 32 KiB), so writer threads checksum in parallel.  Earlier measurements put sha256 /
sha1 (SHA-NI) at 1.5 GB/s and blake2b / md5 at 0.65 GB/s; zlib.adler32 is no faster than
zlib.crc32 and weaker.  A CRC is not a MAC: it detects rot, torn and misdirected writes,
not an adversary who can write the disk (who could as well rewrite the key).  Because a CRC
is linear over GF(2), it can also be computed on the GPU with plain tensor ops
(:func:`payload_checksum_torch`), which is what lets a GPUDirect read be verified without
bringing the bytes back to the host; CRC-32C is the same computation with another
polynomial.

For a disk that other users can write, the optional keyed MAC (BLAKE2b with a key the caller
holds and never stores in the directory) closes that gap: a slot forged without the key fails
its MAC and is never served.  It costs a BLAKE2b pass over the payload (0.65 GB/s per
thread above), so it is off unless a key is given.

Versions.  Version 2 added the fields after header_crc; a version 1 file (``slots.v1``)
holds nothing an index rebuild could use (no parent key, no deadline), so it is reclaimed,
never read.  Version 3 changed only the checksum function, of both checksums, from zlib's
CRC-32 to CRC-32C: every byte of the layout is version 2's, so version 2 slots are still
read, and verified with the checksum they were written with (the version field says
which; the header checksum covers it, so a version rotted into the other one fails that
checksum, computed with the other function, but for the CRC's 2^-32 odds).  New slots are
written as version 3; a data file holds both versions side by side until its old slots are
overwritten, and keeps its version 2 name (posix_open).
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import math
import struct
import zlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Final

import attrs
import crc32c
import torch

from statekv.errors import TransferFailed, UsageError
from statekv.hashing import DIGEST_SIZE
from statekv.ids import BlockHash, SlotId

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer, WriteableBuffer

ALIGN: Final = 4096
"""Alignment of every offset and length in a slot (O_DIRECT and GDS)."""
HEADER_SIZE: Final = 4096
MAGIC: Final = b"STKVSLOT"
FORMAT_VERSION: Final = 3
"""The version this build writes."""
OLDEST_READ_VERSION: Final = 2
"""The oldest version this build reads (version 2: the zlib CRC-32 checksums)."""
CRC32C_SINCE: Final = 3
"""The first version whose checksums are CRC-32C; the versions before use zlib's CRC-32."""
_CONFIG_VERSION: Final = 2
"""The version in every config fingerprint: what the payload bytes mean, which version 3 (a
checksum change) left as it was.  Kept at 2 so that the slots and index journal records a
version 2 cache wrote still match the fingerprint of this build's cache (else every one of
them would be foreign at a restart), and replicas of either version name a block by the same
Redis key."""
KEY_SIZE: Final = DIGEST_SIZE
CONFIG_FINGERPRINT_SIZE: Final = 16
MAC_SIZE: Final = 32
MAC_KEY_MIN: Final = 16
"""Shortest MAC key accepted (BLAKE2b takes keys of 1-64 bytes; short ones are guessable)."""
MAC_KEY_MAX: Final = 64
FLAG_META: Final = 1
FLAG_EXPIRY: Final = 2
FLAG_MAC: Final = 4

_HEADER = struct.Struct("<8sIIQQ32sI")
"""Everything before header_crc."""
_CRC = struct.Struct("<I")
_CRC_AT: Final = _HEADER.size
_HEADER_USED: Final = _CRC_AT + _CRC.size
_ZERO_CRC_FIELD: Final = bytes(_CRC.size)
_META = struct.Struct("<16s32sddQIII")
"""Version 2 fields, from _HEADER_USED on (before the mac)."""
_META_AT: Final = _HEADER_USED
_MAC_AT: Final = _META_AT + _META.size
_FIELDS_END: Final = _MAC_AT + MAC_SIZE
_ZERO_MAC: Final = bytes(MAC_SIZE)
_ZERO_KEY: Final = bytes(KEY_SIZE)
_ZERO_TAIL: Final = bytes(HEADER_SIZE - _HEADER_USED)
_U32_MAX_FLAGS: Final = FLAG_META | FLAG_EXPIRY | FLAG_MAC
_U32: Final = 0xFFFFFFFF
_U64: Final = 2**64 - 1


def align_up(n: int) -> int:
    """`n` rounded up to a multiple of ALIGN."""
    return -(-n // ALIGN) * ALIGN


def slot_nbytes(payload_len: int) -> int:
    """Bytes one slot of `payload_len` payload bytes occupies on disk."""
    _check_payload_len(payload_len)
    return HEADER_SIZE + align_up(payload_len)


def payload_checksum(data: ReadableBuffer, value: int = 0, *,
                     version: int = FORMAT_VERSION) -> int:
    """The payload checksum of host bytes under slot format `version` (a read verifies a
    slot with its header's version): CRC-32C, or zlib's CRC-32 before CRC32C_SINCE.  Both
    release the GIL on large buffers (crc32c from 32 KiB, zlib above 5 KiB)."""
    return _crc_function(version)(data, value)


def _crc_function(version: int) -> Callable[[ReadableBuffer, int], int]:
    """The checksum function of slot format `version` (both checksums of a slot use it)."""
    return crc32c.crc32c if version >= CRC32C_SINCE else zlib.crc32


def _check_payload_len(payload_len: object) -> None:
    if isinstance(payload_len, bool) or not isinstance(payload_len, int):
        raise UsageError("payload_len", f"must be an integer, got {payload_len!r}")
    if not 1 <= payload_len <= _U64:
        raise UsageError("payload_len", f"must be in [1, 2**64), got {payload_len}")


def _check_field(field: str, value: object, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise UsageError(field, f"must be an integer, got {value!r}")
    if not 0 <= value <= high:
        raise UsageError(field, f"must be in [0, {high}], got {value}")


def check_payload_crc(field: str, crc: object) -> None:
    """raises: UsageError unless `crc` is a checksum a header can hold (u32)."""
    _check_field(field, crc, _U32)


def check_key(key: object) -> None:
    """raises: UsageError unless `key` is a BlockHash (32 bytes)."""
    if not isinstance(key, bytes) or len(key) != KEY_SIZE:
        raise UsageError("key", f"must be {KEY_SIZE} bytes (a BlockHash), got {key!r:.80}")


def _header_crc(block: ReadableBuffer, version: int = FORMAT_VERSION) -> int:
    """The header checksum: the same function as the payload's, of the same version."""
    view = memoryview(block)
    crc_of = _crc_function(version)
    crc = crc_of(_ZERO_CRC_FIELD, crc_of(view[:_CRC_AT], 0))
    return crc_of(view[_HEADER_USED:HEADER_SIZE], crc)


def check_mac_key(field: str, key: object) -> bytes | None:
    """raises: UsageError unless `key` is None or 16-64 bytes (a BLAKE2b key)."""
    if key is None:
        return None
    if not isinstance(key, bytes) or not MAC_KEY_MIN <= len(key) <= MAC_KEY_MAX:
        raise UsageError(
            field, f"must be None or {MAC_KEY_MIN}-{MAC_KEY_MAX} bytes, got "
            f"{type(key).__name__} of length {len(key) if isinstance(key, bytes) else '?'}"
        )
    return key


def slot_mac(mac_key: bytes, header_block: ReadableBuffer, payload: ReadableBuffer) -> bytes:
    """Keyed BLAKE2b-256 of a header block (mac and header_crc read as zero) and a payload."""
    view = memoryview(header_block).cast("B")
    h = hashlib.blake2b(key=mac_key, digest_size=MAC_SIZE, person=b"statekv-slot")
    h.update(view[:_CRC_AT])
    h.update(_ZERO_CRC_FIELD)
    h.update(view[_HEADER_USED:_MAC_AT])
    h.update(_ZERO_MAC)
    h.update(view[_FIELDS_END:HEADER_SIZE])
    h.update(payload)
    return h.digest()


def config_fingerprint(
    *, model_fingerprint: str, layout: tuple[object, ...], block_size: int
) -> bytes:
    """What a slot's bytes mean: the content under one fingerprint is servable under it only.

    The model fingerprint is in every chained key too; the layout and block size decide how
    the payload is read as KV, which no key says.
    """
    text = repr((_CONFIG_VERSION, model_fingerprint, layout, block_size)).encode()
    return hashlib.blake2b(text, digest_size=CONFIG_FINGERPRINT_SIZE,
                           person=b"statekv-config").digest()


@attrs.frozen(kw_only=True)
class SlotMeta:
    """What an index rebuild needs to adopt a slot after a restart (format version 2)."""

    parent: bytes
    """Key of the previous block of the chain (the root key for a first block)."""
    depth: int
    reuse_count: int
    expiry: float | None
    """Retention deadline in wall-clock seconds, None for best-effort content."""
    written_at: float
    """Wall-clock seconds when the spill was issued."""
    sequence: int
    """The writer's transfer number: orders spills issued within one clock reading."""

    def __attrs_post_init__(self) -> None:
        # The writer makes one of these per spilled block: the common case (exact ints and
        # floats in range) is tested inline, and only a value failing it goes through the
        # full check that names the field.
        if not isinstance(self.parent, bytes) or len(self.parent) != KEY_SIZE:
            raise UsageError("parent", f"must be {KEY_SIZE} bytes, got {self.parent!r:.80}")
        depth, reuse, sequence = self.depth, self.reuse_count, self.sequence
        if not (type(depth) is int and type(reuse) is int and type(sequence) is int
                and 0 <= depth <= _U32 and 0 <= reuse <= _U32 and 0 <= sequence <= _U64):
            _check_field("depth", depth, _U32)
            _check_field("reuse_count", reuse, _U32)
            _check_field("sequence", sequence, _U64)
        for field, value in (("expiry", self.expiry), ("written_at", self.written_at)):
            if type(value) is float and math.isfinite(value):
                continue
            if value is None and field == "expiry":
                continue
            if isinstance(value, bool) or not isinstance(value, int | float) or not (
                math.isfinite(value)
            ):
                raise UsageError(field, f"must be a finite number of seconds, got {value!r}")

    @classmethod
    def unpacked(
        cls, *, parent: bytes, depth: int, reuse_count: int, expiry: float | None,
        written_at: float, sequence: int,
    ) -> SlotMeta:
        """From fields a struct just unpacked from a checksummed record, whose times the
        caller checked finite: their types and ranges are the struct's, so they are not
        checked again (an index rebuild makes 100k of these; the checks were half its
        parsing time)."""
        self = object.__new__(cls)
        setattr_ = object.__setattr__
        setattr_(self, "parent", parent)
        setattr_(self, "depth", depth)
        setattr_(self, "reuse_count", reuse_count)
        setattr_(self, "expiry", expiry)
        setattr_(self, "written_at", written_at)
        setattr_(self, "sequence", sequence)
        return self


@attrs.frozen(kw_only=True)
class SlotHeader:
    """What a slot says about itself."""

    slot: int
    key: bytes
    payload_len: int
    payload_crc: int
    """The payload's checksum, of this header's `version` (:func:`payload_checksum`)."""
    version: int = FORMAT_VERSION
    """The format version; only tests and tools write anything but FORMAT_VERSION."""
    config: bytes = bytes(CONFIG_FINGERPRINT_SIZE)
    """Config fingerprint of the writer (:func:`config_fingerprint`); zeros when unknown."""
    meta: SlotMeta | None = None
    mac: bytes | None = None
    """The stored keyed MAC, or None when the writer had no MAC key."""

    @classmethod
    def unchecked(
        cls, *, slot: int, key: bytes, payload_len: int, payload_crc: int,
        version: int = FORMAT_VERSION, config: bytes = bytes(CONFIG_FINGERPRINT_SIZE),
        meta: SlotMeta | None = None, mac: bytes | None = None,
    ) -> SlotHeader:
        """A header of fields whose types and ranges the caller has established, not checked
        again: :meth:`unpack`'s, parsed by a struct from a block whose checksum matched, and
        a slot store's, from its own configuration and a batch it checked at its boundary
        (:func:`check_payload_crc` for a checksum given with it).  Every spilled block is
        packed and every onboarded one unpacked: these checks cost about as much as the
        packing."""
        self = object.__new__(cls)
        setattr_ = object.__setattr__
        setattr_(self, "slot", slot)
        setattr_(self, "key", key)
        setattr_(self, "payload_len", payload_len)
        setattr_(self, "payload_crc", payload_crc)
        setattr_(self, "version", version)
        setattr_(self, "config", config)
        setattr_(self, "meta", meta)
        setattr_(self, "mac", mac)
        return self

    def __attrs_post_init__(self) -> None:
        _check_field("slot", self.slot, _U64)
        check_key(self.key)
        _check_payload_len(self.payload_len)
        _check_field("payload_crc", self.payload_crc, _U32)
        _check_field("version", self.version, _U32)
        if not isinstance(self.config, bytes) or len(self.config) != CONFIG_FINGERPRINT_SIZE:
            raise UsageError(
                "config", f"must be {CONFIG_FINGERPRINT_SIZE} bytes, got {self.config!r:.80}"
            )
        if self.meta is not None and not isinstance(self.meta, SlotMeta):
            raise UsageError("meta", f"must be a SlotMeta or None, got {self.meta!r:.80}")
        if self.mac is not None and (not isinstance(self.mac, bytes) or len(self.mac) != MAC_SIZE):
            raise UsageError("mac", f"must be None or {MAC_SIZE} bytes, got {self.mac!r:.80}")

    def pack_into(
        self, block: WriteableBuffer, *, mac_key: bytes | None = None,
        payload: ReadableBuffer | None = None,
    ) -> None:
        """Write the full HEADER_SIZE header block (padding included) into `block`.

        With `mac_key`, the MAC of the header and `payload` is computed and stored (the
        `mac` field of this record is ignored); without it, `mac` is stored as is.
        """
        view = memoryview(block).cast("B")
        if view.nbytes < HEADER_SIZE:
            raise UsageError("block", f"needs {HEADER_SIZE} bytes, got {view.nbytes}")
        _HEADER.pack_into(
            view, 0, MAGIC, self.version, HEADER_SIZE, self.slot, self.payload_len, self.key,
            self.payload_crc,
        )
        view[_HEADER_USED:HEADER_SIZE] = _ZERO_TAIL
        meta = self.meta
        flags = FLAG_MAC if mac_key is not None or self.mac is not None else 0
        if meta is not None:
            flags |= FLAG_META
            if meta.expiry is not None:
                flags |= FLAG_EXPIRY
            _META.pack_into(
                view, _META_AT, self.config, meta.parent,
                meta.expiry if meta.expiry is not None else 0.0, meta.written_at,
                meta.sequence, meta.depth, meta.reuse_count, flags,
            )
        else:
            _META.pack_into(view, _META_AT, self.config, _ZERO_KEY, 0.0, 0.0, 0, 0, 0, flags)
        if mac_key is not None:
            if payload is None:
                raise UsageError("payload", "a MAC covers the payload: pass it with mac_key")
            view[_MAC_AT:_FIELDS_END] = slot_mac(mac_key, view, payload)
        elif self.mac is not None:
            view[_MAC_AT:_FIELDS_END] = self.mac
        _CRC.pack_into(view, _CRC_AT, _header_crc(view, self.version))

    def pack(self) -> bytes:
        block = bytearray(HEADER_SIZE)
        self.pack_into(block)
        return bytes(block)

    @classmethod
    def unpack(cls, block: ReadableBuffer, *, what: str) -> SlotHeader:
        """Parse and self-check a header block; `what` names the slot in errors.

        raises: TransferFailed when the block is short, not a slot header, of another
        format version than those this build reads, or fails its header checksum (of the
        function its version names).
        """
        view = memoryview(block).cast("B")
        if view.nbytes < HEADER_SIZE:
            raise TransferFailed(what, f"header truncated: {view.nbytes} of {HEADER_SIZE} bytes")
        magic, version, header_size, slot, payload_len, key, payload_crc = _HEADER.unpack_from(
            view, 0
        )
        if magic != MAGIC:
            raise TransferFailed(
                what, f"no slot header (magic {bytes(magic)!r}): never written, or overwritten"
            )
        if not OLDEST_READ_VERSION <= version <= FORMAT_VERSION:
            raise TransferFailed(
                what, f"slot format version {version}, this build reads versions "
                f"{OLDEST_READ_VERSION} to {FORMAT_VERSION}"
            )
        if header_size != HEADER_SIZE:
            raise TransferFailed(what, f"header size {header_size}, expected {HEADER_SIZE}")
        (stored_crc,) = _CRC.unpack_from(view, _CRC_AT)
        actual_crc = _header_crc(view, version)
        if stored_crc != actual_crc:
            raise TransferFailed(
                what, f"header checksum mismatch (stored {stored_crc:#010x}, "
                f"computed {actual_crc:#010x})"
            )
        if payload_len == 0:
            raise TransferFailed(what, "header claims an empty payload")
        config, parent, expiry, written_at, sequence, depth, reuse, flags = _META.unpack_from(
            view, _META_AT
        )
        if flags & ~_U32_MAX_FLAGS:
            raise TransferFailed(what, f"unknown header flags {flags:#x}")
        meta = None
        if flags & FLAG_META:
            if not (math.isfinite(expiry) and math.isfinite(written_at)):
                raise TransferFailed(what, "header holds a non-finite time")
            meta = SlotMeta.unpacked(
                parent=bytes(parent), depth=depth, reuse_count=reuse,
                expiry=expiry if flags & FLAG_EXPIRY else None, written_at=written_at,
                sequence=sequence,
            )
        mac = bytes(view[_MAC_AT:_FIELDS_END]) if flags & FLAG_MAC else None
        return cls.unchecked(
            slot=slot, key=bytes(key), payload_len=payload_len, payload_crc=payload_crc,
            version=version, config=bytes(config), meta=meta, mac=mac,
        )


def verify_header(
    header: SlotHeader, *, what: str, slot: SlotId, key: BlockHash, payload_len: int
) -> None:
    """raises: TransferFailed unless the header is the one the caller expects."""
    if header.slot != slot:
        raise TransferFailed(what, f"header names slot {header.slot}: misdirected write")
    if header.key != key:
        raise TransferFailed(
            what, f"key mismatch: slot holds {header.key.hex()[:16]}..., "
            f"expected {bytes(key).hex()[:16]}..."
        )
    if header.payload_len != payload_len:
        raise TransferFailed(
            what, f"payload length {header.payload_len}, expected {payload_len}"
        )


class MacMismatch(TransferFailed):
    """A slot's keyed MAC is missing or wrong: written without the key, or forged."""


def verify_mac(
    mac_key: bytes | None, header_block: ReadableBuffer, header: SlotHeader,
    payload: ReadableBuffer, *, what: str,
) -> None:
    """raises: MacMismatch when a MAC key is set and the slot's MAC is missing or wrong."""
    if mac_key is None:
        return
    if header.mac is None:
        raise MacMismatch(what, "slot has no MAC, and this cache requires one")
    expected = slot_mac(mac_key, header_block, payload)
    if not hmac.compare_digest(expected, header.mac):
        raise MacMismatch(what, "MAC mismatch: written without this key, or altered")


def verify_checksum(header: SlotHeader, actual_crc: int, *, what: str) -> None:
    """raises: TransferFailed when the payload's checksum is not the header's.

    `actual_crc` is the payload's checksum of the header's version
    (``payload_checksum(payload, version=header.version)``, or its device forms).
    """
    if actual_crc != header.payload_crc:
        raise TransferFailed(
            what, f"payload checksum mismatch (header {header.payload_crc:#010x}, "
            f"payload {actual_crc:#010x}): corrupt or torn slot"
        )


def pack_slot(
    *, slot: SlotId, key: BlockHash, payload: ReadableBuffer, config: bytes | None = None,
    meta: SlotMeta | None = None, mac_key: bytes | None = None,
    version: int = FORMAT_VERSION,
) -> bytes:
    """A whole slot image: header, payload, zero padding (tests and tools; `version` makes
    a slot as an older build wrote it)."""
    data = memoryview(payload).cast("B")
    header = SlotHeader(
        slot=slot, key=key, payload_len=data.nbytes,
        payload_crc=payload_checksum(data, version=version),
        config=config if config is not None else bytes(CONFIG_FINGERPRINT_SIZE), meta=meta,
        version=version,
    )
    image = bytearray(slot_nbytes(data.nbytes))
    header.pack_into(image, mac_key=mac_key, payload=data)
    image[HEADER_SIZE : HEADER_SIZE + data.nbytes] = data
    return bytes(image)


def unpack_slot(
    image: ReadableBuffer, *, slot: SlotId, key: BlockHash, payload_len: int,
    mac_key: bytes | None = None,
) -> memoryview:
    """The payload of a whole slot image, fully verified.

    raises: TransferFailed on a short image or any header, checksum or MAC mismatch.
    """
    what = f"slot {slot}"
    view = memoryview(image).cast("B")
    header = SlotHeader.unpack(view, what=what)
    verify_header(header, what=what, slot=slot, key=key, payload_len=payload_len)
    end = HEADER_SIZE + payload_len
    if view.nbytes < end:
        raise TransferFailed(what, f"short slot: {view.nbytes} bytes, needs {end}")
    payload = view[HEADER_SIZE:end]
    verify_checksum(header, payload_checksum(payload, version=header.version), what=what)
    verify_mac(mac_key, view[:HEADER_SIZE], header, payload, what=what)
    return payload


@attrs.frozen(kw_only=True)
class SlotExtent:
    """Where one slot lives on disk (for tools and fault injection, never the hot path)."""

    path: str
    offset: int
    nbytes: int


# --- the same checksum on any torch device ----------------------------------------------------
#
# Both checksums (CRC-32C, and version 2's zlib CRC-32) are reflected CRCs that start from
# an all-ones register and invert the result, so each is affine in the data:
# crc(d) = crc(zeros(len(d))) ^ R(d), where R is the reflected CRC register run from zero
# state without the final inversion, a GF(2)-linear function of the bytes.  Only the
# polynomial differs, and with it the tables below.  R splits over fixed chunks of C bytes
# (the data left-padded with zeros, which leave a zero register unchanged):
#
#     R(d_0 || ... || d_{n-1}) = XOR_j  Z^(C*(n-1-j)) ( R(d_j) )
#
# where Z is "feed one zero byte", a linear map on 32-bit values.  R(d_j) is the XOR over the
# chunk's positions of a table lookup P[position][byte], and a linear map on a 32-bit value is
# the XOR of four lookups, one per byte of the value.  Everything is gathers and XORs on int32
# tensors, which every torch device runs exactly; the tables are built once per device, chunk
# count and polynomial.

_CRC_CHUNK: Final = 4096
"""Bytes per chunk (a power of two, for the XOR folds)."""
_CRC_SLICE_CHUNKS: Final = 256
"""Chunks processed per step: bounds the temporary memory to about 30 MiB."""
_CRC32C_POLY: Final = 0x82F63B78
"""Castagnoli's polynomial, bit-reflected (CRC-32C)."""
_CRC32_POLY: Final = 0xEDB88320
"""The IEEE 802.3 polynomial, bit-reflected (zlib's CRC-32, slot format version 2)."""


def _polynomial(version: int) -> int:
    return _CRC32C_POLY if version >= CRC32C_SINCE else _CRC32_POLY


@functools.cache
def _crc_table(version: int) -> tuple[int, ...]:
    """The byte-at-a-time table of the CRC of slot format `version`."""
    poly = _polynomial(version)
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ poly if c & 1 else c >> 1
        table.append(c)
    return tuple(table)


def _feed_zero_byte(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Z applied elementwise to int64 register values."""
    return table[x & 0xFF] ^ (x >> 8)


@functools.cache
def _crc_cpu_tables(version: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(P, ZC): P[j*256 + v] = R(byte v at position j of a chunk); ZC[b*256 + v] = Z^C(v << 8b)."""
    table = torch.tensor(_crc_table(version), dtype=torch.int64)
    rows = [table]
    for _ in range(_CRC_CHUNK - 1):
        rows.append(_feed_zero_byte(rows[-1], table))
    rows.reverse()
    position = torch.cat(rows)
    values = torch.arange(256, dtype=torch.int64)
    x = torch.cat([values << (8 * b) for b in range(4)])
    for _ in range(_CRC_CHUNK):
        x = _feed_zero_byte(x, table)
    return position, x


def _apply_linear(tables: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A linear map given as four 256-entry byte tables (flattened), applied to int64 x."""
    return (
        tables[x & 0xFF]
        ^ tables[256 + ((x >> 8) & 0xFF)]
        ^ tables[512 + ((x >> 16) & 0xFF)]
        ^ tables[768 + ((x >> 24) & 0xFF)]
    )


@functools.lru_cache(maxsize=16)
def _crc_device_tables(
    device: torch.device, chunks: int, version: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(P, S) on `device` for the CRC of `version`: S[k] are the byte tables of
    Z^(C*(chunks-1-k)), so chunk k's register is shifted past every chunk after it."""
    position, zc = _crc_cpu_tables(version)
    shifts = [torch.cat([torch.arange(256, dtype=torch.int64) << (8 * b) for b in range(4)])]
    for _ in range(chunks - 1):
        shifts.append(_apply_linear(zc, shifts[-1]))
    shifts.reverse()
    s = torch.stack(shifts)
    return position.to(torch.int32).to(device), s.to(torch.int32).to(device)


@functools.lru_cache(maxsize=16)
def _crc_of_zeros(length: int, version: int) -> int:
    return payload_checksum(bytes(length), version=version)


def _xor_fold(x: torch.Tensor) -> torch.Tensor:
    """XOR-reduce the last dimension, whose size is a power of two."""
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] ^ x[..., half:]
    return x[..., 0]


def payload_checksum_torch(data: torch.Tensor, *, version: int = FORMAT_VERSION) -> int:
    """:func:`payload_checksum` of a contiguous uint8 tensor on any device, computed there.

    Equal to ``payload_checksum`` of the same bytes and `version` (``crc32c.crc32c``, or
    ``zlib.crc32`` for version 2).  On CUDA the work runs on the current stream and the
    result is read back with one synchronizing ``.item()``.
    """
    if data.dtype != torch.uint8 or data.dim() != 1 or not data.is_contiguous():
        raise UsageError("data", f"must be a contiguous 1-D uint8 tensor, got {data.dtype} "
                         f"{tuple(data.shape)}")
    length = data.numel()
    if length == 0:
        return 0
    chunks = -(-length // _CRC_CHUNK)
    position, shifts = _crc_device_tables(data.device, chunks, version)
    pad = chunks * _CRC_CHUNK - length
    offsets = torch.arange(_CRC_CHUNK, device=data.device, dtype=torch.int64) * 256
    total = torch.zeros((), dtype=torch.int32, device=data.device)
    for first in range(0, chunks, _CRC_SLICE_CHUNKS):
        last = min(first + _CRC_SLICE_CHUNKS, chunks)
        start = first * _CRC_CHUNK - pad
        stop = last * _CRC_CHUNK - pad
        piece = data[max(start, 0) : stop].to(torch.int64)
        if start < 0:
            piece = torch.cat([piece.new_zeros(-start), piece])
        regs = _xor_fold(position[piece.view(-1, _CRC_CHUNK) + offsets])
        # Bit patterns live in int32; widen with a mask so the shifts below are logical.
        wide = regs.to(torch.int64) & _U32
        rows = shifts[first:last].to(torch.int64)
        shifted = (
            rows.gather(1, (wide & 0xFF).unsqueeze(1))
            ^ rows.gather(1, (256 + ((wide >> 8) & 0xFF)).unsqueeze(1))
            ^ rows.gather(1, (512 + ((wide >> 16) & 0xFF)).unsqueeze(1))
            ^ rows.gather(1, (768 + ((wide >> 24) & 0xFF)).unsqueeze(1))
        ).squeeze(1)
        width = 1 << max(0, (shifted.numel() - 1).bit_length())
        if width != shifted.numel():
            shifted = torch.cat([shifted, shifted.new_zeros(width - shifted.numel())])
        total = total ^ _xor_fold(shifted).to(torch.int32)
    return (int(total.item()) & _U32) ^ _crc_of_zeros(length, version)

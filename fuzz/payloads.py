"""The bytes the fuzz harnesses write as KV, derived from a counter.

Each distinct piece of content (a full block's key, or one request's partly filled block at
one length) gets the next serial number the first time it is seen; its bytes are a fixed
function of that serial and of the byte position.  Nothing is drawn from Hypothesis: drawn
payloads shrink poorly and cost draws on every step, while a counter makes every example's
bytes a deterministic function of its steps.

The pattern varies with the position as well as the serial, so a torn or short transfer that
mixes two contents, or leaves a tail of poison bytes, never matches either content.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

# Multipliers of the pattern: odd constants, so consecutive serials and positions map to
# bytes that differ almost everywhere.
_POSITION_MIX = 0x9E3779B1
_SERIAL_MIX = 0x85EBCA77


class Payloads:
    """Serial numbers for contents, and the bytes of each serial (cached)."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self._serials: dict[Hashable, int] = {}
        self._bytes: dict[int, torch.Tensor] = {}
        self._positions = torch.arange(nbytes, dtype=torch.int64)

    def serial(self, content: Hashable) -> int:
        """The serial of `content` (a new one the first time it is seen)."""
        serial = self._serials.get(content)
        if serial is None:
            serial = len(self._serials) + 1
            self._serials[content] = serial
        return serial

    def known(self, content: Hashable) -> int | None:
        """The serial of `content`, or None if no harness ever wrote it."""
        return self._serials.get(content)

    def bytes_of(self, serial: int) -> torch.Tensor:
        """The uint8 CPU tensor of `nbytes` bytes that content number `serial` consists of."""
        data = self._bytes.get(serial)
        if data is None:
            pos = self._positions
            mixed = (pos + 1) * _POSITION_MIX + serial * _SERIAL_MIX
            mixed = mixed ^ (mixed >> 13) ^ (pos >> 8) * (2 * serial + 1)
            data = (mixed & 0xFF).to(torch.uint8)
            self._bytes[serial] = data
        return data

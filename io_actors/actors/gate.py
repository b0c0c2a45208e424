"""The completion seam: where a finished transfer waits before it is reported.

In production a completion is reported as soon as its bytes are written or complete on the
device.  The fuzz suite passes a gate that holds each completion until a Hypothesis rule
releases it, so that Hypothesis -- not thread timing -- decides which pending write or read
lands next.  The real I/O has already happened when the gate is entered: only the report
waits.
"""

from __future__ import annotations

from typing import Protocol

from statekv.messages import Completion


class CompletionGate(Protocol):
    async def hold(self, completion: Completion) -> None:
        """Return when `completion` may be reported."""


class OpenGate:
    """Reports every completion at once."""

    async def hold(self, completion: Completion) -> None:
        return None

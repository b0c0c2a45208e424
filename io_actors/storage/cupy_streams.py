"""A torch CUDA stream as a cupy stream, so that this package's kernels run in its order.

The batched kernels (page copies, page checksums) are cupy ``RawKernel`` launches that must
queue on the torch stream the copy engine or the serving loop already uses.  cupy 14
deprecates ``cupy.cuda.ExternalStream`` (a warning at every launch) for
``Stream.from_external``, which wraps any object with the CUDA stream protocol
(``__cuda_stream__``); cupy 13, the ``cu12`` extra's floor, has only the former.  Which one a
cupy offers is decided here, once, for every caller.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

_log = logging.getLogger(__name__)
_fallback_said: set[str] = set()
"""Why from_external was refused, once said (a warning at each launch would flood the log)."""


class _StreamHandle:
    """A torch stream under the CUDA stream protocol (version 0: the raw handle).

    cupy keeps a reference to it for as long as its stream lives, so the torch stream is
    kept alive too.
    """

    __slots__ = ("_stream",)

    def __init__(self, stream: torch.cuda.Stream) -> None:
        self._stream = stream

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, int(self._stream.cuda_stream))


def cupy_stream(stream: torch.cuda.Stream) -> Any:
    """The cupy stream for `stream` (on its device): launches under ``with`` it queue there.

    No new CUDA stream is created and nothing is synchronized.
    """
    import cupy

    index = stream.device.index
    with cupy.cuda.Device(index):
        # from_external takes the device that is current: the one entered above.
        from_external = getattr(cupy.cuda.Stream, "from_external", None)
        if from_external is not None:
            try:
                return from_external(_StreamHandle(stream))
            except (AttributeError, TypeError, ValueError) as exc:
                # A cupy whose protocol differs from the one above: the deprecated class
                # still queues the kernels in the right order, so they keep working.
                why = f"{type(exc).__name__}: {exc}"
                if why not in _fallback_said:
                    _fallback_said.add(why)
                    _log.warning("cupy.cuda.Stream.from_external refused a torch stream "
                                 "(%s); using cupy.cuda.ExternalStream", why)
        return cupy.cuda.ExternalStream(stream.cuda_stream, index)

"""The package's kernels queue on the torch stream they are given, with either cupy API.

cupy 14 deprecates ``ExternalStream`` (a DeprecationWarning at every kernel launch) for
``Stream.from_external``; cupy 13, which the ``cu12`` extra admits, has only the former.  The
CPU machine has no cupy: a stand-in module records what was called, on which device.  The
GPU test runs the real one.
"""

from __future__ import annotations

import sys
import types
import warnings
from collections.abc import Iterator
from typing import Any, cast

import pytest
import torch

from io_actors.storage.cupy_streams import cupy_stream


class _TorchStreamStandIn:
    def __init__(self, handle: int, index: int) -> None:
        self.cuda_stream = handle
        self.device = torch.device("cuda", index)


def _stand_in_cupy(*, with_from_external: bool) -> tuple[types.ModuleType, list[Any]]:
    calls: list[Any] = []
    current = [0]

    class Device:
        def __init__(self, index: int) -> None:
            self.index = index

        def __enter__(self) -> None:
            current.append(self.index)

        def __exit__(self, *_exc: object) -> None:
            current.pop()

    class Stream:
        pass

    if with_from_external:
        def from_external(obj: Any) -> tuple[str, Any, int]:
            calls.append(("from_external", obj.__cuda_stream__(), current[-1]))
            return ("stream", obj, current[-1])

        Stream.from_external = staticmethod(from_external)  # type: ignore[attr-defined]

    def external_stream(ptr: int, device_id: int = -1) -> tuple[str, int, int]:
        calls.append(("ExternalStream", ptr, device_id, current[-1]))
        return ("stream", ptr, device_id)

    cuda = types.SimpleNamespace(Device=Device, Stream=Stream, ExternalStream=external_stream)
    module = types.ModuleType("cupy")
    module.cuda = cuda  # type: ignore[attr-defined]
    return module, calls


@pytest.fixture
def no_real_cupy(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delitem(sys.modules, "cupy", raising=False)
    yield


@pytest.mark.parametrize("index", [0, 3])
def test_a_cupy_with_the_stream_protocol_wraps_the_handle_on_the_stream_s_device(
    monkeypatch: pytest.MonkeyPatch, no_real_cupy: None, index: int,
) -> None:
    module, calls = _stand_in_cupy(with_from_external=True)
    monkeypatch.setitem(sys.modules, "cupy", module)
    stream = _TorchStreamStandIn(0xBEEF, index)
    wrapped = cupy_stream(cast(torch.cuda.Stream, stream))
    # Protocol version 0 and the raw handle, with the stream's device current (cupy takes
    # the device id from the current device); the deprecated class is not touched.
    assert calls == [("from_external", (0, 0xBEEF), index)]
    assert wrapped[0] == "stream"


def test_a_cupy_without_it_gets_the_handle_and_the_device_id(
    monkeypatch: pytest.MonkeyPatch, no_real_cupy: None,
) -> None:
    module, calls = _stand_in_cupy(with_from_external=False)
    monkeypatch.setitem(sys.modules, "cupy", module)
    stream = _TorchStreamStandIn(0xCAFE, 2)
    assert cupy_stream(cast(torch.cuda.Stream, stream)) == ("stream", 0xCAFE, 2)
    assert calls == [("ExternalStream", 0xCAFE, 2, 2)]


def test_a_cupy_whose_from_external_refuses_falls_back_and_says_so(
    monkeypatch: pytest.MonkeyPatch, no_real_cupy: None, caplog: pytest.LogCaptureFixture,
) -> None:
    module, calls = _stand_in_cupy(with_from_external=False)

    def refusing(obj: Any) -> None:
        raise TypeError("__cuda_stream__ must return a 2-tuple")

    module.cuda.Stream.from_external = staticmethod(refusing)
    monkeypatch.setitem(sys.modules, "cupy", module)
    monkeypatch.setattr("io_actors.storage.cupy_streams._fallback_said", set())
    stream = _TorchStreamStandIn(0xF00D, 1)
    with caplog.at_level("WARNING", logger="io_actors.storage.cupy_streams"):
        assert cupy_stream(cast(torch.cuda.Stream, stream)) == ("stream", 0xF00D, 1)
        cupy_stream(cast(torch.cuda.Stream, stream))
    assert calls == [("ExternalStream", 0xF00D, 1, 1)] * 2
    # Said once, naming what was refused: not at every launch.
    assert [r.getMessage() for r in caplog.records] == [
        "cupy.cuda.Stream.from_external refused a torch stream (TypeError: __cuda_stream__ "
        "must return a 2-tuple); using cupy.cuda.ExternalStream"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_real_cupy_queues_on_the_torch_stream_without_a_deprecation_warning() -> None:
    cupy = pytest.importorskip("cupy")
    device = torch.device("cuda", torch.cuda.current_device())
    stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        wrapped = cupy_stream(stream)
    assert wrapped.ptr == stream.cuda_stream
    # Ordered on that stream: a cupy fill queued after a torch fill, read back after the
    # stream alone is synchronized, shows the cupy write last.
    out = torch.zeros(1 << 20, dtype=torch.int32, device=device)
    with torch.cuda.stream(stream):
        out.fill_(1)
    with cupy.cuda.Device(device.index), wrapped:
        cupy.from_dlpack(out).fill(7)
    stream.synchronize()
    assert int(out.min()) == 7 and int(out.max()) == 7

"""The kernels' pinned tables: a table is reused only once the stream has passed the kernel
that read it (a table rewritten under a running kernel would send it to other pages)."""

from __future__ import annotations

import pytest
import torch

from io_actors.storage.pinned_tables import PinnedTables

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_a_table_comes_back_only_after_its_kernel_has_run() -> None:
    tables = PinnedTables(capacity=8)
    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    first = tables.table([1, 2, 3])
    assert first.is_pinned() and first[:3].tolist() == [1, 2, 3]
    with torch.cuda.stream(stream):  # a kernel still running when the next table is asked
        torch.cuda._sleep(200_000_000)  # type: ignore[no-untyped-call]
    tables.launched(first, stream)
    second = tables.table([4, 5])
    assert second.data_ptr() != first.data_ptr()
    assert first[:3].tolist() == [1, 2, 3], "a table in use was rewritten"
    tables.launched(second, stream)
    stream.synchronize()
    third = tables.table([6])
    assert third.data_ptr() in (first.data_ptr(), second.data_ptr())
    assert tables.allocated == 2


def test_a_table_longer_than_a_buffer_gets_its_own_and_is_not_kept() -> None:
    tables = PinnedTables(capacity=4)
    stream = torch.cuda.current_stream()
    long = tables.table(list(range(10)))
    assert long.numel() == 10 and long.tolist() == list(range(10))
    tables.launched(long, stream)
    stream.synchronize()
    short = tables.table([7])
    assert short.numel() == 4 and short.data_ptr() != long.data_ptr()
    assert tables.allocated == 2 and tables.in_flight == 0

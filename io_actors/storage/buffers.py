"""Host memory a slot store can hand to the kernel, and byte views of tensors.

O_DIRECT needs page-aligned buffers, and every store (POSIX, kvikio, the shared tier) checks
the tensors it is given and reads their bytes without a copy.  These helpers sit below the
stores and below the memory pools (whose pinned host pool is such a buffer), so that neither
has to import the other for them.
"""

from __future__ import annotations

import ctypes
import mmap

import torch

from statekv.errors import UsageError


def page_aligned_buffer(nbytes: int) -> torch.Tensor:
    """A zeroed uint8 host tensor whose first byte is page aligned (for O_DIRECT).

    Anonymous mmap memory is page aligned and sized exactly; the tensor keeps the mapping
    alive.
    """
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8)


def aligned_within(raw: torch.Tensor, nbytes: int) -> torch.Tensor:
    """The `nbytes` of the uint8 tensor `raw` that start at its first page boundary (`raw`
    holds at least ``nbytes + PAGE - 1`` bytes); the view keeps `raw`'s storage alive."""
    offset = -raw.data_ptr() % mmap.PAGESIZE
    if raw.numel() < offset + nbytes:
        raise ValueError(f"{raw.numel()} bytes cannot hold {nbytes} page-aligned bytes")
    return raw[offset : offset + nbytes]


def pinned_page_aligned_buffer(nbytes: int) -> torch.Tensor:
    """An uninitialized pinned uint8 host tensor whose first byte is page aligned.

    torch's pinned allocator does not promise page alignment: on the H200 machine a host pool
    allocated after other pinned tensors of the process started 2,560 bytes past a page
    boundary, and O_DIRECT cannot transfer into or out of such a buffer -- every spill and
    prefetch of its pages then went through the store's bounce buffer, one slot per call.
    One page more is allocated and the aligned part handed out.
    """
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8, pin_memory=True)
    raw = torch.empty(nbytes + mmap.PAGESIZE - 1, dtype=torch.uint8, pin_memory=True)
    return aligned_within(raw, nbytes)


def host_view(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory (no copy).

    The view does not keep the tensor alive: the caller holds the tensor while it is used.
    """
    nbytes = tensor.numel() * tensor.element_size()
    array = (ctypes.c_ubyte * nbytes).from_address(tensor.data_ptr())
    return memoryview(array).cast("B")


def check_block_tensor(field: str, tensor: object, nbytes: int, *, device_type: str) -> None:
    """raises: UsageError unless `tensor` is a contiguous 1-D uint8 tensor of one block."""
    if not isinstance(tensor, torch.Tensor):
        raise UsageError(field, f"must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != device_type:
        raise UsageError(field, f"must be on {device_type}, got {tensor.device}")
    if tensor.dtype != torch.uint8 or tensor.dim() != 1 or not tensor.is_contiguous():
        raise UsageError(
            field, f"must be a contiguous 1-D uint8 tensor, got {tensor.dtype} "
            f"{tuple(tensor.shape)}"
        )
    if tensor.numel() != nbytes:
        raise UsageError(field, f"must hold one block of {nbytes} bytes, got {tensor.numel()}")

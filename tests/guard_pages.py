"""Tensors that end where the process may not read: a kernel that reads past a tensor's end faults instead of
reading its neighbour silently (Linux; mmap and mprotect through ctypes)."""

import ctypes
import mmap

import numpy as np
import torch


def ending_at_a_guard_page(tensor: torch.Tensor) -> tuple[torch.Tensor, mmap.mmap]:
    """A CPU copy of `tensor` whose last byte is followed by a page the process cannot read; keep the returned map
    alive as long as the copy."""
    nbytes = tensor.numel() * tensor.element_size()
    pages = -(-nbytes // mmap.PAGESIZE)
    memory = mmap.mmap(-1, (pages + 1) * mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    base = ctypes.addressof(ctypes.c_char.from_buffer(memory))
    libc = ctypes.CDLL(None)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if libc.mprotect(base + pages * mmap.PAGESIZE, mmap.PAGESIZE, 0) != 0:
        raise OSError("mprotect refused to guard the page after the tensor")
    raw = torch.from_numpy(np.frombuffer(memory, dtype=np.uint8, count=pages * mmap.PAGESIZE))
    copy = raw[pages * mmap.PAGESIZE - nbytes:].view(tensor.dtype).view(tensor.shape)
    copy.copy_(tensor)
    return copy, memory

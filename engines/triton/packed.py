"""A call's results in one device-to-host copy, and its token ids in one host-to-device copy, both through pinned
host buffers.

Why: around a replayed CUDA graph the host's copies were what the GPU waited on (Qwen3-30B-A3B, 8 x 512 tokens, one
H200, benchmarks/results/e2e.md): the token ids' copy from pageable memory held it idle 0.60 ms before the first
kernel, and four ``.cpu()`` copies of the results (each a pageable copy and a sync) 1.11 ms after the last. Here the
ids go from a pinned buffer with ``non_blocking``, and the results (logprobs, top-k ids, top-k logprobs, router
margin) are packed on the device into one byte tensor -- one kernel, inside the graph when there is one -- that comes
back in one pinned copy and one stream sync. The bytes are the results' own: the numpy views unpacked from them equal
the four separate copies bit for bit.

Without CUDA nothing is staged: the results are already host tensors, read in place as before."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(slots=True)
class Packed:
    """The results of one call: ``data`` (CUDA: one uint8 device tensor holding them all) with where each one lies,
    or ``tensors`` as they are (host tensors, nothing to copy)."""

    data: torch.Tensor | None
    parts: tuple  # per result: None, or (byte offset, numpy dtype, shape)
    tensors: tuple | None = None


@torch.inference_mode()
def pack(outs: tuple) -> Packed:
    """Device tensors (any of them None) -> one packed uint8 tensor. Parts go widest element first, so that every
    part's byte offset is a multiple of its element size (aligned numpy views on the host)."""
    present = [t for t in outs if t is not None]
    if not present or present[0].device.type != "cuda":
        return Packed(None, (), outs)
    return pack_bytes(outs)


def pack_bytes(outs: tuple) -> Packed:
    """The packing itself, on any device (pack uses it on CUDA only)."""
    order = sorted((i for i, t in enumerate(outs) if t is not None), key=lambda i: -outs[i].element_size())
    parts: list[tuple | None] = [None] * len(outs)
    chunks, offset = [], 0
    for i in order:
        t = outs[i].contiguous()
        parts[i] = (offset, torch.empty(0, dtype=t.dtype).numpy().dtype, tuple(t.shape))
        chunks.append(t.view(-1).view(torch.uint8))
        offset += t.numel() * t.element_size()
    return Packed(torch.cat(chunks), tuple(parts))


class Staging:
    """Pinned host buffers of one runtime, grown as calls need (never shrunk). A buffer is reused by the next call:
    ``fetch`` waits for the stream, so the ids copied out of the staging buffer by this call have landed by then."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._ids: torch.Tensor | None = None
        self._out: torch.Tensor | None = None

    @staticmethod
    def _grow(buf: torch.Tensor | None, n: int, dtype: torch.dtype) -> torch.Tensor:
        if buf is None or buf.numel() < n:
            buf = torch.empty(max(n, 2 * (0 if buf is None else buf.numel())), dtype=dtype, pin_memory=True)
        return buf

    def stage(self, ids: np.ndarray) -> torch.Tensor:
        """(T,) int64 host ids -> a tensor to copy to the device from (CUDA: a pinned buffer's first T)."""
        if not self.cuda:
            return torch.from_numpy(ids)
        self._ids = buf = self._grow(self._ids, ids.shape[0], torch.int64)
        staged = buf[: ids.shape[0]]
        staged.numpy()[:] = ids
        return staged

    def fetch(self, packed: Packed) -> tuple:
        """-> the results as numpy arrays (None where a result is None), owned by the caller."""
        if packed.data is None:
            return tuple(t.numpy() if t is not None else None for t in packed.tensors or ())
        n = packed.data.numel()
        self._out = buf = self._grow(self._out, n, torch.uint8)
        host = buf[:n]
        host.copy_(packed.data, non_blocking=True)
        torch.cuda.current_stream(packed.data.device).synchronize()
        return unpack(host.numpy().copy(), packed.parts)  # copied: the next call rewrites the pinned buffer


def unpack(raw: np.ndarray, parts: tuple) -> tuple:
    """Packed host bytes -> one numpy view per result (None where there is none)."""
    return tuple(
        None if p is None else raw[p[0] : p[0] + p[1].itemsize * int(np.prod(p[2]))].view(p[1]).reshape(p[2])
        for p in parts
    )

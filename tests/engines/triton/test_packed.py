"""engines/triton/packed.py: a call's results packed into one byte tensor (one device-to-host copy on CUDA) unpack to
the very bytes of the separate results. The packing runs here on CPU tensors (on CUDA it is the same code plus a
pinned copy, covered by tests/engines/triton/test_engine_gpu.py's replay-equals-eager test)."""

from __future__ import annotations

import numpy as np
import torch

from lpdiff.engines.triton.packed import Staging, pack, pack_bytes, unpack


def _results(n: int, k: int, g: torch.Generator) -> tuple:
    lp = torch.randn(n - 3, generator=g)
    ids = torch.randint(0, 1 << 40, (n - 3, k), generator=g)  # int64 past 32 bits: a wrong width shows
    tk_lp = torch.randn(n - 3, k, generator=g)
    margin = torch.rand(n, generator=g)
    return lp, ids, tk_lp, margin


def test_packed_bytes_unpack_to_each_result_bit_for_bit():
    g = torch.Generator().manual_seed(7)
    for n, k in ((37, 5), (11, 1), (4, 3)):  # odd sizes: a 4-byte part before an 8-byte one would misalign
        outs = _results(n, k, g)
        for present in (outs, (outs[0], None, None, outs[3])):  # top_k 0: no top-k results
            packed = pack_bytes(present)
            got = unpack(packed.data.numpy().copy(), packed.parts)
            for want, have in zip(present, got):
                if want is None:
                    assert have is None
                    continue
                assert have.dtype == want.numpy().dtype and have.shape == tuple(want.shape)
                assert have.tobytes() == want.numpy().tobytes()
                assert have.ctypes.data % have.itemsize == 0  # aligned views


def test_cpu_results_are_read_in_place():
    g = torch.Generator().manual_seed(8)
    outs = _results(9, 2, g)
    packed = pack(outs)
    assert packed.data is None  # nothing to copy on the host
    got = Staging(torch.device("cpu")).fetch(packed)
    assert all(np.array_equal(a, t.numpy()) for a, t in zip(got, outs))
    ids = np.arange(5, dtype=np.int64)
    assert np.array_equal(Staging(torch.device("cpu")).stage(ids).numpy(), ids)

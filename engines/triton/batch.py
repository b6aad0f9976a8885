"""One packed prefill batch: prompts of any lengths concatenated into T tokens (no padding in the GEMMs), plus the
index maps that let attention see it as a right-padded (B, L_max) batch. Right padding is exact for causal
attention: a real query never sees a key after itself, so padded keys never enter its softmax."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from lpdiff.kernels.lora_linear import slot_one_hot


class RopeTables(Protocol):
    """What Batch.build reads of a model's config (ModelConfig, Qwen3.5's and Nemotron-H's configs)."""

    @property
    def rope_inv_freq(self) -> torch.Tensor: ...
    @property
    def rope_attention_scaling(self) -> float: ...


@dataclass(slots=True)
class Batch:
    input_ids: torch.Tensor  # (T,) int64
    positions: torch.Tensor  # (T,) int64, position inside its own prompt
    seq: torch.Tensor  # (T,) int64, prompt index of each token
    lens: list[int]
    cu_seqlens: torch.Tensor  # (B+1,) int32 prompt boundaries in the packed tokens
    token_adapter: torch.Tensor | None  # (T,) int32 slot per token, -1 none; None when no prompt uses an adapter
    cos: torch.Tensor  # (T, head_dim // 2) in the model dtype
    sin: torch.Tensor
    _masks: dict = field(default_factory=dict)
    # the slot of every prompt when they all use one adapter (known on the host, no sync); else None
    uniform_slot: int | None = None
    _slot_masks: dict = field(default_factory=dict)
    # (T - B,) int64: the packed rows that predict a next token (all but each prompt's last), from the host's lengths
    rows: torch.Tensor | None = None
    # device tensors a model derives from the host's lengths (gdn.fla_plan), made by the batch's first forward --
    # the eager warm-up before a CUDA graph capture -- so that the captured forward copies nothing from the host
    plans: dict = field(default_factory=dict)

    @classmethod
    def build(
        cls,
        prompts: Sequence[Sequence[int]],
        slots: list[int],
        cfg: RopeTables,
        dtype: torch.dtype,
        device: torch.device,
    ) -> Batch:
        # index maps in numpy and rope on the device: no torch CPU kernels on the host's path to the first launch
        # (suspected of slowing the launches that follow; not confirmed: benchmarks/results/e2e.md)
        lens = [len(p) for p in prompts]
        n = np.asarray(lens)
        ids = cls.token_ids(prompts)
        positions = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
        seq = np.repeat(np.arange(len(lens)), n)
        adapter = None
        if any(s >= 0 for s in slots):
            adapter = torch.from_numpy(np.repeat(np.asarray(slots, dtype=np.int32), n)).to(device)
        positions = torch.from_numpy(positions).to(device)
        # rope angles in fp32 (as transformers does), scaled by YaRN's factor, then cast to the model dtype; computed
        # where the model runs, as transformers does (on the host they cost a megabyte of pageable copies before the
        # GPU got its first kernel)
        freqs = positions[:, None].float() * cfg.rope_inv_freq.to(device)[None, :]
        cos = (freqs.cos() * cfg.rope_attention_scaling).to(dtype)
        sin = (freqs.sin() * cfg.rope_attention_scaling).to(dtype)
        cu = torch.from_numpy(np.concatenate([[0], np.cumsum(n)]).astype(np.int32)).to(device)
        uniform = slots[0] if adapter is not None and all(s == slots[0] for s in slots) else None
        rows = np.concatenate([np.arange(s, s + k - 1) for s, k in zip(np.cumsum(n) - n, lens)])
        return cls(
            torch.from_numpy(ids).to(device),
            positions,
            torch.from_numpy(seq).to(device),
            lens,
            cu,
            adapter,
            cos,
            sin,
            uniform_slot=uniform,
            rows=torch.from_numpy(rows).to(device),
        )

    @staticmethod
    def token_ids(prompts: Sequence[Sequence[int]]) -> np.ndarray:
        """The packed (T,) int64 token ids, of int lists or of the engine's checked int64 arrays (one concatenate)."""
        if prompts and all(isinstance(p, np.ndarray) for p in prompts):
            return np.concatenate(prompts).astype(np.int64, copy=False)
        return np.fromiter((t for p in prompts for t in p), dtype=np.int64, count=sum(map(len, prompts)))

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def max_len(self) -> int:
        return max(self.lens)

    @property
    def uniform(self) -> bool:
        """All prompts equally long: the padded view is a plain reshape."""
        return min(self.lens) == max(self.lens)

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """(T, ...) -> (B, L_max, ...), zeros after each prompt's end."""
        if self.uniform:
            return x.view(len(self.lens), self.max_len, *x.shape[1:])
        out = x.new_zeros(len(self.lens), self.max_len, *x.shape[1:])
        out[self.seq, self.positions] = x
        return out

    def unpad(self, y: torch.Tensor) -> torch.Tensor:
        """(B, L_max, ...) -> (T, ...)"""
        if self.uniform:
            return y.reshape(self.num_tokens, *y.shape[2:])
        return y[self.seq, self.positions]

    def slot_mask(self, num_slots: int, dtype: torch.dtype) -> torch.Tensor:
        """(T, num_slots) one-hot of token_adapter in ``dtype`` (rows without an adapter all zero), for the dense
        LoRA layers' shrink; built once per batch and shared by every layer."""
        key = (num_slots, dtype)
        if key not in self._slot_masks:
            if self.token_adapter is None:  # no prompt uses an adapter: every row is all zero
                ids = self.input_ids
                self._slot_masks[key] = torch.zeros(ids.shape[0], num_slots, dtype=dtype, device=ids.device)
            else:
                self._slot_masks[key] = slot_one_hot(self.token_adapter, num_slots, dtype)
        return self._slot_masks[key]

    def mask(self, window: int | None, sink: bool) -> torch.Tensor:
        """(L_max, L_max [+1]) bool, True = may attend: causal, within ``window`` keys (query i sees keys
        i-window+1..i, as transformers' sliding mask), and with a leading always-visible sink column."""
        key = (window, sink)
        if key not in self._masks:
            i = torch.arange(self.max_len, device=self.input_ids.device)
            m = i[None, :] <= i[:, None]
            if window is not None:
                m &= i[None, :] > i[:, None] - window
            if sink:
                m = torch.cat([m.new_ones(self.max_len, 1), m], dim=1)
            self._masks[key] = m
        return self._masks[key]

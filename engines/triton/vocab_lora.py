"""What trainers' adapters add beyond the decoder's LoRA slots (lora.py): per-module scalings (rsLoRA with
``rank_pattern`` / ``alpha_pattern``) and LoRA on the vocabulary-sized modules (``lm_head`` and the input
embedding), for every arch the runtime serves.

Per-module scalings are folded into B before stacking (B' = B * s_module / s_adapter in fp32), as vLLM folds its
scaling into B at load: lora.py and the hybrids' stackers then keep one scaling per slot, and a module whose rank is
below the slot's still only fills its own rows and columns of the zero-padded slot (nothing else changes).

Vocabulary LoRA, one slot per adapter (the same slot order as lora.StackedLora), scaling folded into the second
factor, in the run dtype, torch only (these are (T, r) x (r, H|V) products beside a (T, H) x (H, V) head: no kernel):
  embedding  x = E[ids] + A_emb^T[ids] @ (s * B_emb)^T   (PEFT: lora_embedding_A (r, V), lora_embedding_B (H, r))
  lm_head    logits = h @ W^T + (h @ A^T) @ (s * B)^T, inside each chunk of the chunked log-softmax
Each slot's term is masked by the rows' slot (rows without an adapter add exactly zero), with no host sync, so a
CUDA graph captures it. Not sharded under TP: the embedding is replicated on every rank and the head runs on rank 0.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

Tensor = torch.Tensor
HEAD = "lm_head"


def fold_scalings(adapter):
    """A copy of a canonical adapter whose entries all use the adapter's scaling: each entry with its own scaling
    (``scalings``) has it folded into B in fp32. Adapters without per-entry scalings come back as they are."""
    scalings = getattr(adapter, "scalings", None)
    if not scalings:
        return adapter

    def fold(entries: dict) -> dict:
        return {
            k: (a, b.float() * (scalings[k] / adapter.scaling)) if k in scalings else (a, b)
            for k, (a, b) in entries.items()
        }

    return dataclasses.replace(
        adapter, dense=fold(adapter.dense), experts=fold(adapter.experts), embed=fold(adapter.embed), scalings={}
    )


def without_vocab(adapter):
    """The adapter less its lm_head and embedding entries (what the decoder's stackers take)."""
    if HEAD not in adapter.dense and not adapter.embed:
        return adapter
    keep = {k: v for k, v in adapter.dense.items() if k != HEAD}
    scalings = {k: v for k, v in adapter.scalings.items() if k in keep or k in adapter.experts}
    return dataclasses.replace(adapter, dense=keep, embed={}, scalings=scalings)


@dataclass(slots=True)
class VocabLora:
    embed_a: Tensor | None  # (L, V, R): A^T of each slot's embedding LoRA (zero slots for adapters without one)
    embed_b: Tensor | None  # (L, R, H): (s * B)^T
    head_a: Tensor | None  # (L, R, H)
    head_b: Tensor | None  # (L, V, R): s * B

    def nbytes(self) -> int:
        return sum(
            t.numel() * t.element_size()
            for t in (self.embed_a, self.embed_b, self.head_a, self.head_b)
            if t is not None
        )

    def embed_delta(self, ids: Tensor, token_adapter: Tensor | None) -> Tensor | None:
        """(T, H) to add to the embedded tokens, or None when no row of the batch uses an embedding LoRA."""
        embed_a, embed_b = self.embed_a, self.embed_b
        if embed_a is None or embed_b is None or token_adapter is None:
            return None
        out = None
        for k in range(embed_a.shape[0]):
            a = embed_a[k][ids] * (token_adapter == k).unsqueeze(1).to(embed_a.dtype)  # (T, R)
            term = a @ embed_b[k]
            out = term if out is None else out + term
        return out

    def head_logits(self, hidden: Tensor, lm_head: Tensor, slots: Tensor | None):
        """-> logits_fn(s, e) for engines.logprobs.chunked_logprobs: rows s:e of ``hidden`` through the head plus
        each row's slot's lm_head LoRA; None when no lm_head LoRA is stacked or no row has an adapter."""
        head_a, head_b = self.head_a, self.head_b
        if head_a is None or head_b is None or slots is None:
            return None

        def logits(s: int, e: int) -> Tensor:
            h = hidden[s:e]
            out = h @ lm_head.T
            for k in range(head_a.shape[0]):
                u = (h @ head_a[k].T) * (slots[s:e] == k).unsqueeze(1).to(h.dtype)  # (c, R)
                out = out + u @ head_b[k].T
            return out

        return logits


def stack_vocab(adapters: dict, dtype: torch.dtype, device: torch.device) -> VocabLora | None:
    """``adapters``: name -> canonical adapter with scalings folded (fold_scalings), in slot order. None when no
    adapter has vocabulary LoRA."""
    slots = list(adapters.values())
    heads = [a.dense.get(HEAD) for a in slots]
    embeds = [next(iter(a.embed.values()), None) for a in slots]
    if len({n for a in slots for n in a.embed}) > 1:
        raise ValueError(
            f"adapters target several embeddings ({sorted({n for a in slots for n in a.embed})}); the "
            "triton runtime runs LoRA on the input embedding only"
        )

    def stacked(pairs: list, first_t: bool) -> tuple[Tensor | None, Tensor | None]:
        """pairs[k] = (A, B) of slot k or None; scaling of slot k folded into B."""
        got = [(k, p) for k, p in enumerate(pairs) if p is not None]
        if not got:
            return None, None
        R = max(a.shape[0] for _, (a, _) in got)
        a0, b0 = got[0][1]
        A = torch.zeros(len(pairs), R, a0.shape[1], dtype=torch.float32, device=device)
        B = torch.zeros(len(pairs), b0.shape[0], R, dtype=torch.float32, device=device)
        for k, (a, b) in got:
            A[k, : a.shape[0]] = a.float().to(device)
            B[k, :, : b.shape[1]] = b.float().to(device) * float(slots[k].scaling)
        if first_t:  # the embedding: a token gathers its column of A, then expands through B
            return A.transpose(1, 2).contiguous().to(dtype), B.transpose(1, 2).contiguous().to(dtype)
        return A.to(dtype), B.to(dtype)

    embed_a, embed_b = stacked(embeds, True)
    head_a, head_b = stacked(heads, False)
    if embed_a is None and head_a is None:
        return None
    return VocabLora(embed_a, embed_b, head_a, head_b)

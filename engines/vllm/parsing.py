"""vLLM's prompt logprobs -> PromptLogprobs. ``RequestOutput.prompt_logprobs[i]`` maps token ids to ``Logprob`` and
always holds the actual token, so position i gives log p(token[i] | token[:i]) plus the top k; ``top_k=-1`` (or any
k at least the vocabulary size) returns the whole vocabulary, best first. Parsed both as a list of dicts (vLLM 0.25)
and as ``FlatLogprobs`` (0.32)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from lpdiff.harness.types import PromptLogprobs


def vllm_top_k(top_k: int, vocab_size: int) -> int:
    """The engine protocol's top_k -> vLLM's prompt_logprobs: 0 (actual token only), k, or -1 (whole vocab)."""
    if top_k < -1:
        raise ValueError(f"top_k must be -1 (whole vocabulary), 0 or positive, got {top_k}")
    return -1 if top_k == -1 or top_k >= vocab_size else top_k


def _flat_arrays(entries) -> tuple[list[np.ndarray], list[np.ndarray]] | None:
    """FlatLogprobs (vLLM >= 0.3x) keeps every position's (token, logprob) in flat lists: slice them with numpy
    instead of building one dict per position (a whole-vocabulary request would build 150k objects per token)."""
    if not all(hasattr(entries, a) for a in ("start_indices", "end_indices", "token_ids", "logprobs")):
        return None
    ids, lps = np.asarray(entries.token_ids, dtype=np.int64), np.asarray(entries.logprobs, dtype=np.float64)
    spans = list(zip(entries.start_indices, entries.end_indices))
    return [ids[s:e] for s, e in spans], [lps[s:e] for s, e in spans]


def _unique(ids: np.ndarray, lps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Flat rows list the actual token and then the top k, so a token in the top k appears twice (a dict row
    merges them): keep each token once."""
    _, first = np.unique(ids, return_index=True)
    if first.size == ids.size:
        return ids, lps
    first.sort()
    return ids[first], lps[first]


def _dict_arrays(entry) -> tuple[np.ndarray, np.ndarray]:
    if not entry:
        return np.zeros(0, np.int64), np.zeros(0, np.float64)
    ids = np.fromiter(entry.keys(), dtype=np.int64, count=len(entry))
    lps = np.fromiter((lp.logprob for lp in entry.values()), dtype=np.float64, count=len(entry))
    return ids, lps


def parse_routed_experts(num_tokens: int, routed, moe_layers: Sequence[int] | None = None) -> np.ndarray:
    """``CompletionOutput.routed_experts`` -> (num_tokens, L, K) int32 expert ids per prompt token and MoE layer.

    vLLM 0.25.1 (``LLM(enable_return_routed_experts=True)``, outputs.py:45) returns an int array
    ``[seq_len, layers, top_k]`` read from the KV slots of the request's first ``num_tokens - 1`` tokens
    (scheduler ``_get_routed_experts``): with ``max_tokens=1`` the prompt's own tokens. ``moe_layers``: the decoder
    layers that route, where vLLM's layer axis also holds layers without experts (a hybrid's mixers); rows it does
    not give are -1 (only the last prompt token's could be missing, and no logprob position sees that token)."""
    if routed is None:
        raise ValueError(
            "vLLM returned no routed_experts: the engine needs enable_return_routed_experts=True "
            "(engine option capture_routing) and no pipeline parallelism"
        )
    arr = np.asarray(routed)
    if arr.ndim != 3 or arr.shape[0] < num_tokens - 1:
        raise ValueError(
            f"vLLM's routed_experts has shape {arr.shape}; expected [at least {num_tokens - 1} tokens, layers, top_k]"
        )
    if moe_layers is not None and arr.shape[1] != len(moe_layers):
        arr = arr[:, list(moe_layers)]
    out = np.full((num_tokens, *arr.shape[1:]), -1, dtype=np.int32)
    rows = min(num_tokens, arr.shape[0])
    out[:rows] = arr[:rows]
    return out


def parse_prompt_logprobs(token_ids: Sequence[int], entries, top_k: int = 0) -> PromptLogprobs:
    """One ``RequestOutput.prompt_logprobs`` -> PromptLogprobs.

    ``entries[i]`` (i >= 1) holds log p(token | token[:i]) for the actual token[i] and the top-k tokens; entry 0 is
    None (or empty). ``top_k``: 0 none, k the k best (best first), -1 everything returned at each position."""
    n = len(token_ids)
    if entries is None:
        raise ValueError("vLLM returned no prompt logprobs: the request needs SamplingParams(prompt_logprobs=k)")
    if len(entries) != n:
        raise ValueError(f"vLLM returned prompt logprobs for {len(entries)} positions, the prompt has {n} tokens")
    flat = _flat_arrays(entries)
    per_pos = list(zip(*flat)) if flat is not None else [_dict_arrays(entries[i]) for i in range(n)]
    lp = np.empty(n - 1, dtype=np.float32)
    tk_ids, tk_lp = [], []
    for i in range(1, n):
        ids, lps = _unique(*per_pos[i])
        hit = np.flatnonzero(ids == token_ids[i])
        if hit.size == 0:
            raise ValueError(
                f"vLLM's prompt logprobs at position {i} lack the actual token {token_ids[i]} (got {ids.size} entries)"
            )
        lp[i - 1] = lps[hit[0]]
        if top_k:
            order = np.argsort(-lps, kind="stable")
            k = ids.size if top_k == -1 else top_k
            if order.size < k:
                raise ValueError(f"asked for top {k} logprobs, vLLM returned {order.size} at position {i}")
            tk_ids.append(ids[order[:k]])
            tk_lp.append(lps[order[:k]])
    if top_k and len({a.size for a in tk_ids}) > 1:
        raise ValueError("vLLM returned a different number of whole-vocabulary entries per position")
    return PromptLogprobs(
        token_ids=np.asarray(token_ids, dtype=np.int64),
        logprobs=lp,
        topk_ids=np.stack(tk_ids) if top_k else None,
        topk_logprobs=np.stack(tk_lp).astype(np.float32) if top_k else None,
    )


def parse_sample_logprobs(token_ids: Sequence[int], entries) -> np.ndarray:
    """``CompletionOutput.logprobs`` (a list of dicts in vLLM 0.25, FlatLogprobs in 0.32) -> the logprob of each
    generated token (float32). vLLM puts the sampled token in each position's entries beside the top k
    (``SamplingParams(logprobs=0)``: the sampled token alone); with the default logprobs_mode these are the raw
    logits' logprobs, before temperature or top-p."""
    if entries is None:
        raise ValueError("vLLM returned no sample logprobs: the request needs SamplingParams(logprobs=0)")
    flat = _flat_arrays(entries)
    rows = list(zip(*flat)) if flat is not None else [_dict_arrays(e) for e in entries]
    if len(rows) != len(token_ids):
        raise ValueError(f"vLLM returned logprobs for {len(rows)} generated tokens, it generated {len(token_ids)}")
    out = np.empty(len(token_ids), dtype=np.float32)
    for i, (tok, (ids, lps)) in enumerate(zip(token_ids, rows)):
        hit = np.flatnonzero(ids == int(tok))
        if hit.size == 0:
            raise ValueError(f"vLLM's logprobs for generated position {i} do not hold the sampled token {tok}")
        out[i] = lps[hit[0]]
    return out

"""The hf reference engine's decode: transformers + PEFT generating with the KV cache, one prompt at a time (no
padding: every token's position and cache are those of a lone request), logprobs = log_softmax of the raw logits
in fp32 (no temperature, top-p or penalty: ``generate``'s logits processors are not involved, so what is reported is
the model's own distribution). Greedy takes the argmax; seeded draws from that raw distribution (temperature 1) with
a CPU/GPU generator seeded ``seed + i`` for prompt i. Exactly ``max_new_tokens`` are generated (EOS does not stop).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from lpdiff.engines.base import Generated


@torch.inference_mode()
def hf_decode(
    engine, prompts: Sequence[Sequence[int]], names: Sequence[str | None], max_new_tokens: int, sampling: str, seed: int
) -> list[Generated]:
    """``engine``: an open HFEngine; ``names``: one adapter (or None) per prompt."""
    out: list[Generated | None] = [None] * len(prompts)
    for name in dict.fromkeys(names):
        with engine._adapter_ctx(name):
            for i in (i for i, n in enumerate(names) if n == name):
                out[i] = _one(engine, [int(t) for t in prompts[i]], max_new_tokens, sampling, seed + i)
    done = [g for g in out if g is not None]
    assert len(done) == len(out), "every prompt's adapter group ran"
    return done


def raw_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """The model's own next-token distribution: log_softmax of the raw logits in fp32, nothing applied."""
    return torch.log_softmax(logits.float(), dim=-1)


def _one(engine, prompt: list[int], n: int, sampling: str, seed: int) -> Generated:
    gen = torch.Generator(device=engine.device).manual_seed(seed) if sampling == "seeded" else None
    # the LM with PEFT's layers injected in place (lm_head LoRA included): the active adapter applies
    step = engine.lm(input_ids=torch.tensor([prompt], device=engine.device), use_cache=True, logits_to_keep=1)
    tokens, lps = [], []
    for k in range(n):
        lp = raw_logprobs(step.logits[0, -1])
        tok = int(lp.argmax()) if gen is None else int(torch.multinomial(lp.exp(), 1, generator=gen))
        tokens.append(tok)
        lps.append(float(lp[tok]))
        if k + 1 < n:
            step = engine.lm(
                input_ids=torch.tensor([[tok]], device=engine.device),
                past_key_values=step.past_key_values,
                use_cache=True,
            )
    return Generated(prompt, tokens, np.asarray(lps, dtype=np.float32))

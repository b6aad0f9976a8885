"""One rank's loaded model: weights + stacked adapters + the decoder, and the work of one call
(pack prompts, forward, and on rank 0 the chunked log-softmax)."""
from __future__ import annotations

import numpy as np
import torch

from engines.base import EngineConfig
from engines.triton.batch import Batch
from engines.triton.config import model_config
from engines.triton.engine import OPTIONS
from engines.triton.loader import open_source
from engines.triton.lora import fold_qkv_lora, stack_adapters
from engines.triton.model import MoeTransformer
from engines.triton.shard import Shard
from engines.triton.weights import load_weights
from harness.logprobs import chunked_logprobs
from harness.types import PromptLogprobs

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def set_fp32_precision(dtype: torch.dtype, device: torch.device) -> None:
    """fp32 mode means IEEE fp32 in every torch matmul (tf32 noise is the size of a small bug)."""
    if dtype == torch.float32 and device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False


class Runtime:
    def __init__(self, config: EngineConfig, shard: Shard, device: torch.device, all_reduce, impl: str = "auto",
                 logit_chunk: int = 1024, attention_impl: str = "auto"):
        self.dtype, self.device, self.shard = DTYPES[config.dtype], device, shard
        self.logit_chunk = logit_chunk
        set_fp32_precision(self.dtype, device)
        hf, source = open_source(config.model, self.dtype, device)
        self.cfg = model_config(hf, config.model.num_layers)
        self.weights = load_weights(self.cfg, source, shard, self.dtype, device)
        del source  # drops whatever the model did not use (lm_head of a tied model, layers past num_layers)
        adapters = {}
        if config.adapters:
            from harness.adapters import load_canonical

            adapters = {name: load_canonical(spec.path, hf) for name, spec in config.adapters.items()}
        self.lora = stack_adapters(self.cfg, adapters, shard, self.dtype, device)
        fold_qkv_lora(self.weights, self.lora)
        # read from the config, so that tensor-parallel workers (tp.worker_main) pick the same backend
        moe_backend = config.options.get("moe_backend", OPTIONS["moe_backend"])
        self.model = MoeTransformer(self.cfg, self.weights, self.lora, shard, all_reduce, impl, attention_impl,
                                    moe_backend)

    def slot(self, name: str | None) -> int:
        return -1 if name is None else self.lora.slot(name)

    def run(self, prompts: list[list[int]], slots: list[int], top_k: int) -> list[PromptLogprobs] | None:
        """Forward one packed batch; rank 0 returns the logprobs, other ranks only take part."""
        batch = Batch.build(prompts, slots, self.cfg, self.dtype, self.device)
        hidden, margin = self.model.forward(batch)
        if not self.shard.first:
            return None
        # rows that predict a next token (all but each prompt's last), from the host's lengths: no device sync
        starts = np.cumsum([0, *batch.lens[:-1]])
        sel = torch.from_numpy(np.concatenate([np.arange(s, s + n - 1) for s, n in zip(starts, batch.lens)]))
        sel = sel.to(self.device)
        lp, tk_ids, tk_lp = chunked_logprobs(hidden[sel], self.weights.lm_head, batch.input_ids[sel + 1], top_k,
                                             self.logit_chunk, fused=True)
        lp, margin = lp.cpu().numpy(), margin.cpu().numpy()
        tk_ids = tk_ids.cpu().numpy() if top_k else None
        tk_lp = tk_lp.cpu().numpy() if top_k else None
        out, tok, pos = [], 0, 0
        for p, n in zip(prompts, batch.lens):
            s = slice(pos, pos + n - 1)
            out.append(PromptLogprobs(token_ids=np.asarray(p, dtype=np.int64), logprobs=lp[s],
                                      topk_ids=tk_ids[s] if top_k else None,
                                      topk_logprobs=tk_lp[s] if top_k else None,
                                      router_margin=margin[tok:tok + n]))
            tok, pos = tok + n, pos + n - 1
        return out

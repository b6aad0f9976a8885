"""``hf``: the reference engine — transformers + PEFT, exactly as a user would load them.

Prompts are grouped by adapter and run in right-padded batches (right padding keeps every real token's position,
causal context and recurrent state — Mamba / linear attention — identical to an unpadded run). Logprobs come from
the decoder's final hidden states through ``chunked_logprobs``, so the batch's full fp32 logits never exist.

Options (``EngineConfig.options``):
  experts_impl       "grouped_mm" | "batched_mm" | "eager" (transformers' expert kernel; default: the model's)
  max_batch_tokens   padded tokens per forward (default 8192)
  logit_chunk        rows per log-softmax chunk (default 1024)
  router_margins     record each token's smallest top-k routing margin over MoE layers (default True)
"""
from __future__ import annotations

import gc
import time
from contextlib import nullcontext
from typing import Sequence

import numpy as np
import torch

from lpdiff.engines.base import AdapterChoice, EngineConfig, check_request
from lpdiff.engines.logprobs import chunked_logprobs
from lpdiff.harness.spec.routing import RouterMarginRecorder
from lpdiff.harness.types import PromptLogprobs

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def default_device(device: str | None) -> torch.device:
    return torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))


class HFEngine:
    name = "hf"

    def __init__(self, config: EngineConfig):
        if config.tp != 1:
            raise ValueError("the hf engine runs on one device (tp=1); use engine 'triton' for tensor parallelism")
        self.config = config
        self.model = None  # the PeftModel (or the bare model when no adapter is given)
        # PEFT adapter names become module names (no '.'): lpdiff's names ("all.peft3d") map to slot names
        self.peft_names = {name: f"adapter{i}" for i, name in enumerate(config.adapters or {})}
        self.device = default_device(config.device)
        opts = dict(config.options)
        self.experts_impl = opts.pop("experts_impl", None)
        self.max_batch_tokens = int(opts.pop("max_batch_tokens", 8192))
        self.logit_chunk = int(opts.pop("logit_chunk", 1024))
        self.record_margins = bool(opts.pop("router_margins", True))
        if opts:
            raise ValueError(f"unknown hf engine options {sorted(opts)}; known: experts_impl, max_batch_tokens, "
                             "logit_chunk, router_margins")

    # -- lifecycle -------------------------------------------------------------------------------------------
    def __enter__(self) -> "HFEngine":
        from lpdiff.harness.spec.catalog import load_hf_model

        if self.config.dtype == "float32" and self.device.type == "cuda":
            # fp32 verdicts need IEEE fp32: tf32 would add noise the size of a small bug.
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cudnn.allow_tf32 = False
        model = load_hf_model(self.config.model, _DTYPES[self.config.dtype], self.device)
        if self.experts_impl:
            model.set_experts_implementation(self.experts_impl)
        if self.config.adapters:
            from peft import PeftModel

            specs = list(self.config.adapters.items())
            model = PeftModel.from_pretrained(model, specs[0][1].path, adapter_name=self.peft_names[specs[0][0]],
                                              is_trainable=False)
            for name, spec in specs[1:]:
                model.load_adapter(spec.path, adapter_name=self.peft_names[name], is_trainable=False)
        self.model = model.eval()
        self.lm = model.get_base_model() if self.config.adapters else model
        self.decoder = self.lm.get_decoder()
        self.margins = RouterMarginRecorder(self.lm) if self.record_margins else None
        return self

    def __exit__(self, *exc) -> None:
        if self.margins is not None:
            self.margins.remove()
        self.model = self.lm = self.decoder = self.margins = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def version(self) -> str:
        import peft
        import transformers

        return f"transformers {transformers.__version__}, peft {peft.__version__}, torch {torch.__version__}"

    # -- work ------------------------------------------------------------------------------------------------
    def _adapter_ctx(self, name: str | None):
        if not self.config.adapters:
            return nullcontext()
        if name is None:
            return self.model.disable_adapter()
        self.model.set_adapter(self.peft_names[name])
        return nullcontext()

    @torch.inference_mode()
    def prompt_logprobs(self, prompts: Sequence[Sequence[int]], adapter: AdapterChoice = None,
                        top_k: int = 0) -> list[PromptLogprobs]:
        if self.model is None:
            raise RuntimeError("use the engine as a context manager: `with open_engine('hf', cfg) as eng:`")
        names = check_request(prompts, adapter, self.config.adapters)
        out: list[PromptLogprobs | None] = [None] * len(prompts)
        t0 = time.perf_counter()
        for name in dict.fromkeys(names):  # groups in first-seen order
            idx = [i for i, n in enumerate(names) if n == name]
            with self._adapter_ctx(name):
                for batch in _batches(idx, prompts, self.max_batch_tokens):
                    for i, res in zip(batch, self._forward([prompts[i] for i in batch], top_k)):
                        out[i] = res
        self.last_wall_s = time.perf_counter() - t0
        return out  # type: ignore[return-value]

    def _forward(self, prompts: list[Sequence[int]], top_k: int) -> list[PromptLogprobs]:
        lens = [len(p) for p in prompts]
        n, T = len(prompts), max(lens)
        ids = torch.zeros(n, T, dtype=torch.long)
        mask = torch.zeros(n, T, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, : len(p)] = torch.as_tensor(list(p), dtype=torch.long)
            mask[i, : len(p)] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        if self.margins is not None:
            self.margins.start()
        hidden = self.decoder(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
        margins = self.margins.stop(n, T) if self.margins is not None else None
        # rows of real positions that predict a next token: (prompt i, position j < len-1)
        sel = torch.cat([torch.arange(L - 1) + i * T for i, L in enumerate(lens)]).to(self.device)
        targets = ids.reshape(-1)[sel + 1]  # row i*T + j predicts token (i, j + 1)
        head = self.lm.get_output_embeddings()
        lp, tk_ids, tk_lp = chunked_logprobs(hidden.reshape(n * T, -1)[sel], head.weight, targets, top_k,
                                             self.logit_chunk, getattr(head, "bias", None))
        res, off = [], 0
        for i, L in enumerate(lens):
            s = slice(off, off + L - 1)
            off += L - 1
            res.append(PromptLogprobs(
                token_ids=np.asarray(prompts[i], dtype=np.int64),
                logprobs=lp[s].cpu().numpy(),
                topk_ids=tk_ids[s].cpu().numpy() if top_k else None,
                topk_logprobs=tk_lp[s].cpu().numpy() if top_k else None,
                router_margin=margins[i, :L] if margins is not None else None,
            ))
        return res


def _batches(idx: list[int], prompts: Sequence[Sequence[int]], max_tokens: int):
    """Split prompt indices into batches whose padded size (n x longest) stays within max_tokens."""
    batch: list[int] = []
    longest = 0
    for i in sorted(idx, key=lambda i: -len(prompts[i])):
        L = len(prompts[i])
        if batch and (len(batch) + 1) * max(longest, L) > max_tokens:
            yield batch
            batch, longest = [], 0
        batch.append(i)
        longest = max(longest, L)
    if batch:
        yield batch

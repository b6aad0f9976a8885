"""One rank's loaded model: weights + stacked adapters + the decoder, and the work of one call
(pack prompts, forward, and on rank 0 the chunked log-softmax)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lpdiff.engines.base import EngineConfig
from lpdiff.engines.logprobs import chunked_logprobs
from lpdiff.engines.triton.archs import hybrid_module, model_config
from lpdiff.engines.triton.batch import Batch
from lpdiff.engines.triton.graphs import GraphCache
from lpdiff.engines.triton.loader import open_source
from lpdiff.engines.triton.lora import fold_o_lora, fold_qkv_lora, stack_adapters
from lpdiff.engines.triton.model import MoeTransformer
from lpdiff.engines.triton.options import TritonOptions
from lpdiff.engines.triton.packed import Packed, Staging
from lpdiff.engines.triton.packed import pack as _pack
from lpdiff.engines.triton.shard import Shard
from lpdiff.engines.triton.vocab_lora import fold_scalings, stack_vocab, without_vocab
from lpdiff.engines.triton.weights import load_weights
from lpdiff.harness.spec.adapters import load_canonical
from lpdiff.harness.types import PromptLogprobs

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def set_fp32_precision(dtype: torch.dtype, device: torch.device) -> None:
    """fp32 mode means IEEE fp32 in every torch matmul (tf32 noise is the size of a small bug)."""
    if dtype == torch.float32 and device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False


class Runtime:
    def __init__(self, config: EngineConfig, options: TritonOptions, shard: Shard, device: torch.device, all_reduce):
        self.dtype, self.device, self.shard = DTYPES[config.dtype], device, shard
        self.logit_chunk = options.logit_chunk
        set_fp32_precision(self.dtype, device)
        hf, source = open_source(config.model, self.dtype, device)
        self.graphs: GraphCache | None = None
        self._staging = Staging(device)
        hybrid = hybrid_module(hf)
        # per-module scalings folded into B, vocabulary LoRA stacked apart (vocab_lora.py); the stackers get the rest
        adapters = {name: fold_scalings(load_canonical(spec.path, hf)) for name, spec in config.adapters.items()}
        self.vocab = stack_vocab(adapters, self.dtype, device)
        adapters = {name: without_vocab(a) for name, a in adapters.items()}
        if hybrid is not None:  # an arch whose module builds the whole model (archs.HYBRIDS, archs.Built)
            # a hybrid module that adds embedding LoRA itself says so (EMBEDDING_LORA) and its model takes ``vocab``
            if (
                self.vocab is not None
                and self.vocab.embed_a is not None
                and not getattr(hybrid, "EMBEDDING_LORA", False)
            ):
                raise ValueError(
                    "embed_tokens LoRA on a hybrid arch: the triton runtime runs embedding LoRA on "
                    "qwen3_moe, gpt_oss and nemotron_h only; judge that adapter on the hf engine"
                )
            built = hybrid.build(hf, source, adapters, shard, self.dtype, device, all_reduce, options)
            del source
            self.cfg, self.weights, self.lora, self.model = built.cfg, built.weights, built.lora, built.model
            if getattr(hybrid, "EMBEDDING_LORA", False):
                self.model.vocab = self.vocab
            self._graph_cache(options, device, shard)
            return
        self.cfg = model_config(hf, config.model.num_layers)
        self.weights = load_weights(self.cfg, source, shard, self.dtype, device)
        del source  # drops whatever the model did not use (lm_head of a tied model, layers past num_layers)
        self.lora = stack_adapters(self.cfg, adapters, shard, self.dtype, device)
        fold_qkv_lora(self.weights, self.lora)
        fold_o_lora(self.weights, self.lora, shard)
        self.model = MoeTransformer(
            self.cfg,
            self.weights,
            self.lora,
            shard,
            all_reduce,
            options.impl,
            options.attention,
            options.moe_backend,
            options.moe_shrink,
            options.moe_padding,
        )
        self.model.vocab = self.vocab
        self._graph_cache(options, device, shard)

    def _graph_cache(self, options: TritonOptions, device: torch.device, shard: Shard) -> None:
        """CUDA graphs of whole calls at TP 1 (under TP the all-reduces would have to be captured too: not done).
        The hybrids too: their forwards read no device value on the host either (Qwen3.5's fla delta rule takes
        chunk indices made from the host's lengths once per batch, gdn.fla_plan; Nemotron-H's conv and scans take
        cu_seqlens / seq_idx as device tensors and size their grids from host shapes); a layout whose capture fails
        anyway is refused for good and runs eagerly (graphs.py)."""
        if options.cuda_graphs and device.type == "cuda" and shard.size == 1:
            self.graphs = GraphCache(options.cuda_graphs, torch.cuda.graph_pool_handle())

    def slot(self, name: str | None) -> int:
        return -1 if name is None else self.lora.slot(name)

    def run(self, prompts: Sequence[Sequence[int]], slots: list[int], top_k: int) -> list[PromptLogprobs] | None:
        """Forward one packed batch (prompts as int lists or the engine's checked int64 arrays); rank 0 returns the
        logprobs, other ranks only take part. A layout seen before replays its CUDA graph (graphs.py) with these
        prompts' token ids."""
        key = self.layout(prompts, slots, top_k)
        graphs = self.graphs if self.model.capture is None else None  # lpdiff bisect's capture runs eagerly
        entry = graphs.get(key) if graphs is not None else None
        ids = Batch.token_ids(prompts)
        if entry is not None:
            batch, packed = entry.batch, entry.packed
            # pinned staging + async copy: a pageable copy held the GPU idle 0.6 ms before the first kernel (Qwen3,
            # 8 x 512 tokens, H200); the staging buffer is free again once this call's results are fetched below
            batch.input_ids.copy_(self._staging.stage(ids), non_blocking=True)
            entry.graph.replay()
        else:
            batch = Batch.build(prompts, slots, self.cfg, self.dtype, self.device)
            if graphs is not None and graphs.want(key):
                entry = graphs.capture(key, lambda: self._capture(batch, top_k, graphs.pool))
            packed = entry.packed if entry is not None else _pack(self._compute(batch, top_k))
        if not self.shard.first:
            return None
        lp, tk_ids, tk_lp, margin = self._staging.fetch(packed)
        out, tok, pos = [], 0, 0
        for n in batch.lens:
            s = slice(pos, pos + n - 1)
            out.append(
                PromptLogprobs(
                    token_ids=ids[tok : tok + n],
                    logprobs=lp[s],
                    topk_ids=tk_ids[s] if top_k else None,
                    topk_logprobs=tk_lp[s] if top_k else None,
                    router_margin=margin[tok : tok + n],
                )
            )
            tok, pos = tok + n, pos + n - 1
        return out

    @staticmethod
    def layout(prompts: Sequence[Sequence[int]], slots: list[int], top_k: int) -> tuple:
        """What a CUDA graph of a call is keyed on: everything but the token ids (graphs.py)."""
        return tuple(map(len, prompts)), tuple(slots), top_k

    @torch.inference_mode()
    def _compute(self, batch: Batch, top_k: int) -> tuple:
        """-> device tensors (logprobs, top-k ids, top-k logprobs, router margin); the ones a rank does not make
        are None. No host sync: a CUDA graph can capture it."""
        hidden, margin = self.model.forward(batch)
        if not self.shard.first:
            return None, None, None, None
        rows = batch.rows
        assert rows is not None  # Batch.build sets it
        h = hidden[rows]
        head = (
            None
            if self.vocab is None or batch.token_adapter is None
            else self.vocab.head_logits(h, self.weights.lm_head, batch.token_adapter[rows])
        )
        lp, tk_ids, tk_lp = chunked_logprobs(
            h, self.weights.lm_head, batch.input_ids[rows + 1], top_k, self.logit_chunk, fused=True, logits_fn=head
        )
        return lp, tk_ids, tk_lp, margin

    def _capture(self, batch: Batch, top_k: int, pool) -> Captured:
        """Warm up on a side stream (lazy library set-up must not happen inside the capture), capture, replay once
        (the capture itself computes nothing)."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self._compute(batch, top_k)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            packed = _pack(self._compute(batch, top_k))  # the packing is one more kernel of the graph
        graph.replay()
        return Captured(graph, batch, packed)


@dataclass(slots=True)
class Captured:
    graph: torch.cuda.CUDAGraph
    batch: Batch  # the captured inputs: replays copy new token ids into batch.input_ids
    packed: Packed  # _compute's outputs as packed inside the capture, rewritten by every replay

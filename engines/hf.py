"""``hf``: the reference engine — transformers + PEFT, loaded as a user would (a per-expert file converted first).

Prompts are grouped by adapter and run in right-padded batches (right padding keeps every real token's position,
causal context and recurrent state — Mamba / linear attention — identical to an unpadded run). Logprobs come from
the decoder's final hidden states through ``chunked_logprobs``, so the batch's full fp32 logits never exist.

Per-expert adapters (``experts.{e}.gate_proj ...``) are converted exactly to PEFT 3D (``convert_adapter``) in a
temporary directory before PEFT loads them: on transformers 5's fused expert modules PEFT 0.21 itself converts them
only for qwen3_moe, refuses an experts-only one on gpt_oss, and silently drops the routed experts elsewhere
(``lpdiff doctor`` tells that as info, for whoever loads the file with PEFT directly).

Options (``EngineConfig.options``):
  experts_impl       "grouped_mm" | "batched_mm" | "eager" (transformers' expert kernel; default: the model's)
  max_batch_tokens   padded tokens per forward (default 8192)
  logit_chunk        rows per log-softmax chunk (default 1024)
  router_margins     record each token's smallest top-k routing margin over MoE layers (default True)
  capture_routing    return each token's expert ids, top-k margin and weights per MoE layer (default False)

``prompt_logprobs(..., routing=[ids per prompt])`` replays given expert ids (routing replay, harness/spec/routing.py).
"""

from __future__ import annotations

import gc
import tempfile
import time
from collections.abc import Sequence
from contextlib import nullcontext
from typing import Any

import numpy as np
import torch

from lpdiff.engines.base import AdapterChoice, Decoding, EngineConfig, check_adapters, check_request
from lpdiff.engines.capabilities import Capabilities, KnownDefect, Mode
from lpdiff.engines.hf_torch_paths import modeling_modules, torch_paths
from lpdiff.engines.logprobs import chunked_logprobs
from lpdiff.harness.spec.errors import InputError
from lpdiff.harness.spec.routing import RouterMarginRecorder, forced_ids
from lpdiff.harness.types import PromptLogprobs

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_PEFT = "PEFT 0.21, transformers 5"
# PEFT 0.21 + transformers 5 loading a per-expert adapter (experts.{e}.gate_proj ...) itself: converts it to the
# fused experts for qwen3_moe, drops its routed-expert tensors silently for these (on gpt_oss it refuses an
# experts-only file), tests/harness/commands/test_doctor.py checks both against real PEFT. This engine converts
# every per-expert file to PEFT 3D first (_as_peft3d), so it reads the layout on every arch: the per-expert defects
# are info, told to whoever loads the file with PEFT directly. The converted config names only modules with tensors,
# so PEFT wraps none without weights: the peft-*-modules defects are for files PEFT loads as they are.
_PEFT_IGNORES_PER_EXPERT = ("qwen3_5_moe", "qwen3_5_moe_text", "nemotron_h", "gpt_oss")
_CONVERTS = "lpdiff's hf engine converts it to PEFT 3D before PEFT loads it"
_DIRECT = "none for lpdiff; loading the file with PEFT yourself, convert it first: {to_peft3d}"

CAPABILITIES = Capabilities(
    engine="hf",
    label="HF+PEFT",
    versions=_PEFT,
    archs=None,
    layouts=("peft3d", "per_expert"),
    dtypes=tuple(_DTYPES),
    lora_fp32=True,
    max_rank=None,
    max_moe_rank=None,
    tp=(1,),
    modes=tuple(
        Mode(f"experts_{impl}", {"experts_impl": impl}, ("experts",)) for impl in ("eager", "batched_mm", "grouped_mm")
    ),
    router_lora="peft",
    per_layer_capture=True,
    adapter_doctor=True,
    peft_sessions=True,
    mixed_batches=False,  # prompt_logprobs runs each adapter's rows (and the base rows) as their own batches
    routing_replay=True,
    # two expert kernels: batched_mm on CPU (as the tiny zoo's calibration), grouped_mm on a GPU, where batched_mm
    # gathers every token's expert weights (192 GiB at Qwen3-30B-A3B width, measured OOM)
    fp32_twins=({"experts_impl": "batched_mm"}, {"experts_impl": "eager"}),
    fp32_twins_cuda=({"experts_impl": "grouped_mm"}, {"experts_impl": "eager"}),
    prefill_step=8192,
    prefill_step_option=("max_batch_tokens",),  # padded tokens per forward (HFEngine's default)
    known_defects=(
        KnownDefect(
            "per-expert-ignored-by-peft",
            f"per-expert adapter on {{arch}}: {_CONVERTS}; PEFT alone loads "
            "none of its expert tensors (drops them silently, or refuses the file where its targets match no "
            "other module)",
            _DIRECT,
            _PEFT,
            archs=_PEFT_IGNORES_PER_EXPERT,
            layouts=("per_expert",),
            severity="info",
        ),
        KnownDefect(
            "per-expert-converted-by-peft",
            f"per-expert adapter on {{arch}}: {_CONVERTS}; PEFT alone converts it to the fused experts on load too",
            "none needed",
            _PEFT,
            archs=("qwen3_moe",),
            layouts=("per_expert",),
            severity="info",
        ),
        KnownDefect(
            "per-expert-unknown",
            f"per-expert adapter on {{arch}}: {_CONVERTS}; whether PEFT alone loads it is not known to lpdiff",
            _DIRECT,
            _PEFT,
            layouts=("per_expert",),
            severity="info",
            when="no per-expert entry for this arch",
        ),
        KnownDefect(
            "peft-mamba-refused",
            "PEFT refuses LoRA on Mamba out_proj/conv1d on {arch} ({error})",
            "drop out_proj and conv1d from target_modules; target the mixer's in_proj",
            _PEFT,
            when="PEFT raises 'incompatible with Mamba'",
        ),
        KnownDefect(
            "peft-refused",
            "PEFT refuses this adapter on {arch}{router}: {error}",
            "remove the targets PEFT names from the adapter's config",
            _PEFT,
            when="PEFT raises",
        ),
        KnownDefect(
            "peft-random-init-modules",
            "PEFT wraps {where} but the adapter has no weights for them, and "
            "init_lora_weights=false leaves them random: the reference gets a random extra adapter",
            "set init_lora_weights to true in adapter_config.json (missing modules then start at B = 0)",
            _PEFT,
            when="targets match modules without tensors, init_lora_weights=false, not per-expert",
        ),
        KnownDefect(
            "peft-empty-modules",
            "PEFT wraps {where} but the adapter has no weights for them: they stay at zero (no effect)",
            "name only the modules the adapter holds in target_modules",
            _PEFT,
            severity="warning",
            when="targets match modules without tensors, not per-expert",
        ),
    ),
)


def default_device(device: str | None) -> torch.device:
    return torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))


class HFEngine:
    name = "hf"

    def __init__(self, config: EngineConfig):
        if config.tp != 1:
            raise InputError("the hf engine runs on one device (tp=1); use engine 'triton' for tensor parallelism")
        self.config = config
        # while entered: the PeftModel (or the bare model when no adapter is given), the transformers model under
        # it, its decoder stack and the router hooks
        self.model: Any = None
        self.lm: Any = None
        self.decoder: Any = None
        self.margins: RouterMarginRecorder | None = None
        # PEFT adapter names become module names (no '.'): lpdiff's names ("all.peft3d") map to slot names
        self.peft_names = {name: f"adapter{i}" for i, name in enumerate(config.adapters or {})}
        self.device = default_device(config.device)
        opts = dict(config.options)
        self.experts_impl = opts.pop("experts_impl", None)
        self.max_batch_tokens = int(opts.pop("max_batch_tokens", 8192))
        self.logit_chunk = int(opts.pop("logit_chunk", 1024))
        self.record_margins = bool(opts.pop("router_margins", True))
        self.capture_routing = bool(opts.pop("capture_routing", False))
        self.torch_only: tuple = ()  # modeling modules whose sequence ops run their torch path (fp32)
        if opts:
            raise InputError(
                f"unknown hf engine options {sorted(opts)}; known: experts_impl, max_batch_tokens, "
                "logit_chunk, router_margins, capture_routing"
            )

    # -- lifecycle -------------------------------------------------------------------------------------------
    def __enter__(self) -> HFEngine:
        from lpdiff.harness.spec.catalog import load_hf_model

        check_adapters(self.config, self.name)
        if self.config.dtype == "float32" and self.device.type == "cuda":
            # fp32 verdicts need IEEE fp32: tf32 would add noise the size of a small bug.
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cudnn.allow_tf32 = False
        model = load_hf_model(self.config.model, _DTYPES[self.config.dtype], self.device)
        if self.experts_impl:
            model.set_experts_implementation(self.experts_impl)
        if self.config.adapters:
            model = self._load_adapters(model)
        self.model = model.eval()
        # fp32 runs call transformers' torch delta rule / conv / Mamba scans, never fla's or mamba_ssm's Triton
        # kernels, whose fp32 dots run at TF32 (k2 1.75e-5 against an fp32 threshold of 7.6e-7 on Qwen3.5-35B-A3B
        # with fla-core 0.5.2 on an H200): engines/hf_torch_paths.py
        self.torch_only = modeling_modules(model) if self.config.dtype == "float32" else ()
        self.lm = model.get_base_model() if self.config.adapters else model
        self.decoder = self.lm.get_decoder()
        self.margins = RouterMarginRecorder(self.lm, capture=self.capture_routing)
        return self

    def _load_adapters(self, model):
        from peft import PeftModel

        with tempfile.TemporaryDirectory(prefix="lpdiff-hf-peft3d-") as tmp:  # PEFT copies the tensors on load
            paths = {
                name: _as_peft3d(spec.path, tmp, i, model.config)
                for i, (name, spec) in enumerate(self.config.adapters.items())
            }
            (first, path), *rest = paths.items()
            model = PeftModel.from_pretrained(model, path, adapter_name=self.peft_names[first], is_trainable=False)
            for name, path in rest:
                model.load_adapter(path, adapter_name=self.peft_names[name], is_trainable=False)
        return model

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
    def prompt_logprobs(
        self,
        prompts: Sequence[Sequence[int]],
        adapter: AdapterChoice = None,
        top_k: int = 0,
        routing: Sequence[np.ndarray] | None = None,
    ) -> list[PromptLogprobs]:
        """``routing``: per prompt, (tokens, MoE layers, top_k) expert ids to force (routing replay)."""
        if self.model is None:
            raise RuntimeError("use the engine as a context manager: `with open_engine('hf', cfg) as eng:`")
        names = check_request(prompts, adapter, self.config.adapters, self.config.model)
        out: list[PromptLogprobs | None] = [None] * len(prompts)
        t0 = time.perf_counter()
        for name in dict.fromkeys(names):  # groups in first-seen order
            idx = [i for i, n in enumerate(names) if n == name]
            with self._adapter_ctx(name), torch_paths(self.torch_only):
                for batch in _batches(idx, prompts, self.max_batch_tokens):
                    forced = None if routing is None else [routing[i] for i in batch]
                    for i, res in zip(batch, self._forward([prompts[i] for i in batch], top_k, forced)):
                        out[i] = res
        self.last_wall_s = time.perf_counter() - t0
        done = [r for r in out if r is not None]
        assert len(done) == len(out), "every prompt's adapter group ran"
        return done

    def decode(self, prompts: Sequence[Sequence[int]], adapter: AdapterChoice, how: Decoding):
        """Generate with the KV cache (engines.hf_decode: raw-logit logprobs, one prompt at a time)."""
        from lpdiff.engines.hf_decode import hf_decode

        if self.model is None:
            raise RuntimeError("use the engine as a context manager: `with open_engine('hf', cfg) as eng:`")
        names = check_request(prompts, adapter, self.config.adapters, self.config.model)
        with torch_paths(self.torch_only):
            return hf_decode(self, prompts, names, how.max_new_tokens, how.sampling, how.seed)

    def capture_layers(
        self,
        prompts: Sequence[Sequence[int]],
        adapter: str | None = None,
        inputs: dict | None = None,
        steps: Sequence[int] = (),
    ) -> dict[tuple[int, str], torch.Tensor]:
        """Per-layer module inputs and outputs (engines.base.CapturesLayers) on equal-length prompts, hooked in one
        forward (engines/hf_capture.py). The reference engine: no ``inputs``. ``steps``: layers whose Mamba-2 /
        Gated DeltaNet mixer's sub-steps are recorded too (engines/hf_steps.py)."""
        from lpdiff.engines.hf_capture import capture_layers

        if inputs is not None:
            raise ValueError("the hf engine is the reference: it captures its own activations only (inputs=None)")
        if adapter is not None and not isinstance(adapter, str):
            raise ValueError(
                "the hf engine captures one adapter (or None) for the whole batch; capture each adapter separately"
            )
        if self.model is None:
            raise RuntimeError("use the engine as a context manager: `with open_engine('hf', cfg) as eng:`")
        check_request(prompts, adapter, self.config.adapters, self.config.model)
        if len({len(p) for p in prompts}) != 1:
            raise ValueError("capture_layers takes prompts of one length (no padding)")
        with torch_paths(self.torch_only):
            return capture_layers(self, prompts, adapter, steps)

    def _forward(self, prompts: list[Sequence[int]], top_k: int, routing=None) -> list[PromptLogprobs]:
        lens = [len(p) for p in prompts]
        n, T = len(prompts), max(lens)
        ids = torch.zeros(n, T, dtype=torch.long)
        mask = torch.zeros(n, T, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, : len(p)] = torch.as_tensor(list(p), dtype=torch.long)
            mask[i, : len(p)] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        recorder = self.margins
        assert recorder is not None  # set while entered (prompt_logprobs checked)
        forced = None if routing is None else forced_ids(routing, T, recorder.num_routers, self.device)
        hooked = self.record_margins or self.capture_routing or forced is not None  # else the hooks cost nothing
        if hooked:
            recorder.start(forced)
        hidden = self.decoder(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
        margins = recorder.stop(n, T) if hooked else None
        margins = margins if self.record_margins else None
        routed = recorder.routing(n, T) if self.capture_routing else None
        # rows of real positions that predict a next token: (prompt i, position j < len-1)
        sel = torch.cat([torch.arange(L - 1) + i * T for i, L in enumerate(lens)]).to(self.device)
        targets = ids.reshape(-1)[sel + 1]  # row i*T + j predicts token (i, j + 1)
        head = self.lm.get_output_embeddings()
        rows = hidden.reshape(n * T, -1)[sel]
        # an lm_head with LoRA is PEFT's module: its forward applies the active adapter (or none inside
        # disable_adapter); head.weight alone would be the base head, silently dropping the adapter's lm_head part
        lora_head = hasattr(head, "lora_A") and any(a in head.lora_A for a in self.peft_names.values())
        lp, tk_ids, tk_lp = chunked_logprobs(
            rows,
            head.weight,
            targets,
            top_k,
            self.logit_chunk,
            getattr(head, "bias", None),
            logits_fn=(lambda s, e: head(rows[s:e])) if lora_head else None,
        )
        res, off = [], 0
        for i, L in enumerate(lens):
            s = slice(off, off + L - 1)
            off += L - 1
            res.append(
                PromptLogprobs(
                    token_ids=np.asarray(prompts[i], dtype=np.int64),
                    logprobs=lp[s].cpu().numpy(),
                    topk_ids=tk_ids[s].cpu().numpy() if tk_ids is not None else None,
                    topk_logprobs=tk_lp[s].cpu().numpy() if tk_lp is not None else None,
                    router_margin=margins[i, :L] if margins is not None else None,
                    **(
                        {}
                        if routed is None
                        else dict(
                            routed_experts=routed[0][i, :L],
                            routed_margins=routed[1][i, :L],
                            routed_weights=routed[2][i, :L],
                        )
                    ),
                )
            )
        return res


def _as_peft3d(path: str, tmp: str, i: int, model_config) -> str:
    """The directory PEFT loads: ``path`` itself, or its exact PEFT 3D conversion under ``tmp`` (same logits: the
    conversion keeps B @ A and the scaling bit for bit) for a per-expert adapter and for one that names the decoder
    by its checkpoint's root (Qwen3.5's ``model.language_model``, what PEFT writes on the Hub's multimodal class):
    transformers builds the text model, whose decoder is ``model``, and PEFT 0.21 places none of those tensors and
    runs the base model without a word (Nemotron's ``backbone`` it maps itself; converting it is harmless)."""
    from lpdiff.harness.spec.adapters import convert_adapter, disk_roots, inspect_adapter
    from lpdiff.harness.spec.adapters.depth import deeper_entries, write_cut

    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    depth = getattr(text, "num_hidden_layers", None)
    if depth is not None and deeper_entries(path, depth):  # a depth-cut model (--num-layers): drop the cut layers'
        path = str(write_cut(path, f"{tmp}/depth{i}", depth))  # entries, which the conversion rightly refuses
    info = inspect_adapter(path)
    aliases = disk_roots(model_config.model_type)[1:]
    aliased = any(m.startswith(f"{root}.") for m in info.modules() for root in aliases)
    if info.layout != "per_expert" and not aliased:
        return path
    return convert_adapter(path, f"{tmp}/adapter{i}", "peft3d", model_config).path


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

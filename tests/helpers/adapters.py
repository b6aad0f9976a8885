"""Tiny Hugging Face models of each MoE architecture and merge references written from HF's conventions, shared by
the adapter tests of spec/ and pipeline/ (tests/harness/spec/test_adapters.py, tests/harness/pipeline/
test_hybrid_groups.py). The references are written out here so that the per-expert checks do not reuse the code they
check."""

from __future__ import annotations

import copy
import json
import re

import torch
from safetensors.torch import load_file

H, I, E, R = 32, 24, 4, 4  # hidden, expert width, experts, rank
ATOL = 1e-6


def tiny_config(arch: str):
    from transformers import GptOssConfig, NemotronHConfig, Qwen3Config, Qwen3MoeConfig
    from transformers.models.qwen3_5_moe import Qwen3_5MoeTextConfig

    common = dict(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=96)
    if arch == "qwen3_moe":
        return Qwen3MoeConfig(
            **common,
            num_hidden_layers=2,
            num_experts=E,
            num_experts_per_tok=2,
            moe_intermediate_size=I,
            intermediate_size=40,
        )
    if arch == "qwen3_moe_dense_layer":  # layer 0 is a dense MLP
        return Qwen3MoeConfig(
            **common,
            num_hidden_layers=2,
            num_experts=E,
            num_experts_per_tok=2,
            moe_intermediate_size=I,
            intermediate_size=40,
            mlp_only_layers=[0],
        )
    if arch == "gpt_oss":
        return GptOssConfig(
            **common, num_hidden_layers=2, num_local_experts=E, num_experts_per_tok=2, intermediate_size=I
        )
    if arch == "qwen3_5_moe_text":
        return Qwen3_5MoeTextConfig(
            **common,
            num_hidden_layers=4,
            num_experts=E,
            num_experts_per_tok=2,
            moe_intermediate_size=I,
            shared_expert_intermediate_size=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
        )
    if arch == "nemotron_h":
        return NemotronHConfig(
            **common,
            hybrid_override_pattern="ME*E",
            n_routed_experts=E,
            num_experts_per_tok=2,
            moe_intermediate_size=I,
            moe_shared_expert_intermediate_size=16,
            mamba_num_heads=4,
            mamba_head_dim=8,
            ssm_state_size=8,
            n_groups=1,
            n_group=1,
            topk_group=1,
        )
    if arch == "qwen3":
        return Qwen3Config(**common, num_hidden_layers=2, intermediate_size=40)
    raise KeyError(arch)


_MODELS: dict[str, torch.nn.Module] = {}


def tiny_model(arch: str):
    if arch not in _MODELS:
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        _MODELS[arch] = AutoModelForCausalLM.from_config(tiny_config(arch)).eval()
    return _MODELS[arch]


# Facts from docs/engines.md (PEFT), written out here so the per-expert checks do not reuse the code they check.
INTERLEAVED = {"gpt_oss"}
TRANSPOSED = {"gpt_oss"}


def peft_merged(model, adapter_dir) -> dict[str, torch.Tensor]:
    from peft import PeftModel

    return PeftModel.from_pretrained(copy.deepcopy(model), str(adapter_dir)).merge_and_unload().state_dict()


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def changed(merged: dict[str, torch.Tensor], model) -> set[str]:
    base = model.state_dict()
    return {k for k in merged if not torch.equal(merged[k], base[k])}


def memory_path(key: str) -> str:
    """On-disk key -> in-memory module path (Nemotron's backbone., Qwen3.5 multimodal's model.language_model.)."""
    path = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
    return re.sub(r"^(backbone|model\.language_model)\.", "model.", path)


def per_expert_merged(model, pe_dir, arch: str) -> dict[str, torch.Tensor]:
    """Merged weights computed straight from per-expert files with HF's row conventions (gate = [:I] or ::2)."""
    cfg = json.loads((pe_dir / "adapter_config.json").read_text())
    scaling = cfg["lora_alpha"] / cfg["r"]
    tensors = load_file(pe_dir / "adapter_model.safetensors")
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    for key, a in tensors.items():
        if ".experts." not in key or not key.endswith("lora_A.weight"):
            continue
        b = tensors[key.replace("lora_A", "lora_B")]
        path = memory_path(key)
        module, e, proj = path.rsplit(".", 2)
        delta = scaling * b @ a  # (out, in)
        fused = sd[
            f"{module}.{'down_proj' if proj == 'down_proj' else 'gate_up_proj' if arch != 'nemotron_h' else 'up_proj'}"
        ]
        w = fused[int(e)].T if arch in TRANSPOSED else fused[int(e)]  # (out, in) view
        if proj == "down_proj" or arch == "nemotron_h":
            w += delta
        elif arch in INTERLEAVED:
            w[(0 if proj == "gate_proj" else 1) :: 2] += delta
        else:
            n = w.shape[0] // 2
            w[(slice(0, n) if proj == "gate_proj" else slice(n, None))] += delta
    for key, a in tensors.items():  # dense entries
        if ".experts." in key or not key.endswith("lora_A.weight"):
            continue
        b = tensors[key.replace("lora_A", "lora_B")]
        path = memory_path(key)
        sd[f"{path}.weight"] += scaling * b @ a
    return sd

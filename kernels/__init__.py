"""Triton kernels with a pure-torch reference beside each: fused MoE-LoRA expert GEMMs and batched dense LoRA.

Every op takes impl="auto" | "triton" | "torch"; auto picks Triton for CUDA tensors or under TRITON_INTERPRET=1.
"""
from lpdiff.kernels.fused_moe_lora import MoeLoraWeights, moe_forward, moe_forward_torch
from lpdiff.kernels.lora_linear import lora_linear, lora_linear_torch
from lpdiff.kernels.moe_align import MoeRouting, moe_align

__all__ = ["MoeLoraWeights", "moe_forward", "moe_forward_torch", "lora_linear", "lora_linear_torch",
           "MoeRouting", "moe_align"]

"""Triton kernels with a pure-torch reference beside each: the MoE expert GEMMs with multi-adapter LoRA, batched
dense LoRA, attention, target logprobs and the fp32 router GEMM (fp32_sums_gemm).

Every op takes impl="auto" | "triton" | "torch"; auto picks Triton for CUDA tensors or under TRITON_INTERPRET=1.
Files, lowest first: _triton (launch and interpreter shims), activation, lora_weights, moe_inputs, moe_align,
gemm_config, lora_shrink, gemm_tiles, lora_gemm, moe_reference, lora_linear, fused_moe_lora, moe_grouped, moe (the
MoE op).
"""

from lpdiff.kernels.fused_moe_lora import LORA_SHRINK
from lpdiff.kernels.gemm_config import PADDING
from lpdiff.kernels.lora_linear import lora_linear, lora_linear_torch
from lpdiff.kernels.lora_shrink import MAX_RANK
from lpdiff.kernels.lora_weights import MoeLoraWeights
from lpdiff.kernels.moe import moe_forward
from lpdiff.kernels.moe_align import MoeRouting, moe_align
from lpdiff.kernels.moe_grouped import BACKENDS
from lpdiff.kernels.moe_inputs import MoeInputs
from lpdiff.kernels.moe_reference import moe_forward_torch

__all__ = [
    "BACKENDS",
    "LORA_SHRINK",
    "MAX_RANK",
    "PADDING",
    "MoeInputs",
    "MoeLoraWeights",
    "MoeRouting",
    "lora_linear",
    "lora_linear_torch",
    "moe_align",
    "moe_forward",
    "moe_forward_torch",
]

"""LoRA adapters for MoE models, one concept per module: ``layout`` (what a model lets adapters target, module
groups), ``files`` (the PEFT directory on disk), ``canonical`` (the one in-memory form, read from either disk
layout, merged into a model), ``convert`` (writing and exact conversion between layouts), ``generate`` (seeded
adapters), ``inspection`` (what a directory holds, without a model).

Keys PEFT 0.21 writes (transformers 5). Every key is ``base_model.model.`` + the in-memory module path + suffix:
  dense       <module>.lora_A.weight (r, in)           <module>.lora_B.weight (out, r)
  peft3d      <experts>.lora_A.weight (r*E, in)         <experts>.lora_B.weight (out, r*E)
              PEFT wraps each targeted parameter of a module in its own ParamWrapper, the first parameter in the
              module's definition order innermost. With both targeted, gate_up_proj (Nemotron: up_proj) is
              ``<experts>.base_layer.lora_*`` and down_proj is ``<experts>.lora_*``; with one targeted it is
              ``<experts>.lora_*`` whichever it is. Expert e: A_e = A.reshape(E, r, in)[e],
              B_e = B.reshape(out, r, E)[:, :, e]; in/out are the projection's, whatever the parameter's orientation
              (gpt-oss stores (E, in, out), the others (E, out, in)).
  per_expert  <experts>.<e>.gate_proj|up_proj|down_proj.lora_A.weight (r, in), .lora_B.weight (out, r)
              (vLLM / SGLang and transformers-4-era PEFT; Nemotron's non-gated experts have up_proj/down_proj only).
Nemotron-H checkpoints call the decoder ``backbone.`` on disk (``model.`` in memory) and PEFT 0.21 writes
``model.``; readers accept either, writers take ``disk_root``. Qwen3.5 multimodal checkpoints nest the text decoder
under ``model.language_model.``; readers accept that too.
"""

from lpdiff.harness.spec.adapters.canonical import CanonicalAdapter, load_canonical, merge_into, peft_scaling
from lpdiff.harness.spec.adapters.convert import convert_adapter, convert_command, reroot_fix, save_canonical
from lpdiff.harness.spec.adapters.files import CONFIG_NAME, PROVENANCE_NAME, WEIGHTS_NAME, peft_signature
from lpdiff.harness.spec.adapters.generate import DEFAULT_SCALE, GENERATOR_VERSION, generate_adapter
from lpdiff.harness.spec.adapters.inspection import AdapterInfo, adapter_groups, adapter_max_rank, inspect_adapter
from lpdiff.harness.spec.adapters.layout import (
    GROUPS,
    LAYOUTS,
    PEFT_PREFIX,
    VOCAB_GROUPS,
    ExpertParam,
    ModelLayout,
    Targets,
    disk_roots,
    module_group,
    resolve_targets,
)

__all__ = [
    "CONFIG_NAME",
    "DEFAULT_SCALE",
    "GENERATOR_VERSION",
    "GROUPS",
    "LAYOUTS",
    "PEFT_PREFIX",
    "PROVENANCE_NAME",
    "VOCAB_GROUPS",
    "WEIGHTS_NAME",
    "AdapterInfo",
    "CanonicalAdapter",
    "ExpertParam",
    "ModelLayout",
    "Targets",
    "adapter_groups",
    "adapter_max_rank",
    "convert_adapter",
    "convert_command",
    "disk_roots",
    "generate_adapter",
    "inspect_adapter",
    "load_canonical",
    "merge_into",
    "module_group",
    "peft_scaling",
    "peft_signature",
    "reroot_fix",
    "resolve_targets",
    "save_canonical",
]

"""How vLLM reads LoRA adapters, and what lpdiff does about it: rank, the MoE-LoRA mode per model, adapters vLLM
would misread, and per-expert copies renamed for vLLM's loader.

PEFT 3D expert adapters (``target_parameters`` on fused experts) on a model vLLM reads per-expert (Qwen3-MoE) are
passed with ``enable_mixed_moe_lora_format=True`` and ``LoRARequest(is_3d_lora_weight=True)``; without those flags
vLLM drops or misreads them (vLLM issue #41384).

How vLLM 0.25.1 reads expert adapters (read off its source; file:line beside the constants below):
models whose vLLM class says ``is_3d_moe_weight`` (gpt-oss, Qwen3.5-MoE) load PEFT 3D adapters natively through
``FusedMoE3DWithLoRA``, which keeps gpt-oss's interleaved gate/up rows; the others (Qwen3-MoE) load per-expert
adapters natively. ``enable_mixed_moe_lora_format`` forces the 2D wrapper for every adapter; its LoRA kernel adds
gate and up as concatenated halves, which is right for Qwen3 but wrong for gpt-oss's interleaved base weights. So the
flag is set only where an adapter's layout is not the model's native one, and a per-expert adapter on gpt-oss is
refused unless asked for (``mixed_moe_lora_format=True``: it then runs, with vLLM's per-expert names w1/w2/w3, and a
FAIL is vLLM's defect, listed in ``known_defects``).
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Sequence
from pathlib import Path

from lpdiff.harness.spec.errors import InputError
from lpdiff.harness.types import canonical_hash, dir_hash

# vLLM 0.25.1 model classes with ``is_3d_moe_weight = True`` (gpt_oss.py:1173, qwen3_5.py:608, qwen3_vl_moe.py:203,
# interns1_pro.py:547): used when vLLM's registry cannot be asked (no vLLM here).
_NATIVE_3D_ARCHS = frozenset(
    {
        "GptOssForCausalLM",
        "Qwen3_5MoeForConditionalGeneration",
        "Qwen3VLMoeForConditionalGeneration",
        "InternS1ProForConditionalGeneration",
    }
)
# fused gate_up rows alternate gate/up (model_manager.py:997, fused_moe.py:528, gpt_oss.py:1027)
_INTERLEAVED_ARCHS = frozenset({"GptOssForCausalLM"})
# per-expert names vLLM's 2D loader expects, where they are not gate_proj/up_proj/down_proj
# (GptOssModel.get_expert_mapping, gpt_oss.py:364-374: ckpt names w1 gate, w2 down, w3 up)
_PER_EXPERT_NAMES = {"GptOssForCausalLM": {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}}


@dataclasses.dataclass(slots=True, frozen=True)
class MoeLoraPlan:
    """How one engine serves its expert adapters: ``mixed`` is vLLM's enable_mixed_moe_lora_format, ``rename`` maps
    per-expert projection names to the ones vLLM's loader expects, ``known_defects`` says which results are vLLM's
    known-wrong path (a FAIL there is vLLM's, not lpdiff's)."""

    mixed: bool
    rename: dict[str, str]
    known_defects: tuple[str, ...] = ()


def plan_moe_lora(arch: str, layouts: Sequence[str], native_3d: bool, forced: bool | None = None) -> MoeLoraPlan:
    """Pick vLLM 0.25.1's MoE-LoRA mode for adapters of these layouts ("peft3d" | "per_expert" | "dense_only") on a
    model of architecture ``arch`` whose vLLM class loads 3D adapters natively (``native_3d``) or not."""
    kinds = set(layouts) - {"dense_only"}
    need = "per_expert" if native_3d else "peft3d"  # the layout this model cannot read without the flag
    mixed = need in kinds if forced is None else forced
    if need in kinds and not mixed:
        raise InputError(
            f"{arch} in vLLM reads {'PEFT 3D' if native_3d else 'per-expert'} expert adapters natively; "
            f"a {need} adapter needs mixed_moe_lora_format (vLLM otherwise refuses it or crashes at "
            "the first request): leave the option unset, or convert the adapter with `lpdiff adapters "
            f"convert --to {'peft3d' if native_3d else 'per_expert'}`"
        )
    defects = []
    if mixed and kinds and arch in _INTERLEAVED_ARCHS:
        defect = (
            f"vLLM 0.25.1 adds {arch}'s expert gate/up LoRA as concatenated halves under "
            "enable_mixed_moe_lora_format (fused_moe_lora_op.py:1355) while the base gate_up rows are "
            "interleaved (gpt_oss.py:1027, activation.py:446): expert LoRA results are wrong"
        )
        if forced is None:
            raise InputError(
                f"{defect}. Serve PEFT 3D adapters only (`lpdiff adapters convert --to peft3d`, the "
                "layout vLLM reads natively and correctly here), or pass options "
                "mixed_moe_lora_format=True to run this path anyway and expect a FAIL that is vLLM's"
            )
        defects.append(defect)
    rename = _PER_EXPERT_NAMES.get(arch, {}) if mixed and "per_expert" in kinds else {}
    return MoeLoraPlan(bool(mixed), dict(rename), tuple(defects))


def vllm_native_3d(arch: str) -> bool:
    """Whether vLLM's class for ``arch`` loads 3D expert adapters natively: asked of vLLM's registry when vLLM is
    importable, else read from the table of 0.25.1's classes."""
    try:
        from vllm.model_executor.models import ModelRegistry

        cls = ModelRegistry._try_load_model_cls(arch)
    except (ImportError, AttributeError):  # no vLLM here, or a registry without this private helper
        cls = None
    return bool(getattr(cls, "is_3d_moe_weight", False)) if cls is not None else arch in _NATIVE_3D_ARCHS


def adapter_problems(info, gated: bool = True) -> list[str]:
    """What vLLM 0.25.1 would misread in an adapter (``lpdiff.harness.spec.adapters.inspect_adapter`` output), each
    with its fix.

    - rank_pattern / alpha_pattern: vLLM's PEFTHelper has no such fields (peft_helper.py), every module gets
      lora_alpha / r.
    - PEFT 3D experts with only one of gate_up / down targeted: vLLM takes ``<experts>.lora_*`` as down_proj and
      ``<experts>.base_layer.lora_*`` as gate_up (model_manager.py:843, :951), so a lone gate_up is read as down.
    - per-expert experts missing a projection: vLLM packs (gate, down, up) for every expert (lora_weights.py:187)."""
    out = []
    if info.rank_pattern or info.alpha_pattern:
        out.append(
            f"{info.path}: rank_pattern/alpha_pattern are ignored by vLLM (every module would get lora_alpha/r);"
            " re-save the adapter with one rank (lpdiff's save_canonical pads to one rank exactly)"
        )
    three_d: dict[str, set[int]] = {}
    parts: dict[str, dict[int, set[str]]] = {}
    for k in info.keys:
        m = re.fullmatch(r"(.+\.experts)((?:\.base_layer)*)\.lora_A\.weight", k)
        if m:
            three_d.setdefault(m.group(1), set()).add(m.group(2).count(".base_layer"))
        m = re.fullmatch(r"(.+\.experts)\.(\d+)\.(\w+)\.lora_A\.weight", k)
        if m:
            parts.setdefault(m.group(1), {}).setdefault(int(m.group(2)), set()).add(m.group(3))
    for module, depths in sorted(three_d.items()):
        if depths != {0, 1}:
            out.append(
                f"{info.path}: {module} targets one expert parameter; vLLM reads a PEFT 3D expert adapter "
                "only with both gate_up_proj and down_proj targeted (a lone one is read as down_proj)"
            )
            break
    want = {"gate_proj", "up_proj", "down_proj"} if gated else {"up_proj", "down_proj"}
    for module, experts in sorted(parts.items()):
        bad = sorted(e for e, got in experts.items() if got != want)
        if bad:
            out.append(
                f"{info.path}: {module}.{bad[0]} has {sorted(experts[bad[0]])}; vLLM needs every expert's "
                f"{sorted(want)} (it asserts while packing)"
            )
            break
    return out


def root_problems(infos: dict, arch: str, model_ref: str) -> list[str]:
    """Adapters (name -> ``inspect_adapter`` output) with modules outside the decoder root vLLM maps adapter names
    from on ``arch`` (CAPABILITIES.adapter_roots: Qwen3.5's ``model.language_model``): vLLM would drop them without
    a word, so each is told with the known defect's what and fix (never renamed behind the user's back)."""
    from lpdiff.engines.vllm.capabilities import CAPABILITIES
    from lpdiff.harness.spec.adapters import reroot_fix

    root = CAPABILITIES.adapter_root(arch)
    if root is None:
        return []
    defect, out = CAPABILITIES.defect("vllm-qwen3.5-text-names", arch), []
    for name, info in infos.items():
        if fields := reroot_fix(info, model_ref, root, CAPABILITIES.layouts_for(arch)):
            what, fix = defect.message(arch=arch, **fields)
            out.append(f"{name!r}: {what}. Fix: {fix}")
    return out


def renamed_per_expert_adapter(src: str | Path, rename: dict[str, str], root: str | Path) -> str:
    """A copy of a per-expert adapter with its projections renamed (gate_proj -> w1, ...) for vLLM's loader, written
    once under ``root`` keyed by the source's content; the tensors are the same bytes."""
    import json

    from safetensors.torch import load_file, save_file

    out = Path(root) / f"{dir_hash(src)[:16]}-{canonical_hash(rename)[:8]}"
    if (out / "adapter_model.safetensors").is_file():
        return str(out)
    pat = re.compile(r"(\.experts\.\d+\.)(\w+)(\.lora_[AB]\.weight)$")
    tensors = {
        pat.sub(lambda m: m.group(1) + rename.get(m.group(2), m.group(2)) + m.group(3), k): v
        for k, v in load_file(str(Path(src) / "adapter_model.safetensors")).items()
    }
    cfg = json.loads((Path(src) / "adapter_config.json").read_text())
    if isinstance(cfg.get("target_modules"), list):
        cfg["target_modules"] = sorted({rename.get(t, t) for t in cfg["target_modules"]})
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
    (tmp / "adapter_config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    try:
        tmp.rename(out)
    except OSError:  # written by another process meanwhile: same content
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return str(out)

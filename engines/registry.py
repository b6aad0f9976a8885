"""The engines lpdiff knows: name -> "module:Class". Adding an engine is its module (with its ``CAPABILITIES``) plus
one line here. This module imports nothing, so the CLI's ``--help`` lists the engines without loading one."""

from __future__ import annotations

ENGINES: dict[str, str] = {
    "hf": "lpdiff.engines.hf:HFEngine",
    "triton": "lpdiff.engines.triton:TritonEngine",
    "vllm": "lpdiff.engines.vllm:VLLMEngine",
    "sglang": "lpdiff.engines.sglang:SGLangEngine",
}

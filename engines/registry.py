"""The engines lpdiff knows: name -> "module:Class". Adding an engine is its module (with its ``CAPABILITIES``) plus
one line here. This module imports nothing, so the CLI's ``--help`` lists the engines without loading one."""

from __future__ import annotations

ENGINES: dict[str, str] = {
    "hf": "lpdiff.engines.hf:HFEngine",
    "triton": "lpdiff.engines.triton:TritonEngine",
    "vllm": "lpdiff.engines.vllm:VLLMEngine",
    "sglang": "lpdiff.engines.sglang:SGLangEngine",
}
# What plain ``lpdiff run`` judges: lpdiff's own runtime (on a CPU through its kernels' torch references; the bug
# zoo's faults are injected there), against the stored runs of the reference engine: HF+PEFT, the implementation
# every engine is held to. ``lpdiff run --engine hf`` judges the reference against its own stored runs: an install
# self-check.
DEFAULT_ENGINE = "triton"
REFERENCE_ENGINE = "hf"

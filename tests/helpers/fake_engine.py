"""A stand-in engine for the registry test (tests/engines/test_registry.py): HF+PEFT under another name, with HF's
declared capabilities copied. Every engine lpdiff ships is already registered, so the only way to show that one
registry line (engines/registry.py) is all a new engine needs is to add a module lpdiff has never seen; wrapping the
real HF engine keeps its logprobs real, so a run of it is judged against the stored HF+PEFT references."""

from __future__ import annotations

import dataclasses

from lpdiff.engines.hf import CAPABILITIES as HF_CAPABILITIES
from lpdiff.engines.hf import HFEngine

NAME = "fake"
CAPABILITIES = dataclasses.replace(HF_CAPABILITIES, engine=NAME, label="fake (HF+PEFT under another name)")


class FakeEngine(HFEngine):
    name = NAME

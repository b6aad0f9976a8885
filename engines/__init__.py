"""Engine adapters, imported lazily by name (engines/registry.py), and their declared capabilities.

The other names below are loaded on first use (PEP 562), so importing ``lpdiff.engines.registry`` (the CLI's
``--help`` lists the engines) loads neither numpy nor torch."""

from importlib import import_module

# the submodule first: importing it binds the package's ``capabilities`` to it, and the function below rebinds it,
# as engines.base's own ``capabilities`` did when this face imported everything
from lpdiff.engines import capabilities as _declarations  # noqa: F401
from lpdiff.engines.capabilities import Capabilities, KnownDefect, Mode
from lpdiff.engines.registry import DEFAULT_ENGINE, ENGINES, REFERENCE_ENGINE


def capabilities(name: str) -> Capabilities:
    """engines.base.capabilities: the engine's declared facts."""
    from lpdiff.engines.base import capabilities as declared

    return declared(name)


_FROM = {
    **dict.fromkeys(
        (
            "CapturesLayers",
            "Engine",
            "EngineConfig",
            "engine_class",
            "engine_modes",
            "layouts_for",
            "max_rank",
            "open_engine",
        ),
        "lpdiff.engines.base",
    ),
    # an engine that died, hung or raised in its lane
    **dict.fromkeys(("LaneDied", "LaneError"), "lpdiff.engines.subprocess_lane"),
}

__all__ = [
    "DEFAULT_ENGINE",
    "ENGINES",
    "REFERENCE_ENGINE",
    "Capabilities",
    "CapturesLayers",
    "Engine",
    "EngineConfig",
    "KnownDefect",
    "LaneDied",
    "LaneError",
    "Mode",
    "capabilities",
    "engine_class",
    "engine_modes",
    "layouts_for",
    "max_rank",
    "open_engine",
]


def __getattr__(name: str):
    if name not in _FROM:
        raise AttributeError(f"module 'lpdiff.engines' has no attribute {name!r}")
    value = getattr(import_module(_FROM[name]), name)
    globals()[name] = value
    return value

"""Engine adapters, imported lazily by name (see engines.base.ENGINES), and their declared capabilities."""
from lpdiff.engines.base import (ENGINES, CapturesLayers, Engine, EngineConfig, capabilities, engine_class,
                                 engine_modes, layouts_for, max_rank, open_engine)
from lpdiff.engines.capabilities import Capabilities, KnownDefect, Mode
from lpdiff.engines.subprocess_lane import LaneDied, LaneError  # an engine that died, hung or raised in its lane

__all__ = ["ENGINES", "Capabilities", "CapturesLayers", "Engine", "EngineConfig", "KnownDefect", "LaneDied", "LaneError", "Mode",
           "capabilities", "engine_class", "engine_modes", "layouts_for", "max_rank", "open_engine"]

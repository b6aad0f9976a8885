"""Engine adapters, imported lazily by name (see engines.base.ENGINES)."""
from lpdiff.engines.base import ENGINES, Engine, EngineConfig, engine_class, open_engine

__all__ = ["ENGINES", "Engine", "EngineConfig", "engine_class", "open_engine"]

"""User-facing configuration schema: frozen pydantic models that reject unknown keys.

Every process reads its settings from these models; nothing mutates a config after load.
Imports nothing from the project.
"""

from configs.engine import EngineConfig

__all__ = ["EngineConfig"]

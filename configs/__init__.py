"""User-facing configuration schema: frozen pydantic models that reject unknown keys.

Every process reads its settings from these models; nothing mutates a config after load.
Imports nothing from the project.
"""

from configs.cluster import ClusterConfig, ConfigError, load_cluster_config
from configs.engine import EngineConfig, EngineSettings
from configs.flight_recorder import FlightRecorderConfig
from configs.logging_setup import EventLog, LoggingConfig, setup_logging

__all__ = ["ClusterConfig", "ConfigError", "EngineConfig", "EngineSettings", "EventLog", "FlightRecorderConfig",
           "LoggingConfig",
           "load_cluster_config", "setup_logging"]

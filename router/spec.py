"""What a router is started with: one frozen `RouterSpec`.

Built from the cluster YAML in one place (cluster/specs.py `router_spec`) and used alike by the
Ray launcher (cluster/actors.py RouterActor), the in-process test cluster (tests/local_cluster.py)
and unit tests, so a setting added to the YAML reaches the router through one typed object, never a
hand-built dict of keyword arguments.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from configs.cluster import RouterConfig
from configs.flight_recorder import FlightRecorderConfig
from proto.frame_auth import ClusterSecret
from router.security import FrontDoorSecurity
from router.worker_pool import WorkerEndpoint


@dataclass(frozen=True)
class RouterSpec:
    model_dir: str  # the resolved local checkpoint: tokenizer.json and config.json
    model_name: str  # what clients call the model (the YAML's `model`; OpenAI `model` field)
    mode: Literal["disaggregated", "colocated"]
    endpoints: tuple[WorkerEndpoint, ...]
    event_address: str  # host:port the router's event socket binds (router.worker_event_port)
    # Signs every command, checks every worker event (proto/frame_auth.py); handed over by the
    # process that built the spec, never read from the YAML or logged (its repr is hidden).
    cluster_secret: ClusterSecret = field(repr=False)
    router: RouterConfig = field(default_factory=RouterConfig)  # the YAML's router section, as is
    kv_timeout_s: float = 30.0  # kv_transfer.timeout_s: a prefill's KV transfer deadline
    lease_s: float = 30.0  # kv_transfer.reservation_lease_s: how long decode pages stay reserved
    # The longest sequence every serving engine accepts (their engine.max_model_len, the smallest
    # of the pools'); None = the model's own context. Prompts at or over it get INVALID_ARGUMENT.
    max_model_len: int | None = None
    default_timeout_s: float = 600.0  # a request without its own timeout_s ends after this
    page_size: int = 16  # the engines' KV page size: the KV block index hashes prompts by it
    # The API key and TLS files `router` asks for, resolved where the spec is built
    # (FrontDoorSecurity.load): the router never reads the YAML's environment variable itself.
    security: FrontDoorSecurity = field(default_factory=FrontDoorSecurity)
    flight: FlightRecorderConfig = field(default_factory=FlightRecorderConfig)  # the YAML's flight_recorder

    def __post_init__(self) -> None:
        if self.mode not in ("disaggregated", "colocated"):
            raise ValueError(f"unknown mode {self.mode!r}; choose 'disaggregated' or 'colocated'")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        # Fail closed: a config that asks for a key or TLS never yields an open router.
        if self.router.wants_api_key and self.security.api_key is None:
            raise ValueError("router config asks for an API key but the spec carries none: "
                             "build it with FrontDoorSecurity.load (cluster/specs.py router_spec)")
        if self.router.wants_tls and not self.security.tls:
            raise ValueError("router config asks for TLS but the spec carries no certificate: "
                             "build it with FrontDoorSecurity.load (cluster/specs.py router_spec)")
        object.__setattr__(self, "endpoints", tuple(self.endpoints))

"""The cluster YAML's `flight_recorder:` block: how much each process's ring holds and where its
dumps go (proto/flight/). Read by every process alike (router and workers get it in their spec)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class FlightRecorderConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    enabled: bool = True
    capacity: int = Field(4096, ge=16, le=1_000_000,
                          description="entries each process keeps (messages and state changes); the oldest go first")
    dump_dir: str = Field("/tmp/pdserve-flight", min_length=1,
                          description="where SIGUSR1 and deadline overruns write dumps, on the process's node")
    dump_on_overrun: bool = Field(True, description="the router dumps its ring when a request outlives its deadline")
    overrun_grace_s: float = Field(5.0, gt=0, description="how long past its deadline a request counts as overdue")

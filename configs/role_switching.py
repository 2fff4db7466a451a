"""The cluster YAML's `router.role_switching:` block: whether the workers of a disaggregated
cluster can flip between prefill and decode at run time, and when the router's controller flips
one (router/role_switch/controller.py). `pdserve scale` and the autoscaler decide how many
workers each pool has; role switching decides the mix of the running ones."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class RoleSwitchingConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    # off: fixed roles. manual: workers can flip, only `pdserve role` flips them. auto: the router's
    # controller flips them too, from the TTFT and TPOT of recent requests against the SLO targets.
    mode: Literal["off", "manual", "auto"] = "off"
    interval_s: float = Field(2.0, gt=0, description="how often the controller looks at the recent requests")
    window_s: float = Field(20.0, gt=0, description="the controller judges the requests finished this recently")
    min_samples: int = Field(8, ge=1, description="requests in the window before the controller judges it")
    sustain_s: float = Field(10.0, ge=0, description="a flip's condition must hold this long before it flips")
    high: float = Field(0.8, gt=0, description="pressure: a p90 past this share of its SLO target")
    low: float = Field(0.5, gt=0, description="slack: a p90 under this share of its SLO target")
    cooldown_s: float = Field(60.0, ge=0, description="no flip this soon after another (its samples are fresh)")
    max_flips: int = Field(2, ge=1, description="flips at most in any flip_window_s")
    flip_window_s: float = Field(300.0, gt=0, description="the window max_flips counts over")
    min_workers_per_role: int = Field(1, ge=0, description="a flip never leaves a role with fewer workers "
                                      "(decode keeps at least one whatever this says)")

    @model_validator(mode="after")
    def _check_bands(self) -> RoleSwitchingConfig:
        if self.low >= self.high:
            raise ValueError(f"role_switching.low ({self.low}) must be under role_switching.high ({self.high}): "
                             "the gap between them is the hysteresis that keeps a flip from flipping back")
        return self

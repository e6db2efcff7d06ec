"""The canary guard's thresholds (policies/rollout.yaml)."""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field

ROLLOUT = Path(__file__).parent / "rollout.yaml"


class RolloutPolicy(BaseModel):
    model_config = ConfigDict(extra="forbid")
    window_s: float = Field(default=300, gt=0)
    min_requests: int = Field(default=20, ge=1)
    check_every_s: float = Field(default=5, gt=0)
    max_error_rate_delta: float = Field(default=0.05, ge=0, le=1)
    max_ttft_p95_ratio: float = Field(default=1.5, ge=1)
    max_tpot_p95_ratio: float = Field(default=1.5, ge=1)
    ttft_slack_ms: float = Field(default=50, ge=0)
    tpot_slack_ms: float = Field(default=5, ge=0)
    auto_promote_after_s: float | None = Field(default=None, gt=0)


def load_rollout(path: Path = ROLLOUT) -> RolloutPolicy:
    try:
        return RolloutPolicy.model_validate(yaml.safe_load(Path(path).read_text()) or {})
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from exc

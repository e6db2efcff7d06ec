"""Budget alerts: a tenant's or key's spend reached 80% or 100% of its daily or monthly budget.

Each crossing is one JSON log line (`budget threshold reached`) and, where configured, one POST
of the same fields to `SERVEGATE_BUDGET_WEBHOOK_URL`. The quota store reports each crossing in
exactly one settlement, so N replicas send one alert, not N."""

from __future__ import annotations

import logging

import httpx

from gateway.tables import usd
from gateway.tenancy.quotas import BudgetCrossing

log = logging.getLogger("servegate.budgets")
WEBHOOK_TIMEOUT_S = 5.0


def event(crossing: BudgetCrossing) -> dict:
    return {"event": "budget.threshold", "scope": crossing.scope, "budget": crossing.budget,
            "window": crossing.window, "percent": crossing.percent, "spent_usd": format(usd(crossing.spent), "f"),
            "budget_usd": format(usd(crossing.limit), "f")}


async def alert(crossing: BudgetCrossing, webhook_url: str | None) -> None:
    fields = event(crossing)
    log.warning("budget threshold reached", extra=fields)
    if webhook_url is None:
        return
    try:
        async with httpx.AsyncClient(timeout=WEBHOOK_TIMEOUT_S) as http:
            (await http.post(webhook_url, json=fields)).raise_for_status()
    except httpx.HTTPError as exc:  # the log line stands
        log.warning("budget webhook failed: %s", exc, extra={"scope": crossing.scope, "percent": crossing.percent})

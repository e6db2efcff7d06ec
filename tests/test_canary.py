"""The SLO-guarded canary: verdicts on their own, then a live gateway that rolls a slow canary back
on its own and promotes a clean one."""

from __future__ import annotations

import contextlib
import time

import httpx
import pytest

from gateway.rollout.canary import Stats, verdict
from policies.rollout import RolloutPolicy, load_rollout

from .conftest import AUTH, gateway_app, serve_app
from .test_routes import admin, backend, chat, upstream

POLICY = RolloutPolicy(min_requests=10, max_error_rate_delta=0.05, max_ttft_p95_ratio=1.5, max_tpot_p95_ratio=1.5)


def test_the_shipped_rollout_policy_loads_and_a_bad_one_is_named(tmp_path):
    assert load_rollout().min_requests >= 1
    bad = tmp_path / "rollout.yaml"
    bad.write_text("max_ttft_p95_ratio: 0.5\n")
    with pytest.raises(ValueError, match="(?s)rollout.yaml.*max_ttft_p95_ratio"):
        load_rollout(bad)


@pytest.mark.parametrize(("canary", "expected"), [
    (Stats(9, 0.5, 900.0, 90.0), None),  # too few requests to judge
    (Stats(20, 0.02, 100.0, 10.0), None),  # as good as the active version
    (Stats(20, 0.10, 100.0, 10.0), "error rate 10.0% against 1.0%"),
    (Stats(20, 0.01, 200.0, 10.0), "TTFT p95 200 ms against 100 ms"),
    (Stats(20, 0.01, 100.0, 30.0), "TPOT p95 30 ms against 10 ms"),
    (Stats(20, 0.01, 140.0, 14.0), None),  # under both ratios
])
def test_verdicts(canary, expected):
    found = verdict(POLICY, Stats(20, 0.01, 100.0, 10.0), canary)
    assert (found is None) if expected is None else found.startswith(expected)


def test_a_ratio_on_fast_answers_within_the_slack_is_noise():
    fast = Stats(20, 0.0, 0.1, 0.02)
    assert verdict(POLICY, fast, Stats(20, 0.0, 0.4, 0.08)) is None  # 4x, by far less than the slack
    assert verdict(POLICY, fast, Stats(20, 0.0, 60.0, 0.08)).startswith("TTFT p95 60 ms")


@pytest.fixture
def guarded(tmp_path, request):
    """A gateway whose guard follows the rollout policy given as the test's parameter, over three
    upstreams: `stable`, `slow` (0.25 s before each piece) and `twin` (as fast as stable)."""
    policy = tmp_path / "rollout.yaml"
    policy.write_text(request.param)
    apps = {"stable": upstream("s"), "slow": upstream("w", delay=0.25), "twin": upstream("t")}
    with contextlib.ExitStack() as stack:
        urls = {name: stack.enter_context(serve_app(app)) for name, app in apps.items()}
        backends = {name: backend(name, url) for name, url in urls.items()}
        app = gateway_app(backends, tmp_path, refresh_s=0.2, route_seed=5, rollout_policy=policy)
        yield stack.enter_context(serve_app(app))


SLOW_CANARY = "window_s: 60\nmin_requests: 5\ncheck_every_s: 0.2\nmax_ttft_p95_ratio: 1.5\n"
CLEAN_CANARY = "window_s: 60\nmin_requests: 5\ncheck_every_s: 0.2\nauto_promote_after_s: 0.5\n"


@pytest.mark.slow
@pytest.mark.parametrize("guarded", [SLOW_CANARY], indirect=True)
def test_a_canary_with_a_slow_first_token_is_rolled_back_on_its_own(guarded):
    url = guarded
    admin(url, "POST", "/routes/chat/deploy", json={"spec": {"targets": [{"backend": "stable"}]}})
    admin(url, "POST", "/routes/chat/deploy", json={"spec": {"targets": [{"backend": "slow"}]}, "canary_share": 0.5})
    seen, deadline = [], time.monotonic() + 30
    while time.monotonic() < deadline:
        answer = chat(url)
        assert answer.status_code == 200  # the canary is slow, never failing: no client sees an error
        seen.append(answer.headers["x-servegate-route"])
        history = admin(url, "GET", "/routes/chat").json()
        if any(c["action"] == "route.rollback.canary" for c in history["changes"]):
            break
    else:
        pytest.fail("the guard did not roll the canary back")
    assert any("variant=canary" in s for s in seen) and any("variant=active" in s for s in seen)
    reason = next(c for c in history["changes"] if c["action"] == "route.rollback.reason")
    assert reason["actor"] == "canary-guard" and "TTFT p95" in reason["after"]["reason"]
    assert [v["status"] for v in history["versions"]] == ["retired", "active"]
    time.sleep(0.3)
    assert all("variant=active" in chat(url).headers["x-servegate-route"] for _ in range(5))
    metrics = httpx.get(f"{url}/metrics", headers=AUTH).text
    assert 'servegate_canary_actions_total{action="rollback",alias="chat"} 1.0' in metrics


@pytest.mark.slow
@pytest.mark.parametrize("guarded", [CLEAN_CANARY], indirect=True)
def test_a_clean_canary_is_promoted_when_the_policy_says_so(guarded):
    url = guarded
    admin(url, "POST", "/routes/chat/deploy", json={"spec": {"targets": [{"backend": "stable"}]}})
    admin(url, "POST", "/routes/chat/deploy", json={"spec": {"targets": [{"backend": "twin"}]}, "canary_share": 0.5})
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        chat(url)
        history = admin(url, "GET", "/routes/chat").json()
        if history["versions"][0]["status"] == "active":
            break
    else:
        pytest.fail("the clean canary was not promoted")
    assert history["versions"][0]["version"] == 2
    promoted = next(c for c in history["changes"] if c["action"] == "route.promote.reason")
    assert promoted["actor"] == "canary-guard" and "clean for 0.5 s" in promoted["after"]["reason"]

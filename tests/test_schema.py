"""schemathesis against the gateway's own OpenAPI schema, inference, TGI and admin routes: no
generated input, valid or not, gets a 5xx, and every response matches the schema.

CI runs a fixed (derandomized) set of 25 examples per route, valid and invalid; `SCHEMA_EXAMPLES=500` explores
further with fresh random inputs."""

from __future__ import annotations

import itertools
import os

import pytest
import schemathesis
from hypothesis import HealthCheck, example, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis.generation import GenerationMode
from schemathesis.specs.openapi.checks import response_schema_conformance
from sqlmodel import Session

from backends.builtin import BuiltinBackend, EngineConfig
from gateway.tenancy.tenants import TenantPatch, update_tenant

from .conftest import AUTH, gateway_app, serve_app, wait_ready

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    backend = BuiltinBackend(EngineConfig(model=str(tiny_model_dir), dtype="float64", served_name="tiny",
                                          kv_cache_tokens=4096))
    app = gateway_app({"tiny": backend}, tmp_path_factory.mktemp("schema"))
    with Session(app.state.gateway.db) as session:  # keep generated requests short
        update_tenant(session, "test", "default", TenantPatch(max_tokens_per_request=4))
    with serve_app(app) as url:
        wait_ready(url)
        yield url


# Random valid bodies rarely pass the gateway's own checks (a per-request token cap of 4, no unknown
# fields for the engine): each inference route also gets its smallest valid body.
SMALLEST = {
    "POST /v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}]},
    "POST /v1/completions": {"prompt": "hi"},
}


def test_no_5xx_responses_match_the_schema_and_every_route_is_reached(served):
    """Each operation gets valid and invalid inputs (schemathesis' strategies, driven by hypothesis
    directly, not through its pytest plugin, whose hooks break across pytest releases)."""
    api = schemathesis.openapi.from_url(f"{served}/openapi.json")
    statuses: dict[str, set[int]] = {}

    operations = [result.ok() for result in api.get_all_operations()]
    for operation, mode in itertools.product(operations, GenerationMode):

        @given(case=operation.as_strategy(mode))
        @settings(max_examples=int(os.environ.get("SCHEMA_EXAMPLES", 25)), database=None,
                  derandomize=not os.environ.get("SCHEMA_EXAMPLES"), deadline=None,
                  suppress_health_check=list(HealthCheck))
        def check(case):
            response = case.call(headers=AUTH, timeout=60)
            statuses.setdefault(f"{case.method} {case.path}", set()).add(response.status_code)
            assert response.status_code < 500, \
                f"{case.method} {case.formatted_path} -> {response.status_code}: {response.text}"
            case.validate_response(response, checks=[response_schema_conformance])

        if mode is GenerationMode.POSITIVE and operation.label in SMALLEST:
            check = example(case=operation.Case(body=SMALLEST[operation.label], media_type="application/json"))(check)
        try:
            check()
        except Unsatisfiable:  # an operation without parameters or body has no invalid input
            assert mode is GenerationMode.NEGATIVE, operation.label

    # Both valid and invalid inputs were generated: most routes answered both 2xx and 4xx.
    assert len(statuses) >= 20
    answered = {route for route, codes in statuses.items() if any(c < 300 for c in codes)}
    refused = {route for route, codes in statuses.items() if any(400 <= c < 500 for c in codes)}
    assert {"POST /v1/chat/completions", "POST /generate", "POST /admin/tenants", "GET /admin/usage"} <= answered
    assert len(refused) >= 15, statuses

"""schemathesis against the gateway's own OpenAPI schema, inference, TGI and admin routes: no
generated input, valid or not, gets a 5xx, and every response matches the schema.

CI runs a fixed (derandomized) set of 25 examples per route; `SCHEMA_EXAMPLES=500` explores
further with fresh random inputs."""

from __future__ import annotations

import os

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.specs.openapi.checks import response_schema_conformance
from sqlmodel import Session

from backends.builtin import BuiltinBackend, EngineConfig
from gateway.tenancy import TenantPatch, update_tenant

from .conftest import AUTH, gateway_app, serve_app, wait_ready


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


@pytest.fixture
def api_schema(served):
    return schemathesis.openapi.from_url(f"{served}/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")
STATUSES: dict[str, set[int]] = {}


@schema.parametrize()
@settings(max_examples=int(os.environ.get("SCHEMA_EXAMPLES", 25)), derandomize=not os.environ.get("SCHEMA_EXAMPLES"),
          deadline=None, suppress_health_check=list(HealthCheck))
def test_no_5xx_and_responses_match_the_schema(case):
    response = case.call(headers=AUTH, timeout=60)
    STATUSES.setdefault(f"{case.method} {case.path}", set()).add(response.status_code)
    assert response.status_code < 500, f"{case.method} {case.formatted_path} -> {response.status_code}: {response.text}"
    case.validate_response(response, checks=[response_schema_conformance])


def test_the_generated_inputs_reached_every_route():
    """Both valid and invalid inputs were generated: most routes answered both 2xx and 4xx."""
    assert len(STATUSES) >= 20
    answered = {route for route, codes in STATUSES.items() if any(c < 300 for c in codes)}
    refused = {route for route, codes in STATUSES.items() if any(400 <= c < 500 for c in codes)}
    assert {"POST /v1/chat/completions", "POST /generate", "POST /admin/tenants", "GET /admin/usage"} <= answered
    assert len(refused) >= 15, STATUSES


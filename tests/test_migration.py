"""Moving off TGI: the plan `servegate migrate tgi` writes, and the move itself end to end, with
TGI's own client calling throughout."""

from __future__ import annotations

import contextlib
import json
import time

import pytest
import yaml
from typer.testing import CliRunner

from backends.openai_compat import OpenAICompatConfig
from backends.tgi import TGIBackend
from gateway.cli import app
from gateway.rollout.route_versions import RouteSpec
from gateway.rollout.tgi_migration import MigrationError, TGIDeployment, plan

from .conftest import ADMIN_KEY, AUTH, gateway_app, serve_app
from .test_routes import admin, backend, upstream

TGI_ARGS = ["--model-id", "meta-llama/Llama-3.1-8B-Instruct", "--num-shard", "2", "--quantize", "awq",
            "--max-total-tokens", "8192", "--max-batch-prefill-tokens", "4096", "--max-concurrent-requests", "256",
            "--kv-cache-dtype", "fp8_e4m3fn", "--max-best-of", "2", "--trust-remote-code", "PREFIX_CACHING=0",
            "--frobnicate", "3"]


def test_the_plan_translates_every_flag_or_names_it():
    p = plan(TGIDeployment.parse(TGI_ARGS), "llama", "http://tgi:3000", "http://vllm:8000", "vllm")
    vllm, sglang = p["commands"]["vllm"], p["commands"]["sglang"]
    for flag in ("--max-model-len 8192", "--tensor-parallel-size 2", "--kv-cache-dtype fp8_e4m3",
                 "--quantization awq", "--max-num-batched-tokens 4096", "--no-enable-prefix-caching",
                 "--trust-remote-code"):
        assert flag in vllm
    assert "--context-length 8192" in sglang and "--max-total-tokens" not in sglang  # the trap, avoided
    assert "--tp-size 2" in sglang and "--chunked-prefill-size 4096" in sglang and "--disable-radix-cache" in sglang
    assert any("KV pool" in trap for trap in p["traps"])
    unmapped = {u["flag"]: u for u in p["unmapped"]}
    assert unmapped["--max-concurrent-requests"]["note"].startswith("TGI's router refuses")
    assert unmapped["--max-best-of"]["vllm"] is None and "not known to this plan" in unmapped["--frobnicate"]["note"]
    for route in p["routes"].values():
        RouteSpec.model_validate(route)  # the route files deploy as they are
    backends = {b["name"] for b in p["servegate_yaml"]["backends"]}
    assert backends == {"tgi", "vllm"} and p["routes"]["2-canary"]["fallbacks"] == ["tgi"]
    assert p["rollback"].startswith("servegate routes rollback llama")


@pytest.mark.parametrize(("args", "message"), [
    (["--num-shard", "2"], "needs --model-id"),
    (["--model-id", "m", "--num-shard", "two"], "--num-shard 'two' is not a number"),
    (["--model-id", "m", "--kv-cache-dtype", "int8"], "fp8_e4m3fn or fp8_e5m2"),
    (["--model-id", "m", "--quantize", "magic"], "--quantize 'magic'"),
    (["stray"], "cannot read 'stray'"),
])
def test_unreadable_deployments_are_named(args, message):
    with pytest.raises(MigrationError, match=message):
        plan(TGIDeployment.parse(args), "a", "u", "v")


def test_the_cli_writes_the_plan_and_its_files(tmp_path):
    result = CliRunner().invoke(app, ["migrate", "tgi", "--candidate", "sglang", "--format", "json",
                                      "--output", str(tmp_path), "--", *TGI_ARGS])
    assert result.exit_code == 0, result.output
    data = json.loads((tmp_path / "plan.json").read_text())
    assert data["alias"] == "llama-3.1-8b-instruct" and data["candidate"] == "sglang"
    assert yaml.safe_load((tmp_path / "route-2-canary.yaml").read_text())["targets"] == [{"backend": "sglang"}]
    assert {b["kind"] for b in yaml.safe_load((tmp_path / "servegate.yaml").read_text())["backends"]} == {
        "tgi", "sglang"}
    text = CliRunner().invoke(app, ["migrate", "tgi", "--", *TGI_ARGS]).output
    assert "## Steps" in text and "servegate routes deploy llama-3.1-8b-instruct -f route-2-canary.yaml" in text
    bad = CliRunner().invoke(app, ["migrate", "tgi", "--candidate", "trt", "--", *TGI_ARGS])
    assert bad.exit_code == 2 and "vllm or sglang" in bad.output


@pytest.mark.slow
def test_tgi_clients_keep_working_through_shadow_canary_promotion_and_an_automatic_rollback(tmp_path):
    """A TGI-protocol backend (a servegate gateway's TGI API over an upstream that answers
    " tok0 tok1 ...") moves behind alias `llama` to a candidate ("c0 c1 ..."), while TGI's own
    client keeps calling /generate and /generate_stream; then a regressed candidate (slow first
    token) goes out as a canary and the guard rolls it back. No client request fails."""
    from text_generation import Client

    policy = tmp_path / "rollout.yaml"
    policy.write_text("window_s: 60\nmin_requests: 4\ncheck_every_s: 0.2\nmax_ttft_p95_ratio: 1.5\n")
    with contextlib.ExitStack() as stack:
        old_home, new_home = tmp_path / "tgi", tmp_path / "gateway"
        old_home.mkdir()
        new_home.mkdir()
        stub_url = stack.enter_context(serve_app(upstream("tok", chunks=4)))
        tgi_url = stack.enter_context(serve_app(gateway_app({"stub": backend("stub", stub_url)}, old_home)))
        tgi = TGIBackend(OpenAICompatConfig(base_url=tgi_url, model="stub", api_key=ADMIN_KEY), name="tgi")
        candidate = backend("candidate", stack.enter_context(serve_app(upstream("c", chunks=4))))
        regressed = backend("regressed", stack.enter_context(serve_app(upstream("r", chunks=4, delay=0.3))))
        url = stack.enter_context(serve_app(gateway_app(
            {"llama-tgi": tgi, "llama-candidate": candidate, "llama-regressed": regressed}, new_home,
            refresh_s=0.2, route_seed=11, rollout_policy=policy)))
        client = Client(f"{url}/tgi/llama", headers=AUTH, timeout=30)
        answers: list[str] = []

        def ask(times: int) -> None:
            for i in range(times):
                if i % 2:
                    answers.append("".join(r.token.text for r in client.generate_stream("hello", max_new_tokens=8)))
                else:
                    answers.append(client.generate("hello", max_new_tokens=8).generated_text)

        def deploy(spec: dict, canary: float | None = None) -> None:
            body = {"spec": spec} | ({"canary_share": canary} if canary else {})
            assert admin(url, "POST", "/routes/llama/deploy", json=body).status_code == 201

        deploy({"targets": [{"backend": "tgi"}], "shadow": {"backend": "candidate", "share": 1.0}})  # shadow
        ask(4)
        assert all(a.startswith("tok0") for a in answers)  # clients see TGI only
        deadline = time.monotonic() + 10
        while not admin(url, "GET", "/routes/llama/shadow").json():
            assert time.monotonic() < deadline
            time.sleep(0.1)
        shadow = admin(url, "GET", "/routes/llama/shadow").json()[0]
        assert shadow["shadow_backend"] == "candidate" and shadow["errors"] == 0

        deploy({"targets": [{"backend": "candidate"}], "fallbacks": ["tgi"]}, canary=0.5)  # canary
        ask(12)
        assert {a[:4] for a in answers[4:]} == {"tok0", "c0 c"}  # both versions serve their share
        assert admin(url, "POST", "/routes/llama/promote").status_code == 200  # promotion
        time.sleep(0.3)
        ask(4)
        assert all(a.startswith("c0") for a in answers[-4:])

        deploy({"targets": [{"backend": "regressed"}], "fallbacks": ["candidate"]}, canary=0.5)  # regression
        deadline = time.monotonic() + 30
        while not any(c["action"] == "route.rollback.canary"
                      for c in admin(url, "GET", "/routes/llama").json()["changes"]):
            assert time.monotonic() < deadline, "the guard did not roll the regressed canary back"
            ask(2)
        history = admin(url, "GET", "/routes/llama").json()
        reason = next(c for c in history["changes"] if c["action"] == "route.rollback.reason")
        assert reason["actor"] == "canary-guard" and "TTFT p95" in reason["after"]["reason"]
        assert [v["status"] for v in history["versions"]][:2] == ["retired", "active"]  # v4 ended, v3 serves
        time.sleep(0.3)
        ask(4)
        assert all(a.startswith("c0") for a in answers[-4:])
        assert all(a.startswith(("tok0", "c0", "r0")) for a in answers)  # not one failed or empty answer

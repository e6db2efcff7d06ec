"""The operators' console (`/ui`) in headless Chromium, driven by Playwright, against a gateway
with seeded tenants, keys, usage and a route running a canary: log in, create a tenant and a key
(shown once), watch a usage chart grow after requests, cancel a batch, delete a stored response, roll
the canary back, and screenshot every page at laptop and phone widths. `SERVEGATE_UPDATE_SCREENSHOTS=1`
copies them to docs/console/."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import httpx
import pytest
from PIL import Image

from backends.builtin import BuiltinBackend, EngineConfig

from .conftest import ADMIN_KEY, AUTH, bearer, gateway_app, serve_app, wait_ready

pytestmark = pytest.mark.slow

PAGES = ("tenants", "keys", "adapters", "usage", "batches", "responses", "routes", "backends", "audit")
WIDTHS = {"laptop": 1280, "phone": 390}
DOCS = Path(__file__).resolve().parent.parent / "docs" / "console"
# Debian's Chromium as root, without the services it would reach for on a closed network.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]


# Form controls and buttons without an accessible name (a label, aria-label or text).
UNNAMED_CONTROLS = """[...document.querySelectorAll('input, select, button')]
    .filter(el => !(el.labels && el.labels.length) && !el.getAttribute('aria-label') && !el.textContent.trim())
    .map(el => el.outerHTML)"""


@pytest.fixture(scope="module")
def chromium():
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        if os.environ.get("CI"):
            pytest.fail("CI runs this test: .ci/run installs Debian's chromium")
        pytest.skip("Chromium is not installed (.ci/run installs Debian's chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=browser, args=CHROMIUM_ARGS)
        yield launched
        launched.close()


@pytest.fixture(scope="module")
def console(tiny_model_dir, tmp_path_factory):
    """A gateway serving two tiny engines, the first with a LoRA adapter `house`, the route `chat` on
    one with a canary on the other, and some traffic through both and the adapter."""
    from .lora_adapters import make_adapter

    house = make_adapter(tiny_model_dir, tmp_path_factory.mktemp("house"), 8, ["q_proj", "v_proj"], 1)
    backends = {name: BuiltinBackend(EngineConfig(model=str(tiny_model_dir), dtype="float32", served_name=name,
                                                  kv_cache_tokens=2048, engine_process=False,
                                                  lora=[f"house={house}"] if name == "tiny-a" else []), name=name)
                for name in ("tiny-a", "tiny-b")}
    app = gateway_app(backends, tmp_path_factory.mktemp("console"), usage_flush_s=0.1, route_seed=3)
    with serve_app(app) as url:
        wait_ready(url)
        for version, backend, share in ((1, "tiny-a", None), (2, "tiny-b", 0.5)):
            deployed = httpx.post(f"{url}/admin/routes/chat/deploy", headers=AUTH, json={
                "spec": {"targets": [{"backend": backend}]}, **({"canary_share": share} if share else {})})
            assert deployed.status_code == 201 and deployed.json()["version"] == version
        for i in range(6):
            reply = httpx.post(f"{url}/v1/completions", headers=AUTH, timeout=60,
                               json={"model": "chat", "prompt": f"Hello {i}", "max_tokens": 8, "stream": i % 2 == 0})
            assert reply.status_code == 200
        reply = httpx.post(f"{url}/v1/completions", headers=AUTH, timeout=60,
                           json={"model": "house", "prompt": "Hello adapter", "max_tokens": 8})
        assert reply.status_code == 200
        batch_and_responses(url, app.state.gateway.db)
        yield url


def batch_and_responses(url: str, db) -> None:
    """A batch run to its end, one another replica is running (so it stays unfinished) and two stored responses."""
    from datetime import UTC, datetime, timedelta

    from sqlmodel import Session

    from gateway.tables import BatchRecord, StoredResponse

    content = "".join(json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/completions",
                                  "body": {"model": "tiny-a", "prompt": f"Batch {i}", "max_tokens": 4}}) + "\n"
                      for i in range(3))
    source = httpx.post(f"{url}/v1/files", headers=AUTH, files={"file": ("in.jsonl", content.encode())},
                        data={"purpose": "batch"}).json()
    batch = httpx.post(f"{url}/v1/batches", headers=AUTH, json={"input_file_id": source["id"],
                                                                 "endpoint": "/v1/completions"}).json()
    deadline = time.monotonic() + 120
    while httpx.get(f"{url}/v1/batches/{batch['id']}", headers=AUTH).json()["status"] != "completed":
        assert time.monotonic() < deadline, "the batch never completed"
        time.sleep(0.2)
    now = datetime.now(UTC)
    with Session(db) as session:
        session.add(BatchRecord(id="batch_elsewhere", tenant="default", key_prefix="console",
                                endpoint="/v1/completions", input_file_id=source["id"], total=3, completed=1,
                                runner="replica-elsewhere", lease_until=now + timedelta(hours=1), created_at=now,
                                in_progress_at=now, expires_at=now + timedelta(hours=24)))
        for i, tokens in enumerate((12, 30)):
            session.add(StoredResponse(
                id=f"resp_console{i}", tenant="default", key_prefix="console", model="tiny-a",
                messages=[{"role": "user", "content": "never listed"}], input_items=[], created_at=now,
                expires_at=now + timedelta(days=30), body={"status": "completed", "usage": {
                    "input_tokens": tokens, "output_tokens": 4, "total_tokens": tokens + 4}}))
        session.commit()


def test_the_console_from_login_to_rollback_and_its_pages_at_two_widths(chromium, console, tmp_path):
    errors: list[str] = []
    page = chromium.new_page(viewport={"width": 1280, "height": 900})
    page.on("console", lambda message: message.type == "error" and errors.append(message.text))
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.on("dialog", lambda dialog: dialog.accept("rolled back in a test") if dialog.type == "prompt"
            else dialog.accept())

    page.goto(f"{console}/ui/")
    page.get_by_label("Admin or operator key").fill(ADMIN_KEY)  # focused on load; Enter submits
    page.keyboard.press("Enter")
    page.get_by_role("navigation").wait_for()
    assert page.get_by_role("status").inner_text() == "Logged in as an operator."
    assert page.url.endswith("/ui/#/tenants")  # the address names the page drawn, so its link is a no-op

    # A tenant, then a key for it: the key appears once.
    page.get_by_role("link", name="Tenants").click()
    form = page.get_by_role("form", name="Create a tenant")
    form.get_by_label("Name").fill("acme")
    form.get_by_label("Daily budget (USD)").fill("25")
    form.get_by_role("button", name="Create tenant").click()
    page.get_by_role("cell", name="acme", exact=True).wait_for()
    form = page.get_by_role("form", name="Change a tenant's limits")
    form.get_by_label("Tenant").select_option("acme")
    form.get_by_label("Requests/min").fill("600")
    form.get_by_label("Daily budget (USD)").fill("0")  # lifted
    form.get_by_role("button", name="Change limits").click()
    page.get_by_role("status").get_by_text("Tenant acme updated.").wait_for()
    acme = httpx.get(f"{console}/admin/tenants/acme", headers=AUTH).json()
    assert (acme["rpm"], acme["daily_budget_usd"]) == (600, None)
    page.get_by_role("link", name="Keys").click()
    form = page.get_by_role("form", name="Create a key")
    form.get_by_label("Tenant").select_option("acme")
    form.get_by_label("Name").fill("console test")
    form.get_by_role("button", name="Create key").click()
    key = page.locator("#new-key").inner_text()
    assert key.startswith("sg_") and len(key) > 40
    assert httpx.get(f"{console}/v1/models", headers=bearer(key)).status_code == 200
    page.get_by_role("link", name="Usage").click()
    page.wait_for_function("() => document.title.startsWith('Usage')")  # the keys page, with the key, is gone
    page.get_by_role("link", name="Keys").click()
    page.get_by_role("form", name="Create a key").wait_for()
    assert page.locator("#new-key").count() == 0 and key not in page.content()  # never shown again

    # The usage chart grows with the new key's requests (the page refreshes every 5 s).
    page.goto(f"{console}/ui/#/usage?range=1h&by=tenant")
    page.locator(".uplot").first.wait_for()
    assert page.locator(".uplot").count() == 6
    assert "acme" not in page.locator(".charts").inner_text()
    for i in range(3):
        assert httpx.post(f"{console}/v1/completions", headers=bearer(key), timeout=60,
                          json={"model": "tiny-a", "prompt": f"Hi {i}", "max_tokens": 4}).status_code == 200
    page.locator(".charts").get_by_text("acme").first.wait_for(timeout=20_000)  # its series, in the legend
    page.get_by_text("13 requests in the last 1h").wait_for(timeout=20_000)  # the batch's 3 lines among them
    with page.expect_download() as download:
        page.get_by_role("button", name="Export CSV").click()
    exported = Path(download.value.path()).read_text().splitlines()
    assert exported[0].startswith("tenant,at,requests") and any(row.startswith("acme,") for row in exported)
    page.goto(f"{console}/ui/#/usage?range=1h&by=adapter")  # the adapter's usage, a series of its own
    page.locator(".charts").get_by_text("house").first.wait_for(timeout=20_000)

    # Batches with their progress; the unfinished one cancelled from the page. Stored responses, without text.
    page.get_by_role("link", name="Batches").click()
    page.get_by_role("progressbar", name="Batch batch_elsewhere: 1 of 3 lines done").wait_for()
    assert page.get_by_role("cell", name="completed", exact=True).count() == 1
    assert page.get_by_role("button", name="Cancel batch").count() == 1  # the finished one has none
    page.get_by_role("button", name="Cancel batch batch_elsewhere").click()
    page.get_by_role("status").get_by_text("Batch batch_elsewhere cancelling.").wait_for()
    page.get_by_role("cell", name="cancelling", exact=True).wait_for()
    assert page.get_by_role("button", name="Cancel batch").count() == 0
    assert httpx.get(f"{console}/admin/batches/batch_elsewhere", headers=AUTH).json()["status"] == "cancelling"
    page.get_by_role("link", name="Responses").click()
    page.get_by_role("cell", name="resp_console1", exact=True).wait_for()
    assert page.get_by_role("cell", name="30, 4").count() == 1 and "never listed" not in page.content()
    page.get_by_role("button", name="Delete response resp_console0").click()
    page.get_by_role("status").get_by_text("Response resp_console0 deleted.").wait_for()
    page.get_by_role("cell", name="resp_console0", exact=True).wait_for(state="detached")  # the row leaves
    assert [r["id"] for r in httpx.get(f"{console}/admin/responses", headers=AUTH).json()] == ["resp_console1"]

    # The canary, compared live and rolled back from the routes page.
    page.get_by_role("link", name="Routes").click()
    page.get_by_text("Canary v2 (50% of traffic) against v1").wait_for()
    page.get_by_role("button", name="Roll back canary").click()
    page.get_by_role("status").get_by_text("chat: canary rolled back.").wait_for()
    (chat,) = httpx.get(f"{console}/admin/routes", headers=AUTH).json()
    assert chat["canary"] is None and chat["active"]["version"] == 1
    page.get_by_role("cell", name="rolled back in a test").wait_for()  # the reason, in the route's changes
    canary = httpx.post(f"{console}/admin/routes/chat/deploy", headers=AUTH,  # a new one, for the screenshots
                        json={"spec": {"targets": [{"backend": "tiny-b"}]}, "canary_share": 0.5})
    assert canary.status_code == 201
    for i in range(4):
        httpx.post(f"{console}/v1/completions", headers=AUTH, timeout=60,
                   json={"model": "chat", "prompt": f"Again {i}", "max_tokens": 8}).raise_for_status()

    # Every page at both widths: it renders, its charts have points, nothing failed in the console.
    shots = tmp_path / "console"
    shots.mkdir()
    for width_name, width in WIDTHS.items():
        page.set_viewport_size({"width": width, "height": 900})
        for name in PAGES:
            page.goto(f"{console}/ui/#/{name}" + ("?range=1h&by=model" if name == "usage" else ""))
            page.wait_for_function("title => document.title.startsWith(title)", arg=name.capitalize())
            if name == "usage":
                page.locator(".uplot").nth(5).wait_for()
                points = [int(p) for p in page.locator(".uplot").evaluate_all("els => els.map(e => e.dataset.points)")]
                assert len(points) == 6 and min(points) > 0, points
            assert page.evaluate("document.documentElement.scrollWidth") <= width  # no sideways page scroll
            assert page.evaluate(UNNAMED_CONTROLS) == [], name  # a screen reader names every control
            path = shots / f"{name}-{width_name}.png"
            page.screenshot(path=str(path), full_page=True)
            image = Image.open(path).convert("RGB")
            assert image.width == width
            assert len(image.resize((64, 64)).getcolors(maxcolors=4096) or ()) > 8, f"{path.name} looks blank"
    # A tenant's administrator sees its own keys and usage, not the operator's pages.
    tenant_admin = httpx.post(f"{console}/admin/keys", headers=AUTH,
                              json={"tenant": "acme", "scopes": ["admin", "inference"]}).json()["key"]
    page.get_by_role("button", name="Log out").click()
    page.get_by_label("Admin or operator key").fill(tenant_admin)
    page.keyboard.press("Enter")
    page.get_by_role("status").get_by_text("Logged in as a tenant administrator.").wait_for()
    visible = page.get_by_role("navigation").get_by_role("link").all_inner_texts()
    assert visible == ["Keys", "Adapters", "Usage", "Batches", "Responses"]
    assert page.url.endswith("/ui/#/keys")  # not the audit page the operator left, which it may not see
    page.get_by_role("cell", name="console test").wait_for()  # acme's key, and no other tenant's
    assert page.get_by_role("cell", name="default", exact=True).count() == 0
    page.get_by_role("link", name="Batches").click()
    page.get_by_text("0 batches, newest first").wait_for()  # not the default tenant's
    page.get_by_role("link", name="Responses").click()
    page.get_by_text("0 stored responses, newest first").wait_for()
    assert errors == []
    page.close()
    if os.environ.get("SERVEGATE_UPDATE_SCREENSHOTS"):
        DOCS.mkdir(exist_ok=True)
        for shot in shots.iterdir():
            shutil.copy(shot, DOCS / shot.name)


def test_the_console_is_served_with_a_strict_content_security_policy(console):
    page = httpx.get(f"{console}/ui/")
    assert page.status_code == 200 and "servegate console" in page.text
    policy = page.headers["content-security-policy"]
    assert "default-src 'self'" in policy and "frame-ancestors 'none'" in policy
    assert httpx.get(f"{console}/ui/vendor/uPlot.iife.min.js").status_code == 200
    assert httpx.get(f"{console}/admin/tenants").status_code == 401  # the pages hold no data; the API asks the key

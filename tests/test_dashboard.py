"""The coordinator dashboard in a real headless browser (Playwright driving Debian's chromium) against a live
coordinator whose devices are training: the page loads nothing from elsewhere and runs under its own
Content-Security-Policy (waits use
Playwright's locators, which need no eval in the page), asks for the token, shows the
fleet and the rounds advancing, plots quality, pages rejections, and stops training."""
from __future__ import annotations

import shutil
import socket
import threading
import time

import pytest
from conftest import device_datasets

from coordinator.api import create_app
from coordinator.engine import RoundSettings
from coordinator.quality_gate import GateSettings, GateSetup
from coordinator.service import Service, ServiceConfig
from edge_client.daemon import EdgeDevice
from protocol.messages import TrainingConfig

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def live_coordinator(tmp_path):
    import uvicorn

    port = _free_port()
    datasets = device_datasets(tmp_path / "data", 3, ids_per_device=3, images=5)
    # the coordinator's own faces for the quality gate: the third set, which no device holds
    service = Service(ServiceConfig(state=tmp_path / "state", http_port=port,
                                    gate=GateSetup(data=datasets[2], bar=GateSettings(limit=30))),
                      RoundSettings(rounds=50, min_clients=2, round_timeout_s=300,
                                    training=TrainingConfig(epochs=1, batch_size=8, lr=1e-4, dfc_steps=0)))
    server = uvicorn.Server(uvicorn.Config(create_app(service, docs=True), host="127.0.0.1", port=port,
                                           log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    for i in range(3):  # a few refusals to page through
        service.engine.on_message(f"ffr/v1/devices/stranger{i}/hello", b"not json")
    devices = [EdgeDevice(service.admit(f"device{d}"), data, tmp_path / f"home{d}", export_onnx=False)
               for d, data in enumerate(datasets[:2])]
    service.admit("device9")  # admitted, never connects: the fleet table must still show it
    for device in devices:
        device.start()
    yield service, f"http://127.0.0.1:{port}"
    for device in devices:
        device.stop()
    server.should_exit = True
    service.close()


@pytest.fixture
def page():
    assert CHROMIUM, "the dashboard test needs chromium (apt-get install chromium; .ci/run installs it)"
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield browser.new_page(viewport={"width": 1280, "height": 900})
        browser.close()


def test_the_dashboard_shows_a_running_fleet_and_controls_training(live_coordinator, page, tmp_path):
    from playwright.sync_api import expect

    service, url = live_coordinator
    requests: list[str] = []
    page.on("request", lambda request: requests.append(request.url))

    page.goto(f"{url}/dashboard")
    page.wait_for_selector("#auth", state="visible")  # no token: the page holds no data and asks for it
    assert page.locator("#devices tr").count() == 0
    page.fill("#token", "wrong")
    page.click("#save-token")
    expect(page.locator("#error")).to_have_text("wrong token")
    page.fill("#token", service.api_token)
    page.click("#save-token")
    page.wait_for_selector("#auth", state="hidden")

    expect(page.locator("#devices tr")).to_have_count(3, timeout=60_000)
    assert sorted(page.locator("#devices tr td:first-child").all_inner_texts()) == ["device0", "device1", "device9"]
    # the two devices register once their daemons are up: on a loaded machine that takes longer than a default wait
    expect(page.locator("#devices tr.unseen")).to_have_count(1, timeout=240_000)
    expect(page.locator("#devices tr.unseen")).to_contain_text("never connected")
    expect(page.locator("#n-devices")).to_have_text("2 (+1 never seen)")
    # rounds advance while we watch: the model version in the header moves on its own (the page polls)
    expect(page.locator("#rounds tr td:nth-child(2)").first).to_have_text("completed", timeout=240_000)
    first = page.inner_text("#version")
    expect(page.locator("#version")).not_to_have_text(first, timeout=240_000)
    assert int(page.inner_text("#version").lstrip("v")) > int(first.lstrip("v"))
    # quality over rounds: the gate's AUC of every published model, then the operator's evaluation; never a loss
    expect(page.locator("#legend")).to_contain_text("gate AUC")
    service.engine.store.record_evaluation(1, {"auc": 0.9, "eer": 0.1}, "test")
    expect(page.locator("#legend")).to_contain_text("held-out AUC (operator)")
    # and in words, start against now, for whoever would rather read than look
    expect(page.locator("#quality-values")).to_contain_text("gate AUC (coordinator's faces): start v0 ")
    expect(page.locator("#quality-values")).to_contain_text("held-out AUC (operator): start v1 0.9000, now v1 0.9000")
    assert page.locator("#chart polyline").count() >= 3
    assert "loss" not in page.inner_text("#legend")
    # 1280 px: no table wider than its panel (nothing scrolls sideways), no panel past the window
    for table in page.locator("table").all():
        box, panel = table.bounding_box(), table.locator("xpath=ancestor::section").bounding_box()
        assert box["width"] <= panel["width"] + 1 and panel["x"] + panel["width"] <= 1280, (box, panel)
    expect(page.locator("#rej-total")).to_contain_text("3 stored")
    expect(page.locator("#rejections tr")).to_have_count(3)

    page.click("#stop")
    expect(page.locator("#training")).to_have_text("stopped")
    assert service.engine.running is False
    page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
    assert (tmp_path / "dashboard.png").stat().st_size > 10_000

    assert requests and all(r.startswith(url) for r in requests), [r for r in requests if not r.startswith(url)]

    # --api-docs: Swagger UI drawn from files this server serves, with every other host unreachable
    page.route("**/*", lambda route: route.continue_() if route.request.url.startswith(url) else route.abort())
    requests.clear()
    page.goto(f"{url}/docs")
    expect(page.locator(".swagger-ui .opblock").first).to_be_visible(timeout=30_000)
    expect(page.locator(".swagger-ui")).to_contain_text("/dashboard/data")
    assert all(r.startswith(url) for r in requests), requests


def _http(method: str, url: str, body: dict | None = None, token: str | None = None) -> tuple[int, str, dict]:
    import json
    import urllib.error
    import urllib.request

    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    request = urllib.request.Request(url, json.dumps(body).encode() if body is not None else None, headers,
                                     method=method)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read().decode(), {k.lower(): v for k, v in response.headers.items()}
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(), {k.lower(): v for k, v in exc.headers.items()}


def test_dashboard_data_needs_the_token_and_evaluations_are_bounded(live_coordinator):
    import json

    service, url = live_coordinator
    token = service.api_token
    status, text, headers = _http("GET", f"{url}/dashboard")
    assert status == 200 and "frame-ancestors 'none'" in headers["content-security-policy"] and token not in text
    assert _http("GET", f"{url}/dashboard/data")[0] == 401
    assert _http("POST", f"{url}/evaluations", {"model_version": 0, "metrics": {"auc": 0.5}})[0] == 401
    data = json.loads(_http("GET", f"{url}/dashboard/data", token=token)[1])
    assert {"status", "devices", "rounds", "evaluations", "rejections_total"} <= set(data)
    for hostile in ({"model_version": 0, "metrics": {"auc": "NaN"}},
                    {"model_version": -1, "metrics": {}},
                    {"model_version": 0, "metrics": {f"m{i}": 0.0 for i in range(33)}},
                    {"model_version": 0, "metrics": {"<script>": 1.0}},
                    {"model_version": 0, "metrics": {}, "extra": 1}):
        assert _http("POST", f"{url}/evaluations", hostile, token)[0] == 422, hostile
    assert _http("POST", f"{url}/evaluations", {"model_version": 999, "metrics": {}}, token)[0] == 404
    assert _http("POST", f"{url}/evaluations", {"model_version": 0, "metrics": {"auc": 0.75}}, token)[0] == 200
    data = json.loads(_http("GET", f"{url}/dashboard/data", token=token)[1])
    assert data["evaluations"][0]["metrics"] == {"auc": 0.75}

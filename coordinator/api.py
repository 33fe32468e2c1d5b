"""The coordinator's HTTP API (FastAPI): fleet, rounds, the global model, training control, metrics.

Every route that changes state or names a device or a model needs the API token
(`Authorization: Bearer TOKEN`, the token in `STATE/api-token`). A browser never attaches
that header to a cross-site form post, so such posts are refused too. `/health` and
`/metrics` stay open and show counts, never ids; `/public-set` serves FedFR's public faces;
`/dashboard` is a page with no data in it (it fetches `/dashboard/data` with the token).
"""
from __future__ import annotations

import hmac
from pathlib import Path

from fastapi import APIRouter, Depends, FastAPI, HTTPException, Query, Request, Response
from fastapi.responses import FileResponse, HTMLResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Gauge, generate_latest

from coordinator.dashboard import PAGE, Evaluation, dashboard_data
from coordinator.http_guard import HttpGuard
from coordinator.public_set import ROUTE as PUBLIC_SET_ROUTE

MAX_PAGE = 500
DOCS_ASSETS = "/docs-assets"
# the dashboard runs its own inline script and style, talks to this server only, and is never framed
CSP = ("default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; "
       "img-src 'self' data:; frame-ancestors 'none'")


def swagger_ui_files() -> Path | None:
    """Swagger UI's JS and CSS from the installed `swagger-ui-bundle` package (nothing from a CDN), if any."""
    try:
        from swagger_ui_bundle import swagger_ui_path
    except ImportError:
        return None
    path = Path(str(swagger_ui_path))
    return path if (path / "swagger-ui-bundle.js").is_file() else None


def add_offline_docs(app: FastAPI) -> None:
    """/docs as FastAPI draws it, but with Swagger UI's files served by this app, so it works with no internet."""
    from fastapi.openapi.docs import get_swagger_ui_html
    from fastapi.staticfiles import StaticFiles

    files = swagger_ui_files()
    if files is None:
        raise ValueError("--api-docs needs the swagger-ui-bundle package (pip install swagger-ui-bundle); "
                         "the API docs are never loaded from a CDN")
    app.mount(DOCS_ASSETS, StaticFiles(directory=files), name="docs-assets")
    app.openapi_version = "3.0.3"  # the packaged Swagger UI (4.x) draws OpenAPI 3.0 documents, not 3.1

    @app.get("/docs", include_in_schema=False)
    def swagger() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url="/openapi.json", title="ffr-edge coordinator API",
                                   swagger_js_url=f"{DOCS_ASSETS}/swagger-ui-bundle.js",
                                   swagger_css_url=f"{DOCS_ASSETS}/swagger-ui.css",
                                   swagger_favicon_url=f"{DOCS_ASSETS}/favicon-32x32.png")


def create_app(service, docs: bool = False) -> FastAPI:
    """`service`: a `coordinator.service.Service` (its engine, its MQTT state, its API token). `docs`: serve
    /docs and /openapi.json (off by default: they map the API for anyone who can reach the port)."""
    app = FastAPI(title="ffr-edge coordinator", version="2",
                  description="Federated face recognition: fleet status, rounds and the global backbone. "
                              "Send `Authorization: Bearer TOKEN` (the token is in STATE/api-token).",
                  docs_url=None, redoc_url=None, openapi_url="/openapi.json" if docs else None)
    app.add_middleware(HttpGuard, token=service.api_token)  # the token before any body, bodies capped
    if docs:
        add_offline_docs(app)

    def authorised(request: Request) -> None:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), service.api_token.encode()):
            raise HTTPException(401, "missing or wrong API token: send Authorization: Bearer TOKEN "
                                     "(the token is in STATE/api-token)", headers={"WWW-Authenticate": "Bearer"})

    auth = [Depends(authorised)]
    for routes in (fleet_routes, model_routes, dashboard_routes, metrics_routes):
        app.include_router(routes(service, auth))
    return app


def fleet_routes(service, auth: list) -> APIRouter:
    """Health (open), and the fleet's state, rounds and refusals; pausing and resuming training."""
    router, engine, view = APIRouter(), service.engine, service.engine.view

    @router.get("/health")
    def health() -> dict:
        broker = service.broker_health()
        return {"status": "ok" if broker["mqtt"] == "connected" else "degraded", **broker, **view.status()}

    @router.get("/status", dependencies=auth)
    def status() -> dict:
        return {"mqtt": service.mqtt_state(), **view.status(with_ids=True)}

    @router.get("/devices", dependencies=auth)
    def devices() -> list[dict]:
        return view.devices()

    @router.get("/rounds", dependencies=auth)
    def rounds() -> list[dict]:
        return view.rounds()

    @router.get("/rejections", dependencies=auth)
    def rejections(offset: int = Query(0, ge=0), limit: int = Query(100, ge=1, le=MAX_PAGE)) -> dict:
        return {"total_stored": view.count_rejections(), "offset": offset, "limit": limit,
                "items": view.rejections(offset, limit)}

    @router.post("/training/stop", dependencies=auth)
    def stop() -> dict:
        engine.pause()
        return view.status()

    @router.post("/training/start", dependencies=auth)
    def start() -> dict:
        engine.resume()
        return view.status()

    return router


def model_routes(service, auth: list) -> APIRouter:
    """The global model's versions and bytes, operators' evaluations of them, and FedFR's public set (open)."""
    router, view = APIRouter(), service.engine.view

    @router.get("/model", dependencies=auth)
    def model() -> dict:
        status = view.status()
        return {"version": status["model_version"], "sha256": status["model_sha256"], "versions": view.models(),
                "download": f"/model/{status['model_version']}/download"}

    @router.get("/model/{version}/download", dependencies=auth)
    def download(version: int) -> Response:
        data = view.model_file(version)
        if data is None:
            raise HTTPException(404, f"no model version {version}")
        return Response(data, media_type="application/octet-stream",
                        headers={"Content-Disposition": f'attachment; filename="backbone-v{version}.safetensors"'})

    @router.post("/evaluations", dependencies=auth)
    def evaluation(body: Evaluation) -> dict:
        """An operator's held-out evaluation of a model version, plotted on the dashboard."""
        if view.model_file(body.model_version) is None:
            raise HTTPException(404, f"no model version {body.model_version}")
        service.record_evaluation(body.model_version, body.metrics, body.source)
        return {"recorded": body.model_version}

    @router.get(PUBLIC_SET_ROUTE)
    def public_set() -> Response:
        """FedFR's public set D_g (open: public faces of nobody's people; devices check its signed sha256)."""
        path = service.config.public_set
        if path is None:
            raise HTTPException(404, "this coordinator serves no public set (ffr coordinator serve --public-set)")
        return FileResponse(path, media_type="application/octet-stream", filename="public_set.safetensors")

    return router


def dashboard_routes(service, auth: list) -> APIRouter:
    router = APIRouter()

    @router.get("/dashboard", response_class=HTMLResponse)
    def dashboard() -> HTMLResponse:
        """The fleet dashboard (self-contained: it loads nothing from anywhere else; its data needs the token)."""
        return HTMLResponse(PAGE.read_text(), headers={"Content-Security-Policy": CSP, "X-Frame-Options": "DENY"})

    @router.get("/dashboard/data", dependencies=auth)
    def dashboard_json() -> dict:
        return dashboard_data(service)

    return router


def metrics_routes(service, auth: list) -> APIRouter:
    """Prometheus gauges at /metrics (open, as scrapers expect: counts only, no ids)."""
    router, view, registry = APIRouter(), service.engine.view, CollectorRegistry()
    gauges = {name: Gauge(f"ffr_{name}", doc, registry=registry) for name, doc in (
        ("model_version", "current global model version"), ("completed_rounds", "rounds aggregated so far"),
        ("devices", "registered devices"), ("rejected_messages", "messages refused since the coordinator started"),
        ("handler_errors", "unexpected errors while handling a message"))}

    @router.get("/metrics")
    def metrics() -> Response:
        status = view.status()
        gauges["model_version"].set(status["model_version"])
        gauges["completed_rounds"].set(status["completed_rounds"])
        gauges["devices"].set(len(view.registered()))
        gauges["rejected_messages"].set(status["messages_rejected"])
        gauges["handler_errors"].set(status["handler_errors"])
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return router

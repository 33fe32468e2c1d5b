"""The coordinator's HTTP API (FastAPI): fleet, rounds, the global model, training control, metrics."""
from __future__ import annotations

from fastapi import FastAPI, HTTPException, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Gauge, generate_latest

from coordinator.engine import Engine


def create_app(engine: Engine) -> FastAPI:
    app = FastAPI(title="ffr-edge coordinator", version="1",
                  description="Federated face recognition: fleet status, rounds and the global backbone.")
    store = engine.store
    registry = CollectorRegistry()
    gauges = {name: Gauge(f"ffr_{name}", doc, registry=registry) for name, doc in (
        ("model_version", "current global model version"), ("completed_rounds", "rounds aggregated so far"),
        ("devices", "registered devices"), ("rejected_messages", "messages refused since the state was created"))}

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok", **engine.status()}

    @app.get("/devices")
    def devices() -> list[dict]:
        return store.devices()

    @app.get("/rounds")
    def rounds() -> list[dict]:
        return store.rounds()

    @app.get("/rejections")
    def rejections() -> list[dict]:
        return store.rejections()

    @app.get("/model")
    def model() -> dict:
        status = engine.status()
        return {"version": status["model_version"], "sha256": status["model_sha256"], "versions": store.models(),
                "download": f"/model/{status['model_version']}/download"}

    @app.get("/model/{version}/download")
    def download(version: int) -> Response:
        data = store.model_bytes(version)
        if data is None:
            raise HTTPException(404, f"no model version {version}")
        return Response(data, media_type="application/octet-stream",
                        headers={"Content-Disposition": f'attachment; filename="backbone-v{version}.safetensors"'})

    @app.post("/training/stop")
    def stop() -> dict:
        engine.running = False
        return engine.status()

    @app.post("/training/start")
    def start() -> dict:
        engine.running = True
        return engine.status()

    @app.get("/metrics")
    def metrics() -> Response:
        status = engine.status()
        gauges["model_version"].set(status["model_version"])
        gauges["completed_rounds"].set(status["completed_rounds"])
        gauges["devices"].set(len(store.devices()))
        gauges["rejected_messages"].set(len(store.rejections()))
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app

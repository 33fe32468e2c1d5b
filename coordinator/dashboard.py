"""The coordinator dashboard: one self-contained page (`dashboard.html`: no build step, nothing loaded from
anywhere but this server) and the one JSON document it polls, built here from the engine's read-only view.

The page itself holds no data and is served openly; its data comes from `GET /dashboard/data`, which
needs the API token like every route that names devices (the page asks for it and keeps it in the
browser tab's sessionStorage only).
"""
from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from protocol.messages import MAX_INT, MetricName

PAGE = Path(__file__).with_name("dashboard.html")
MAX_ROUNDS_SHOWN = 200


class Evaluation(BaseModel):
    """An operator's held-out evaluation of one model version (the coordinator has no faces to test on)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    model_version: int = Field(ge=0, le=MAX_INT)
    metrics: dict[MetricName, float] = Field(max_length=32)
    source: str = Field("operator", max_length=64, pattern=r"^[A-Za-z0-9_.@ -]*$")


def dashboard_data(service) -> dict:
    """Everything the page shows, in one document: status, fleet (and devices admitted but never seen), rounds,
    quality over rounds."""
    view = service.engine.view
    dropped = view.dropped_rounds()
    devices = [{"device_id": d["device_id"], "last_seen": d["last_seen"], "rounds_joined": d["rounds_joined"],
                "rounds_dropped": dropped.get(d["device_id"], 0), "n_images": d["n_images"],
                "n_identities": d["n_identities"]} for d in view.devices()]
    rounds = [_round_row(r) for r in view.rounds()[-MAX_ROUNDS_SHOWN:]]
    return {"status": {"mqtt": service.mqtt_state(), **view.status()}, "devices": devices,
            "admitted_never_seen": view.admitted_never_seen(), "rounds": rounds,
            "evaluations": view.evaluations(), "rejections_total": view.count_rejections()}


def _round_row(r: dict) -> dict:
    m = r["metrics"]
    duration = (r["closed_at"] - r["started_at"]) if r["closed_at"] and r["started_at"] else None
    return {"round_id": r["round_id"], "status": r["status"], "base_version": r["base_version"],
            "new_version": r["new_version"], "participants": len(r["participants"]), "updates": r["n_updates"],
            "dropped": r["n_dropped"], "bytes": m.get("bytes_received"), "duration_s": duration,
            "started_at": r["started_at"], "codec": m.get("codec"), "reason": r["reason"] or "",
            "mean_loss": m.get("mean_train_loss", m.get("mean_loss")), "mean_acc": m.get("mean_train_acc"),
            # quality measured by the coordinator itself: the gate's AUC on its faces (before and after the round)
            # and the Federated Validation score of the weighting chosen
            "gate_auc_before": m.get("gate_auc_current"), "gate_auc_after": m.get("gate_auc_candidate"),
            "gate_auc_start": m.get("gate_auc_start"), "server_step": m.get("server_step"),
            "fv_score": _chosen_fv_score(m)}


def _chosen_fv_score(m: dict) -> float | None:
    scores, chosen = m.get("fv_mean_scores"), m.get("fv_chosen")
    if not scores or not chosen or not 1 <= chosen <= len(scores):
        return None
    return scores[chosen - 1]

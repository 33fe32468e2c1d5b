"""The device's verifying models: ONNX exports of the generic and personalised embedders, sealed in its vault.

`ffr device` verifies only with sealed models, and with the newest: the personalised one is written last.
"""
from __future__ import annotations

from edge_client.home import DeviceHome
from models.networks.face_model import FaceModel


def export_models(model: FaceModel, home: DeviceHome, device_id: str) -> None:
    from edge_client.recognizer import seal_model
    from edge_client.vault import Vault
    from models.networks.onnx_export import export_onnx

    vault = Vault.open(home.root / "store")
    export_onnx(model, home.generic_onnx, personalised=False, extra={"device": device_id})
    seal_model(home, vault, home.generic_onnx)
    if model.dfc is not None:
        export_onnx(model, home.personalised_onnx, personalised=True, extra={"device": device_id})
        seal_model(home, vault, home.personalised_onnx)

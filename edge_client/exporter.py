"""The device's verifying models, sealed in its vault: the global model the round received (`generic.onnx`) and the
device's personalised one (its local backbone with the DFC branch, `personalised.onnx`); then the choice between
them, with the threshold that goes with it (`edge_client.verifier_choice`)."""
from __future__ import annotations

import numpy as np
import torch

from edge_client.home import DeviceHome
from models.networks.face_model import FaceModel, load_shareable_state, shareable_state


def export_models(model: FaceModel, home: DeviceHome, device_id: str,
                  global_state: dict[str, torch.Tensor] | None = None, images: np.ndarray | None = None,
                  labels: np.ndarray | None = None, negatives: np.ndarray | None = None,
                  personalised: FaceModel | None = None, judged: np.ndarray | None = None,
                  public_sha256: str | None = None) -> str | None:
    """Export and seal both models (`global_state`: the generic model's backbone; None: the model's own;
    `personalised`: the model whose DFC embedding is exported as the personalised one, default `model`'s); with the
    device's faces (`images`, `labels`; `negatives`: public faces of nobody's people; `judged`: a mask of the images
    the personalised branch was not fitted on, default all; `public_sha256`: the received public set `negatives`
    come from, sealed so that `ffr device calibrate` uses that file only) choose which one verifies and recalibrate
    it. Returns the log line of that choice."""
    from edge_client.recognizer import seal_model
    from edge_client.vault import Vault
    from edge_client.verifier_choice import choose
    from models.networks.onnx_export import export_onnx

    vault = Vault.open(home.root / "store")
    local = shareable_state(model)
    if global_state is not None:
        load_shareable_state(model, global_state)
    try:
        export_onnx(model, home.generic_onnx, personalised=False, extra={"device": device_id})
    finally:
        load_shareable_state(model, local)
    seal_model(home, vault, home.generic_onnx)
    personalised = personalised or model
    if personalised.dfc is not None:
        export_onnx(personalised, home.personalised_onnx, personalised=True, extra={"device": device_id})
        seal_model(home, vault, home.personalised_onnx)
    if images is None or labels is None:
        return None
    choice = choose(home, vault, images, labels, negatives, judged, public_sha256)
    return None if choice is None else choice.line()

"""After a round a device verifies with the better of the global and its personalised model, recalibrated on its own
people and public negatives; real ONNX exports, real ONNX Runtime, SYNTHETIC faces."""
from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from edge_client.exporter import export_models
from edge_client.home import DeviceHome
from edge_client.recognizer import Calibration, Recognizer, Settings, current_model, file_sha256
from edge_client.vault import Vault
from models.faces.crops import CropConfig, crop_index
from models.faces.datasets import load_index
from models.networks.face_model import FaceModel, ModelConfig, initial_global_state, load_shareable_state


@pytest.fixture(scope="module")
def faces(tmp_path_factory):
    """4 people of 6 faces each on the device, and 60 public faces of nobody's people."""
    from models.faces.synthetic import write_dataset

    root = tmp_path_factory.mktemp("faces")
    own = crop_index(load_index(write_dataset(root / "own", 4, 6, seed=5)), CropConfig(detector="none"),
                     use_cache=False, progress=False)
    public = crop_index(load_index(write_dataset(root / "public", 60, 2, seed=6)), CropConfig(detector="none"),
                        use_cache=False, progress=False)
    return own.images, own.labels, public.images[::2]


def _calibrated_home(path, far: float = 0.05) -> DeviceHome:
    """A home whose owner once ran `ffr device calibrate --far 0.05` (a FAR these few faces can measure)."""
    home = DeviceHome(path)
    vault = Vault.open(home.root / "store")
    settings = Settings.load(home, vault)
    settings.calibration = Calibration(0.5, far, 0.1, True, 10, 100, "0" * 64)
    settings.save(home, vault)
    return home


def _face_state() -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(v.copy()) for k, v in initial_global_state().items()}


def _blind_state() -> dict[str, torch.Tensor]:
    """A backbone that maps every face to one point (its embedding layer zeroed): it tells no one apart."""
    state = _face_state()
    state["backbone.embedding.weight"] = torch.zeros_like(state["backbone.embedding.weight"])
    return state


def _model(backbone: dict[str, torch.Tensor]) -> FaceModel:
    model = FaceModel(ModelConfig(n_classes=4, pretrained=False, dfc=True))
    load_shareable_state(model, backbone)
    return model.eval()


def test_a_device_keeps_the_global_model_when_its_personalised_one_is_worse(tmp_path, faces, caplog):
    home, (images, labels, public) = _calibrated_home(tmp_path / "home"), faces
    with caplog.at_level(logging.INFO):
        line = export_models(_model(_blind_state()), home, "dev", _face_state(), images, labels, public)
    vault = Vault.open(home.root / "store")
    settings = Settings.load(home, vault)
    assert current_model(home, vault) == home.generic_onnx and settings.verifier == "generic.onnx"
    assert home.personalised_onnx.exists(), "exported and sealed, but not the one that decides"
    assert "with the generic model" in line and "personalised 0.000" in line and "own people TAR 0.900 ->" in line
    # the threshold belongs to the model that decides, set on these faces for the device's FAR
    assert settings.calibration.model_sha256 == file_sha256(home.generic_onnx)
    assert settings.calibration.far_target == 0.05 and settings.calibration.measurable


def test_a_better_personalised_model_is_used_and_every_new_model_is_recalibrated(tmp_path, faces):
    home, (images, labels, public) = _calibrated_home(tmp_path / "home"), faces
    export_models(_model(_face_state()), home, "dev", _blind_state(), images, labels, public)
    vault = Vault.open(home.root / "store")
    first = Settings.load(home, vault).calibration
    assert current_model(home, vault) == home.personalised_onnx
    assert first.model_sha256 == file_sha256(home.personalised_onnx)
    # the next round brings other weights: the device recalibrates rather than keep the old threshold
    moved = _face_state()
    moved["backbone.embedding.weight"] = moved["backbone.embedding.weight"] * 1.5 + 0.02
    line = export_models(_model(moved), home, "dev", moved, images, labels, public)
    second = Settings.load(home, vault).calibration
    assert second.model_sha256 == file_sha256(current_model(home, vault)) != first.model_sha256
    assert second.threshold != first.threshold and second.far_target == first.far_target
    assert f"threshold {first.threshold:.3f} -> {second.threshold:.3f}" in line
    # and `ffr device verify` holds it for the model it now uses: calibrated, not 'for an older model'
    assert Recognizer(home, vault).threshold_note == (
        "calibrated for FAR 0.05, raised for each person whom strangers resemble")  # the public set gave each their own


def test_without_strangers_faces_the_personalised_model_never_keeps_the_door(tmp_path, faces):
    """The same better personalised model as above, but the device has no public set: nothing to tell how many
    strangers its threshold lets in, so the global model verifies, and the log line says why."""
    home, (images, labels, _) = _calibrated_home(tmp_path / "home"), faces
    line = export_models(_model(_face_state()), home, "dev", _blind_state(), images, labels, None)
    vault = Vault.open(home.root / "store")
    assert current_model(home, vault) == home.generic_onnx
    assert "not used without strangers' faces" in line and "with the generic model" in line
    from edge_client.verifier_choice import Choice

    unmeasured = Choice(home.generic_onnx, Calibration(0.4, 1e-3, 0.05, False, 40, 240, "0" * 64), {"generic": 0.95},
                        None)
    assert "too few to count a FAR of 0.001" in unmeasured.line()  # 240 impostor scores cannot measure 1e-3


def test_without_faces_to_judge_by_the_last_model_exported_decides(tmp_path):
    home = DeviceHome(tmp_path / "home")
    assert export_models(_model(_face_state()), home, "dev") is None
    vault = Vault.open(home.root / "store")
    assert current_model(home, vault) == home.personalised_onnx and Settings.load(home, vault).calibration is None
    assert np.isfinite(Recognizer(home, vault).threshold)


@pytest.mark.parametrize("named", ["../../device.json", "/etc/passwd", "missing.onnx", ""])
def test_a_verifier_name_that_is_not_one_of_the_homes_models_is_never_opened(tmp_path, named):
    """`device.json` is sealed, but what it names is still only looked up among the home's two model files."""
    home = DeviceHome(tmp_path / "home")
    export_models(_model(_face_state()), home, "dev")
    vault = Vault.open(home.root / "store")
    settings = Settings.load(home, vault)
    settings.verifier = named
    settings.save(home, vault)
    assert current_model(home, vault) in (home.generic_onnx, home.personalised_onnx)


def test_the_choice_is_made_on_images_the_personalised_branch_was_not_fitted_on():
    from edge_client.verifier_choice import check_split

    labels = np.repeat(np.arange(3), [4, 8, 21])
    mask = check_split(labels, seed=1)
    held = [int(mask[labels == k].sum()) for k in range(3)]
    assert held == [2, 2, 5]  # a quarter of each person's, at least two (genuine pairs), the rest left to the fit
    assert all((~mask[labels == k]).sum() >= 2 for k in range(3))
    assert np.array_equal(mask, check_split(labels, seed=1)) and not np.array_equal(mask, check_split(labels, seed=2))
    small = check_split(np.repeat(np.arange(3), [4, 3, 9]))  # a person with 3 images is fitted on, not judged
    assert [int(small[np.repeat(np.arange(3), [4, 3, 9]) == k].sum()) for k in range(3)] == [2, 0, 2]
    assert check_split(np.repeat(np.arange(3), [4, 3, 2])) is None  # one person to judge on: no impostor among them


def test_the_public_set_a_calibration_took_strangers_from_is_sealed_with_it(tmp_path, faces):
    """So that `ffr device calibrate` later takes strangers from that file only, never from one planted beside it."""
    home, (images, labels, public) = _calibrated_home(tmp_path / "home"), faces
    export_models(_model(_face_state()), home, "dev", _blind_state(), images, labels, public, public_sha256="ab" * 32)
    vault = Vault.open(home.root / "store")
    assert Settings.load(home, vault).public_set == "ab" * 32
    export_models(_model(_face_state()), home, "dev", _blind_state(), images, labels, None, public_sha256="ab" * 32)
    assert Settings.load(home, vault).public_set is None  # no strangers were used: nothing to take them from


def test_the_personalised_model_must_win_outright_and_only_with_strangers_to_calibrate_on():
    from edge_client.verifier_choice import preferred

    assert preferred({"global": 0.90, "personalised": 0.95}, strangers=True) == "personalised"
    assert preferred({"global": 0.90, "personalised": 0.90}, strangers=True) == "global"  # a tie keeps the shared one
    assert preferred({"global": 0.90, "personalised": 0.95}, strangers=False) == "global"
    assert preferred({"global": 0.90}, strangers=True) == "global"
    assert preferred({"personalised": 0.80}, strangers=False) == "personalised"  # the only model a device has


def test_a_lead_within_chance_on_the_judged_faces_keeps_the_global_model():
    """The fleet device that chose its personalised model by one face of 71 judged scores (0.732 against 0.718) kept
    5 points fewer of its people; a lead of 8.6 points on as many scores is not chance."""
    from edge_client.verifier_choice import chance, preferred

    assert preferred({"global": 0.718, "personalised": 0.732}, True, judged=71) == "global"
    assert preferred({"global": 0.718, "personalised": 0.732}, True) == "personalised"  # judged unknown: any lead
    assert preferred({"global": 0.796, "personalised": 0.882}, True, judged=71) == "personalised"
    assert preferred({"global": 0.98, "personalised": 1.0}, True, judged=200) == "personalised"  # 0.98 +- 0.0099
    assert preferred({"global": 0.90, "personalised": 0.80}, True, judged=10) == "global"
    assert chance(0.718, 0.732, 71) == pytest.approx(((0.718 * 0.282 + 0.732 * 0.268) / 71) ** 0.5)
    assert chance(1.0, 1.0, 50) == 0.0 and chance(0.5, 0.5, 0) == 0.0


def test_the_shift_first_measured_on_a_public_set_is_the_floor_of_every_later_model(tmp_path, faces):
    """A global model the device's updates went into pushes its people apart, so the capture shift measured on them
    falls round by round, and the threshold with it. The first shift measured on a public set goes on with the
    calibration and no later model on that set is moved less; a new public set measures its own."""
    home, (images, labels, public) = _calibrated_home(tmp_path / "home"), faces
    vault = Vault.open(home.root / "store")
    export_models(_model(_blind_state()), home, "dev", _face_state(), images, labels, public, public_sha256="ab" * 32)
    first = Settings.load(home, vault).calibration
    assert first.shift_floor == first.capture_shift  # the first on this set: its own measurement
    settings = Settings.load(home, vault)
    settings.calibration.shift_floor = first.capture_shift + 0.2  # as if the first model had measured more
    settings.save(home, vault)
    export_models(_model(_blind_state()), home, "dev", _face_state(), images, labels, public, public_sha256="ab" * 32)
    floored = Settings.load(home, vault).calibration
    assert floored.shift_floor == pytest.approx(first.capture_shift + 0.2)
    assert floored.capture_shift == pytest.approx(first.capture_shift + 0.2) and floored.threshold > first.threshold
    export_models(_model(_blind_state()), home, "dev", _face_state(), images, labels, public, public_sha256="cd" * 32)
    fresh = Settings.load(home, vault).calibration
    assert fresh.capture_shift == pytest.approx(first.capture_shift) == fresh.shift_floor  # another set: measured
    from dataclasses import replace

    from edge_client.vault import VaultError

    good = Settings.load(home, vault)
    for hostile in (5.0, float("nan"), "x", "0.5", True, [0.1]):  # no cosine difference, or no number: refused
        Settings(replace(good.calibration, shift_floor=hostile), good.models, good.verifier, good.public_set).save(
            home, vault)
        with pytest.raises(VaultError, match="damaged"):
            Settings.load(home, vault)

"""`bench.two_device_serve`'s door at the start: the shipped model, calibrated as a device's first round calibrates,
scored on real strangers (ORL faces, real YuNet crops and ONNX Runtime)."""
from __future__ import annotations

from pathlib import Path

from bench.two_device_serve import start_door
from models.networks.face_weights import write_default_onnx


def _people(source: Path, names: list[str], out: Path) -> Path:
    out.mkdir()
    for name in names:
        (out / name).symlink_to(source / name)
    return out


def test_the_start_door_is_the_shipped_model_calibrated_and_tried_on_every_stranger(tmp_path, faces_dir):
    names = sorted(p.name for p in (faces_dir / "orl").iterdir() if p.is_dir())
    own = _people(faces_dir / "orl", names[:3], tmp_path / "own")
    strangers = _people(faces_dir / "orl", names[3:5], tmp_path / "strangers")
    shipped = write_default_onnx(tmp_path / "shipped.onnx")
    home = tmp_path / "dev_home"  # a device that never ran: no public set was served to it

    door = start_door(home, own, strangers, shipped)

    assert door["model"] == "shipped.onnx" and door["far_promised"] == 1e-3
    assert len(door["person_thresholds"]) == 3 and min(door["person_thresholds"]) >= round(door["threshold"], 4)
    photos = door["strangers_photos"]
    assert photos == sum(len(list((strangers / n).iterdir())) for n in names[3:5])
    # the FAR is every stranger's photo against every person's template: the matches listed make it up
    assert abs(door["far"] - sum(door["matches"].values()) / (photos * 3)) < 1e-12
    assert all(" as " in pair for pair in door["matches"])


def _home_naming_a_public_set(tmp_path: Path, sha256: str) -> Path:
    """A device home whose sealed settings say its last round calibrated on the public set `sha256`."""
    from edge_client.home import DeviceHome
    from edge_client.recognizer import Settings
    from edge_client.vault import Vault

    home = DeviceHome(tmp_path / "dev_home")
    vault = Vault.open(home.root / "store")
    settings = Settings.load(home, vault)
    settings.public_set = sha256
    settings.save(home, vault)
    (home.root / "public").mkdir(exist_ok=True)
    return home.root


def test_the_start_door_refuses_a_public_set_that_is_not_the_one_its_settings_name(tmp_path, faces_dir):
    """Hostile files in the home's public folder: the named set swapped for other bytes is refused by its hash, and a
    file the settings do not name is never read (as `ffr device calibrate` treats them)."""
    import pytest

    from models.public_set import PublicSetError

    names = sorted(p.name for p in (faces_dir / "orl").iterdir() if p.is_dir())
    own = _people(faces_dir / "orl", names[:3], tmp_path / "own")
    strangers = _people(faces_dir / "orl", names[3:4], tmp_path / "strangers")
    shipped = write_default_onnx(tmp_path / "shipped.onnx")
    named = "ab" * 32
    home = _home_naming_a_public_set(tmp_path, named)
    (home / "public" / f"{named}.safetensors").write_bytes(b"not the set the device was served")
    with pytest.raises(PublicSetError, match="does not match its sha256"):
        start_door(home, own, strangers, shipped)

    (home / "public" / f"{named}.safetensors").unlink()
    (home / "public" / f"{'cd' * 32}.safetensors").write_bytes(b"\x00garbage someone left")  # named by nobody
    door = start_door(home, own, strangers, shipped)  # calibrated without strangers' faces, the stray never read
    assert door["model"] == "shipped.onnx" and 0.0 <= door["far"] <= 1.0

    traversal = _home_naming_a_public_set(tmp_path / "other", "../../../etc/passwd")
    assert start_door(traversal, own, strangers, shipped)["model"] == "shipped.onnx"  # a hash that is no hash: unread

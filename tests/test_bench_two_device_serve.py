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

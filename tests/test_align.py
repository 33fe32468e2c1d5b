"""Five-point alignment: landmarks land on the template; photos without a face take the documented fallbacks."""
from __future__ import annotations

import json

import cv2
import numpy as np
import pytest

from models.faces.align import align_face, apply_transform, similarity_transform, template


def _dots(points: np.ndarray, shape=(480, 640)) -> np.ndarray:
    image = np.zeros((*shape, 3), np.uint8)
    for x, y in points:
        cv2.circle(image, (int(round(x)), int(round(y))), 4, (255, 255, 255), -1, lineType=cv2.LINE_AA)
    return image


def _centroids(image: np.ndarray) -> np.ndarray:
    grey = cv2.cvtColor(image, cv2.COLOR_RGB2GRAY)
    n, _, _, centres = cv2.connectedComponentsWithStats((grey > 60).astype(np.uint8))
    return centres[1:]


def test_landmarks_of_a_rotated_scaled_face_land_on_the_template_within_a_pixel():
    """Dots drawn at landmark positions (the template moved by a known similarity) end up on the template."""
    angle, scale, shift = np.deg2rad(17.0), 2.6, np.array([250.0, 140.0])
    rot = np.array([[np.cos(angle), -np.sin(angle)], [np.sin(angle), np.cos(angle)]])
    landmarks = template(112) @ (scale * rot).T + shift
    size = 128
    matrix = similarity_transform(landmarks, template(size))
    assert np.abs(apply_transform(matrix, landmarks) - template(size)).max() < 1e-6
    aligned = align_face(_dots(landmarks), landmarks, size)
    found = _centroids(aligned)
    assert len(found) == 5
    for point in template(size):
        assert np.linalg.norm(found - point, axis=1).min() < 1.0


def test_yunet_crops_of_real_photos_are_aligned(faces_dir):
    """YuNet's landmarks on a CelebA photo; after alignment they sit near the template (a face is not the template)."""
    from models.faces.crops import CropConfig, build_detectors
    from models.faces.detect import select_face
    from models.faces.imageio import read_rgb

    detectors = build_detectors(CropConfig())
    assert [d.name for d in detectors] == ["yunet", "haar"]
    photos = sorted((faces_dir / "celeba_subset").rglob("*.jpg"))[:10]
    residuals = []
    for photo in photos:
        rgb = read_rgb(photo)
        box = select_face(detectors[0].detect(rgb), rgb.shape, "center")
        if box is None:
            continue
        landmarks = np.asarray(box.landmarks).reshape(5, 2)
        moved = apply_transform(similarity_transform(landmarks, template(128)), landmarks)
        residuals.append(np.linalg.norm(moved - template(128), axis=1).mean())
    assert len(residuals) >= 8
    assert np.median(residuals) < 4.0  # pixels at 128 px


def test_face_selection_center_vs_largest():
    from models.faces.detect import Box, select_face

    big_aside, small_centre = Box(0, 0, 200, 200), Box(270, 190, 100, 100)
    assert select_face([big_aside, small_centre], (480, 640), "largest") is big_aside
    assert select_face([big_aside, small_centre], (480, 640), "center") is small_centre
    with pytest.raises(ValueError, match="face selection"):
        select_face([big_aside], (480, 640), "nearest")


def test_photo_without_a_face_falls_back_and_is_counted(tmp_path):
    """No face: the centre square when asked for (counted, also when read back from the cache), else skipped and
    named."""
    from models.faces.crops import CropConfig, crop_index
    from models.faces.datasets import load_index
    from models.faces.imageio import write_image

    rng = np.random.default_rng(0)
    for person in ("a", "b"):
        (tmp_path / "data" / person).mkdir(parents=True)
        for k in range(2):
            write_image(tmp_path / "data" / person / f"{k}.png", rng.integers(0, 40, (200, 160, 3), dtype=np.uint8))
    index = load_index(tmp_path / "data")
    for _ in range(2):  # the second pass reads the cache: the counts must not change
        crops = crop_index(index, CropConfig(fallback_center=True), cache_dir=tmp_path / "cache", progress=False)
        assert len(crops) == 4 and crops.report.n_center_fallback == 4 and crops.report.n_aligned == 0
    from models.faces.crops import CropConfig as Config
    from models.faces.crops import build_detectors, crop_face
    from models.faces.datasets import DatasetError

    thumbnail = rng.integers(0, 255, (24, 24, 3), dtype=np.uint8)  # too small to detect anything in: never "aligned"
    assert crop_face(thumbnail, build_detectors(Config()), Config(fallback_center=True))[1] == "center"
    with pytest.raises(DatasetError, match="without a detected face"):
        crop_index(index, CropConfig(fallback_center=False), cache_dir=tmp_path / "cache", progress=False)


def test_eval_with_pairs_keeps_every_pair_and_reports_fallbacks(tmp_path, faces_dir, capsys):
    """`ffr eval --pairs`: a photo with no face is cut at its centre, so no pair is dropped; the count is reported."""
    import shutil

    from ffr.cli import main
    from models.faces.imageio import write_image
    from models.networks.face_weights import write_default_onnx

    people = sorted(p for p in (faces_dir / "celeba_subset").iterdir() if p.is_dir())[:2]
    data = tmp_path / "lfw"
    for person in people:
        (data / person.name).mkdir(parents=True)
        for k, photo in enumerate(sorted(person.glob("*.jpg"))[:2], start=1):
            shutil.copy(photo, data / person.name / f"{person.name}_{k:04d}.jpg")
    (data / "wall").mkdir()
    write_image(data / "wall" / "wall_0001.jpg", np.full((200, 200, 3), 90, np.uint8))  # no face at all
    shutil.copy(data / people[1].name / f"{people[1].name}_0002.jpg", data / "wall" / "wall_0002.jpg")
    a, b = people[0].name, people[1].name
    # two folds of one genuine + one impostor pair each (LFW's header: folds, pairs per class and fold)
    (tmp_path / "pairs.txt").write_text(f"2\t1\n{a}\t1\t2\nwall\t1\t{a}\t1\n{b}\t1\t2\n{a}\t2\t{b}\t1\n")
    model = write_default_onnx(tmp_path / "m.onnx")
    rc = main(["-q", "eval", "--model", str(model), "--data", str(data), "--layout", "lfw",
               "--pairs", str(tmp_path / "pairs.txt"), "--face-select", "center", "--json", "--no-cache"])
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    assert report["pairs_skipped"] == 0
    assert report["center_fallbacks"] >= 1 and report["faces_aligned"] >= 5

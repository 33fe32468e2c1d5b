"""Reading images and dataset layouts: every format, every layout, bad files named and skipped."""
from __future__ import annotations

import logging

import numpy as np
import pytest

from models.faces import synthetic
from models.faces.crops import CropConfig, crop_index
from models.faces.datasets import SYNTHETIC_MARKER, DatasetError, load_index
from models.faces.imageio import UnreadableImage, read_rgb, write_image


@pytest.mark.parametrize("suffix", [".jpg", ".png", ".pgm", ".gif", ".bmp"])
def test_reads_every_common_format_as_rgb(tmp_path, suffix):
    rgb = synthetic.render(0, 1, 0, size=64)
    image = rgb.mean(axis=2).astype(np.uint8)[..., None].repeat(3, 2) if suffix == ".pgm" else rgb
    path = tmp_path / f"face{suffix}"
    write_image(path, image)
    out = read_rgb(path)
    assert out.shape == (64, 64, 3) and out.dtype == np.uint8
    if suffix == ".pgm":  # grey is replicated into three equal channels
        assert np.array_equal(out[..., 0], out[..., 1]) and np.array_equal(out[..., 1], out[..., 2])
    tolerance = 40 if suffix in (".jpg", ".gif") else 0
    assert np.abs(out.astype(int) - image.astype(int)).mean() <= tolerance


def test_unreadable_image_raises_with_its_name(tmp_path):
    bad = tmp_path / "broken.jpg"
    bad.write_bytes(b"\xff\xd8 not really a jpeg")
    with pytest.raises(UnreadableImage, match="broken.jpg"):
        read_rgb(bad)


def _folders(root, ids=3, images=3, suffix=".png"):
    for i in range(ids):
        (root / f"person{i}").mkdir(parents=True)
        for j in range(images):
            write_image(root / f"person{i}" / f"{j}{suffix}", synthetic.render(0, i, j, 64))
    return root


def test_folder_per_identity_layout(tmp_path):
    index = load_index(_folders(tmp_path / "ds"))
    assert index.layout == "folders" and index.identities == ["person0", "person1", "person2"]
    assert len(index.samples) == 9 and not index.synthetic


def test_lfw_layout_with_pairs(tmp_path):
    root = tmp_path / "lfw_home"
    _folders(root / "lfw", ids=2, images=2, suffix=".jpg")
    (root / "pairs.txt").write_text("1\t1\nperson0\t1\t2\nperson0\t1\tperson1\t1\n")
    index = load_index(root)
    assert index.layout == "lfw" and index.pairs_file == root / "pairs.txt"
    assert index.root == root / "lfw" and len(index.samples) == 4


def test_celeba_layout_from_identity_file(tmp_path):
    root = tmp_path / "celeba"
    (root / "img_align_celeba").mkdir(parents=True)
    lines = []
    for k in range(6):
        name = f"{k + 1:06d}.jpg"
        write_image(root / "img_align_celeba" / name, synthetic.render(0, k % 2, k, 64))
        lines.append(f"{name} {100 + k % 2}")
    lines.append("999999.jpg 7")  # listed but absent: noted, not fatal
    (root / "identity_CelebA.txt").write_text("\n".join(lines) + "\n")
    index = load_index(root)
    assert index.layout == "celeba" and index.identities == ["100", "101"] and len(index.samples) == 6
    assert any("not in" in note for note in index.notes)


def test_missing_and_empty_datasets_are_clear_errors(tmp_path):
    with pytest.raises(DatasetError, match="does not exist"):
        load_index(tmp_path / "nope")
    (tmp_path / "empty" / "someone").mkdir(parents=True)
    (tmp_path / "empty" / "someone" / "notes.txt").write_text("no images here")
    with pytest.raises(DatasetError, match="no images found"):
        load_index(tmp_path / "empty")


def test_corrupt_file_is_skipped_with_a_warning_naming_it(tmp_path, caplog):
    root = _folders(tmp_path / "ds", ids=2, images=3)
    (root / "person1" / "corrupt.jpg").write_bytes(b"garbage")
    with caplog.at_level(logging.WARNING):
        crops = crop_index(load_index(root), CropConfig(detector="none"), use_cache=False, progress=False)
    assert len(crops) == 6 and crops.report.unreadable == [str(root / "person1" / "corrupt.jpg")]
    assert "corrupt.jpg" in caplog.text


def test_folder_with_only_unusable_images_is_a_clear_error(tmp_path):
    (tmp_path / "ds" / "a").mkdir(parents=True)
    (tmp_path / "ds" / "a" / "x.png").write_bytes(b"not a png")
    with pytest.raises(DatasetError, match="no usable face images"):
        crop_index(load_index(tmp_path / "ds"), CropConfig(detector="none"), use_cache=False, progress=False)


def test_synthetic_dataset_is_labelled_and_deterministic(tmp_path):
    a = synthetic.write_dataset(tmp_path / "a", 3, 2, seed=5)
    b = synthetic.write_dataset(tmp_path / "b", 3, 2, seed=5)
    assert (a / SYNTHETIC_MARKER).read_text().startswith("SYNTHETIC")
    index = load_index(a)
    assert index.synthetic and all(i.startswith("synthetic_") for i in index.identities)
    for sa, sb in zip(index.samples, load_index(b).samples):
        assert sa.path.read_bytes() == sb.path.read_bytes()
    assert not np.array_equal(synthetic.render(5, 0, 0), synthetic.render(6, 0, 0))
    assert not np.array_equal(synthetic.render(5, 0, 0), synthetic.render(5, 0, 1))  # images vary within a person


def test_truncated_jpegs_are_found_and_hostile_headers_stay_cheap():
    import cv2

    from models.faces.imageio import MAX_JPEG_SEGMENTS, is_truncated_jpeg

    ok, whole = cv2.imencode(".jpg", np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8))
    assert ok and not is_truncated_jpeg(whole)
    assert not is_truncated_jpeg(np.concatenate([whole, np.full(9000, 7, np.uint8)]))  # a phone's trailer
    assert all(is_truncated_jpeg(whole[:cut]) for cut in (4, 200, len(whole) // 2, len(whole) - 2))
    markers = lambda n: np.concatenate([whole[:2], np.tile(np.array([0xFF, 0x01], np.uint8), n)])  # noqa: E731
    assert is_truncated_jpeg(markers(10))  # a header of markers walked to its end: the file ends inside it
    # two million of them: the walk stops at MAX_JPEG_SEGMENTS (else it would reach the end and say truncated), so
    # its cost is bounded by that cap, not by the file (checked by the answer, not by a clock a loaded machine moves)
    assert MAX_JPEG_SEGMENTS < 2_000_000 and not is_truncated_jpeg(markers(2_000_000))


@pytest.mark.parametrize("command", [["synth", "--synthetic-identities", "1"], ["synth", "--synthetic-images", "0"],
                                     ["fleet", "simulate", "--synthetic-identities", "0"]])
def test_too_few_synthetic_faces_are_refused_in_one_line_before_anything_is_written(tmp_path, capsys, command):
    from ffr.cli import main

    assert main([*command, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "at least 2" in err and "--synthetic-identities" in err, err
    assert not (tmp_path / "out").exists()


def test_too_few_faces_a_person_is_said_with_the_number_needed(tmp_path):
    """Faces found but too few each: the error says so, not 'no usable face images' alone with zero failures."""
    for person in ("a", "b"):
        (tmp_path / "ds" / person).mkdir(parents=True)
        write_image(tmp_path / "ds" / person / "x.png", np.full((64, 64, 3), 120, np.uint8))
    with pytest.raises(DatasetError, match=r"2 people have faces, but each needs at least 2 \(most: 1\)") as caught:
        crop_index(load_index(tmp_path / "ds"), CropConfig(detector="none"), use_cache=False, progress=False,
                   min_images=2)
    assert "--detector none" not in str(caught.value)  # no hint to use the detector it already used

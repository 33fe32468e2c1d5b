"""The shipped face-pretrained embedder: its file, its quality on real faces, its ONNX forms, and who starts from it."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from models.networks.face_weights import SHIPPED_SHA256, SHIPPED_WEIGHTS, file_sha256, read_embedder_numpy


def test_shipped_file_is_the_recorded_fp16_safetensors_under_5_mb():
    assert SHIPPED_WEIGHTS.is_file() and SHIPPED_WEIGHTS.stat().st_size <= 5_000_000
    assert file_sha256(SHIPPED_WEIGHTS) == SHIPPED_SHA256
    from safetensors.numpy import load_file

    raw = load_file(str(SHIPPED_WEIGHTS))
    assert {v.dtype for k, v in raw.items() if not k.endswith("num_batches_tracked")} == {np.dtype("float16")}
    assert (SHIPPED_WEIGHTS.parent / "MODEL_CARD.md").is_file()


def test_saved_weights_round_trip_also_from_a_channels_last_model(tmp_path):
    """Training runs in channels_last; the file must still hold every tensor in its logical (NCHW) order."""
    from models.networks.backbone import FaceEmbedder
    from models.networks.face_weights import load_face_embedder, save_embedder

    torch.manual_seed(0)
    model = FaceEmbedder(pretrained=False).to(memory_format=torch.channels_last).eval()
    loaded = load_face_embedder(save_embedder(tmp_path / "e.safetensors", model)).eval()
    for key, value in model.state_dict().items():
        if value.is_floating_point():
            assert torch.allclose(loaded.state_dict()[key], value.half().float(), atol=1e-6), key
    x = torch.randn(4, 3, 128, 128)
    with torch.inference_mode():
        assert (model(x) * loaded(x)).sum(1).min() > 0.999


def test_a_tampered_file_is_refused(tmp_path, monkeypatch):
    import models.networks.face_weights as fw

    bad = tmp_path / "w.safetensors"
    bad.write_bytes(SHIPPED_WEIGHTS.read_bytes()[:-1] + b"\x00")
    monkeypatch.setattr(fw, "SHIPPED_WEIGHTS", bad)
    with pytest.raises(fw.FaceWeightsError, match="sha256 differs"):
        fw.shipped_weights()


def test_same_person_scores_higher_than_different_people_on_real_faces(faces_dir, tmp_path):
    """A handful of Glint24 people (aligned; never used in pretraining), through the device's ONNX model; the
    ImageNet-initialised embedder on the same pairs is the floor it must clear."""
    from models.evaluation.metrics import make_pairs, roc_report
    from models.faces.crops import CropConfig, crop_index
    from models.faces.datasets import load_index
    from models.networks.face_weights import write_default_onnx
    from models.runtime import OnnxEmbedder

    index = load_index(faces_dir / "glint24_aligned")
    crops = crop_index(index.subset(set(index.identities[:6])), CropConfig(detector="none"), progress=False)
    crops = crops.select(np.concatenate([np.flatnonzero(crops.labels == k)[:8] for k in range(6)]))
    emb = OnnxEmbedder(write_default_onnx(tmp_path / "face.onnx")).embed(crops.images)
    pairs, same = make_pairs(crops.labels)
    scores = (emb[pairs[:, 0]] * emb[pairs[:, 1]]).sum(1)
    assert scores[same].mean() > scores[~same].mean() + 0.05
    from models.networks.embedders import TorchEmbedder
    from models.networks.face_model import new_embedder

    floor = TorchEmbedder(new_embedder("imagenet")).embed(crops.images)
    auc, floor_auc = (roc_report((e[pairs[:, 0]] * e[pairs[:, 1]]).sum(1), same)["auc"] for e in (emb, floor))
    assert auc > 0.75 and auc > floor_auc + 0.05, (auc, floor_auc)


def test_onnx_forms_agree_with_pytorch(tmp_path):
    """The torch-free ONNX build (device) and the torch exporter (ffr export) both match the PyTorch model: one
    view against its embedding, mirror-averaged (the default) against `models.networks.mirror.averaged`."""
    import onnx

    from models.faces.preprocess import to_input
    from models.networks.embedder_onnx import build_embedder_onnx
    from models.networks.embedders import TorchEmbedder
    from models.networks.face_model import FaceModel, ModelConfig
    from models.networks.face_weights import (
        load_face_embedder,
        read_embedder_numpy,
        shipped_weights,
        write_default_onnx,
    )
    from models.networks.mirror import averaged
    from models.networks.onnx_export import export_onnx
    from models.runtime import OnnxEmbedder

    crops = np.random.default_rng(0).integers(0, 256, (6, 128, 128, 3), dtype=np.uint8)
    model = FaceModel(ModelConfig(n_classes=2)).eval()  # default --init face
    one_view = TorchEmbedder(model).embed(crops)
    direct = load_face_embedder().eval()
    with torch.inference_mode():
        images = torch.from_numpy(to_input(crops))
        assert (direct(images).numpy() * one_view).sum(1).min() >= 0.9999
        mirrored = averaged(model.embed, images).numpy()
    assert (mirrored * one_view).sum(1).min() < 0.9999  # the two references differ, so each check below can fail
    onnx.save(build_embedder_onnx(read_embedder_numpy(shipped_weights())[0], mirror=False), tmp_path / "a1.onnx")
    forms = {"built": (OnnxEmbedder(write_default_onnx(tmp_path / "a2.onnx")), mirrored),
             "built, one view": (OnnxEmbedder(tmp_path / "a1.onnx"), one_view),
             "exported": (OnnxEmbedder(export_onnx(model, tmp_path / "b2.onnx")), mirrored),
             "exported, one view": (OnnxEmbedder(export_onnx(model, tmp_path / "b1.onnx", mirror=False)), one_view)}
    for name, (embedder, reference) in forms.items():
        assert embedder.info.mirror == (reference is mirrored), name
        assert (embedder.embed(crops) * reference).sum(1).min() >= 0.9999, name


def test_round_zero_reads_the_weights_without_torch():
    """The coordinator's starting model comes from safetensors + numpy: torch is blocked in this subprocess."""
    from models.networks.face_model import FaceModel, ModelConfig, shareable_state

    code = ("import sys, json; sys.modules['torch'] = None\n"
            "from models.networks.face_weights import face_global_state\n"
            "s = face_global_state(); print(json.dumps({k: list(v.shape) for k, v in s.items()}))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ})
    assert proc.returncode == 0, proc.stderr
    import json

    shapes = json.loads(proc.stdout)
    expected = {
        k: list(v.shape) for k, v in shareable_state(FaceModel(ModelConfig(n_classes=2, pretrained=False))).items()
    }
    assert shapes == expected


def test_init_choices_start_from_different_models():
    from models.networks.face_model import new_embedder

    face, imagenet = new_embedder("face"), new_embedder("imagenet")
    shipped, _ = read_embedder_numpy()
    assert np.allclose(face.state_dict()["embedding.weight"].numpy(), shipped["embedding.weight"])
    assert not torch.equal(face.features[0][0].weight, imagenet.features[0][0].weight)
    with pytest.raises(ValueError, match="--init"):
        new_embedder("celebrity")

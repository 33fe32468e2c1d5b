"""Mirror averaging (`models.networks.mirror`): what a device's ONNX file does with a face and its mirror image."""
from __future__ import annotations

import numpy as np
import pytest

from models.networks.face_model import FaceModel, ModelConfig
from models.networks.onnx_export import export_onnx
from models.runtime import OnnxEmbedder

CROPS = np.random.default_rng(1).integers(0, 256, (5, 128, 128, 3), dtype=np.uint8)
MIRRORS = np.ascontiguousarray(CROPS[:, :, ::-1])


def test_the_device_model_scores_a_face_and_its_mirror_alike_and_a_one_view_model_does_not(tmp_path):
    from models.networks.face_weights import write_default_onnx

    mirrored = OnnxEmbedder(write_default_onnx(tmp_path / "face.onnx"))
    assert mirrored.info.mirror
    assert np.abs(mirrored.embed(CROPS) - mirrored.embed(MIRRORS)).max() < 1e-5
    for one_view in (OnnxEmbedder(export_onnx(FaceModel(ModelConfig(n_classes=2)), tmp_path / "one.onnx",
                                              mirror=False)),
                     OnnxEmbedder(write_default_onnx(tmp_path / "default_one.onnx", mirror=False))):
        assert not one_view.info.mirror
        assert np.abs(one_view.embed(CROPS) - one_view.embed(MIRRORS)).max() > 1e-2


@pytest.mark.parametrize("batch", [1, 4])
def test_a_face_is_averaged_with_its_own_mirror_whatever_the_batch(tmp_path, batch):
    """The graph puts the mirrors after the faces in one batch and sums the halves: each row must come back with
    its own mirror, not a neighbour's, for any batch size (dynamic axis)."""
    from models.networks.face_weights import write_default_onnx

    embedder = OnnxEmbedder(write_default_onnx(tmp_path / "face.onnx"))
    alone = np.concatenate([embedder.embed(CROPS[i:i + 1]) for i in range(len(CROPS))])
    together = embedder.embed(CROPS, batch_size=batch)
    assert np.abs(alone - together).max() < 1e-5
    assert (alone @ alone.T)[~np.eye(len(CROPS), dtype=bool)].max() < 0.999  # rows differ: a mix-up would show


def test_the_personalised_export_is_mirror_averaged_too(tmp_path):
    model = FaceModel(ModelConfig(n_classes=3, pretrained=False, dfc=True)).eval()
    embedder = OnnxEmbedder(export_onnx(model, tmp_path / "personal.onnx", personalised=True))
    assert embedder.info.kind == "personalised" and embedder.info.mirror
    assert np.abs(embedder.embed(CROPS) - embedder.embed(MIRRORS)).max() < 1e-5


def test_a_file_without_the_mirror_key_reads_as_one_view(tmp_path):
    """Files exported before mirror averaging carry no `ffr.mirror`: they are read as what they are, one view."""
    import onnx

    path = export_onnx(FaceModel(ModelConfig(n_classes=2, pretrained=False)), tmp_path / "old.onnx", mirror=False)
    proto = onnx.load(str(path))
    kept = [p for p in proto.metadata_props if p.key != "ffr.mirror"]
    del proto.metadata_props[:]
    proto.metadata_props.extend(kept)
    onnx.save(proto, str(path))
    assert OnnxEmbedder(path).info.mirror is False


def test_ffr_eval_scores_a_weights_file_as_its_onnx_does(tmp_path):
    """`ffr eval --model FILE.safetensors` embeds as the device's ONNX built from that file does (mirror-averaged),
    so one model gives one answer in either form."""
    from models.networks.embedders import load_embedder
    from models.networks.face_weights import shipped_weights, write_default_onnx

    from_weights = load_embedder(shipped_weights()).embed(CROPS)
    from_onnx = load_embedder(write_default_onnx(tmp_path / "face.onnx")).embed(CROPS)
    assert (from_weights * from_onnx).sum(1).min() >= 0.9999


def test_the_numpy_form_averages_as_the_device_file_does(tmp_path):
    """`averaged_crops` (the teacher's mirror averaging in bench.mirror_averaging) over a one-view file equals the
    mirror-averaged file built from the same weights."""
    from models.networks.face_weights import write_default_onnx
    from models.networks.mirror import averaged_crops

    one_view = OnnxEmbedder(write_default_onnx(tmp_path / "one.onnx", mirror=False))
    mirrored = OnnxEmbedder(write_default_onnx(tmp_path / "mirrored.onnx"))
    assert (averaged_crops(one_view.embed, CROPS) * mirrored.embed(CROPS)).sum(1).min() >= 0.9999

"""The teacher as a torch module, so that a GPU run can embed every augmented view online.

`ffr pretrain --online` (the default with `--device cuda`) asks the teacher for the exact view
the student sees, each step, instead of reading two cached views. ONNX Runtime cannot run on
the device's GPU here, so the ONNX teacher is converted to torch with onnx2torch once; the
conversion is checked against ONNX Runtime on real crops (`check_against_onnx`, cosine > 0.999)
before it may teach.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from models.cpu_memory import reuse_freed_memory
from models.networks.teacher import OnnxTeacher, TeacherError, TeacherSpec

ONNX2TORCH_OPSET = 17    # onnx2torch converts up to this opset; SFace is saved at 21 with the same operators
MIN_AGREEMENT = 0.999    # cosine to ONNX Runtime's embedding, per crop, before the converted teacher may teach


def fold_constant_reshapes(model) -> int:
    """Replace every Reshape of an initialiser by a constant initialiser (SFace reshapes each conv weight at
    run time, which onnx2torch cannot take as a weight). Returns how many were folded."""
    from onnx import numpy_helper

    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    keep, folded = [], 0
    for node in graph.node:
        if node.op_type == "Reshape" and len(node.input) == 2 and all(i in inits for i in node.input):
            data = numpy_helper.to_array(inits[node.input[0]])
            shape = numpy_helper.to_array(inits[node.input[1]]).astype(np.int64)
            graph.initializer.append(numpy_helper.from_array(data.reshape(shape), node.output[0]))
            folded += 1
        else:
            keep.append(node)
    del graph.node[:]
    graph.node.extend(keep)
    used = {i for n in graph.node for i in n.input}
    for t in [t for t in graph.initializer if t.name not in used]:
        graph.initializer.remove(t)
    return folded


class TorchTeacher(torch.nn.Module):
    """Aligned RGB crops as a float (N,3,H,W) tensor in 0..255 -> L2-normalised teacher embeddings (N,D).

    The spec's colour order, size and normalisation are applied here, as `OnnxTeacher.preprocess` does."""

    def __init__(self, graph: torch.nn.Module, spec: TeacherSpec, sha256: str, dim: int):
        super().__init__()
        reuse_freed_memory()  # its fp32 convolutions page-faulted in most of their time on a CPU before
        self.graph, self.spec, self.sha256, self.dim = graph, spec, sha256, dim
        self.requires_grad_(False)
        self.eval()

    def forward(self, rgb255: torch.Tensor) -> torch.Tensor:
        size = self.spec.input_size
        x = rgb255
        if x.shape[-2:] != (size, size):
            x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False, antialias=True)
        if self.spec.color == "BGR":
            x = x.flip(1)
        x = (x - self.spec.mean) / self.spec.std
        if self.spec.layout == "NHWC":
            x = x.permute(0, 2, 3, 1)
        return F.normalize(self.graph(x.contiguous()).reshape(len(x), -1).float(), dim=1)


def to_torch(teacher: OnnxTeacher) -> TorchTeacher:
    """Convert an ONNX teacher (already folded to fp32 by `models.networks.teacher`) with onnx2torch."""
    import onnx
    from onnx import version_converter

    try:
        from onnx2torch import convert
    except ImportError as exc:
        raise TeacherError("the online teacher needs onnx2torch: pip install onnx2torch") from exc
    model = onnx.load(str(teacher.path))
    fold_constant_reshapes(model)
    if model.opset_import[0].version > ONNX2TORCH_OPSET:
        model = version_converter.convert_version(model, ONNX2TORCH_OPSET)
    try:
        graph = convert(model)
    except Exception as exc:  # noqa: BLE001 - any unsupported operator means no online teacher
        raise TeacherError(f"onnx2torch cannot convert the teacher {teacher.path}: {exc}") from exc
    return TorchTeacher(graph, teacher.spec, teacher.sha256, teacher.dim)


@torch.inference_mode()
def check_against_onnx(torch_teacher: TorchTeacher, onnx_teacher: OnnxTeacher, crops: np.ndarray,
                       device: torch.device | str = "cpu") -> float:
    """The smallest cosine between the converted teacher's and ONNX Runtime's embedding over `crops` (uint8
    NHWC RGB); raises TeacherError below MIN_AGREEMENT."""
    reference = onnx_teacher.embed(crops)
    x = torch.from_numpy(np.ascontiguousarray(crops.transpose(0, 3, 1, 2))).to(device).float()
    ours = torch_teacher.to(device)(x).cpu().numpy()
    worst = float((reference * ours).sum(1).min())
    if not worst > MIN_AGREEMENT:
        raise TeacherError(f"the converted teacher agrees with ONNX Runtime only to cosine {worst:.5f} "
                           f"(needs > {MIN_AGREEMENT}); refusing to teach with it")
    return worst

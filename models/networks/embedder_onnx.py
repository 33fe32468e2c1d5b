"""Build the embedder's ONNX graph straight from its weights, with numpy and `onnx` only (no torch).

A device installs the shipped face model without torch: this writes the same network as
`models.networks.backbone.FaceEmbedder` (torchvision's MobileNetV2 features, global average pool,
Linear, BatchNorm1d, L2 normalisation) with every BatchNorm folded into the conv before it, and by default each
face averaged with its mirror inside the graph (`models.networks.mirror`).
A test holds it to the PyTorch model (cosine >= 0.9999), with and without the mirror.
"""
from __future__ import annotations

import json

import numpy as np

from models.faces.preprocess import INPUT_SIZE, MEAN, STD
from models.networks.mirror import MIRRORED, WIDTH_AXIS
from models.runtime import METADATA_PREFIX

OPSET = 17
BN_EPS = 1e-5
# torchvision MobileNetV2 (Sandler et al., CVPR 2018, Table 2): (expansion t, out channels c, repeats n, stride s)
INVERTED_RESIDUAL_SETTING = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1),
                             (6, 160, 3, 2), (6, 320, 1, 1))


def _block_strides() -> list[int]:
    return [s if i == 0 else 1 for _, _, n, s in INVERTED_RESIDUAL_SETTING for i in range(n)]


class _Graph:
    """Nodes and initialisers being assembled; every helper returns its output's name."""

    def __init__(self, state: dict[str, np.ndarray]):
        self.state, self.nodes, self.inits, self.n = state, [], [], 0

    def name(self, hint: str) -> str:
        self.n += 1
        return f"{hint}_{self.n}"

    def const(self, hint: str, value: np.ndarray) -> str:
        from onnx import numpy_helper

        name = self.name(hint)
        self.inits.append(numpy_helper.from_array(np.ascontiguousarray(value), name))
        return name

    def node(self, op: str, inputs: list[str], hint: str, **attrs) -> str:
        from onnx import helper

        out = self.name(hint)
        self.nodes.append(helper.make_node(op, inputs, [out], **attrs))
        return out

    def bn_scale(self, prefix: str) -> tuple[np.ndarray, np.ndarray]:
        s = self.state
        scale = s[f"{prefix}.weight"] / np.sqrt(s[f"{prefix}.running_var"] + BN_EPS)
        return scale, s[f"{prefix}.bias"] - s[f"{prefix}.running_mean"] * scale

    def conv_bn(self, x: str, conv: str, bn: str, stride: int, relu6: bool) -> str:
        """Conv (no bias) + BatchNorm folded into one Conv, then ReLU6 (Clip 0..6) if asked."""
        weight = self.state[f"{conv}.weight"]
        scale, bias = self.bn_scale(bn)
        k = weight.shape[-1]
        groups = weight.shape[0] if weight.shape[1] == 1 and k > 1 else 1
        y = self.node("Conv", [x, self.const("w", (weight * scale[:, None, None, None]).astype(np.float32)),
                               self.const("b", bias.astype(np.float32))], "conv",
                      kernel_shape=[k, k], strides=[stride, stride], pads=[k // 2] * 4, group=groups)
        if relu6:
            y = self.node("Clip", [y, self.const("lo", np.array(0.0, np.float32)),
                                   self.const("hi", np.array(6.0, np.float32))], "relu6")
        return y

    def l2_normalise(self, x: str, out: str | None = None) -> str:
        """Rows divided by their L2 norm; written to `out` when named (the graph's output)."""
        from onnx import helper

        norm = self.node("Max", [self.node("ReduceL2", [x], "l2", axes=[1], keepdims=1),
                                 self.const("eps", np.array(1e-12, np.float32))], "norm")
        out = out or self.name("normalised")
        self.nodes.append(helper.make_node("Div", [x, norm], [out]))
        return out

    def with_mirrors(self, image: str) -> str:
        """[images; their mirrors] as one batch of 2N (a Slice that walks the width backwards)."""
        mirror = self.node("Slice", [image, self.const("start", np.array([-1], np.int64)),
                                     self.const("end", np.array([np.iinfo(np.int64).min], np.int64)),
                                     self.const("axis", np.array([WIDTH_AXIS], np.int64)),
                                     self.const("step", np.array([-1], np.int64))], "mirror")
        return self.node("Concat", [image, mirror], "with_mirrors", axis=0)

    def sum_halves(self, x: str, dim: int) -> str:
        """(2N, dim) rows of [images; mirrors] -> (N, dim): each image's row plus its mirror's."""
        halves = self.node("Reshape", [x, self.const("shape", np.array([2, -1, dim], np.int64))], "halves")
        return self.node("ReduceSum", [halves, self.const("axis", np.array([0], np.int64))], "sum", keepdims=0)


def _inverted_residual(g: _Graph, x: str, prefix: str, stride: int) -> str:
    """One torchvision InvertedResidual: [expand 1x1] -> depthwise 3x3 -> project 1x1 (linear), + x when shapes
    match."""
    expanded = f"{prefix}.conv.0.0.weight" in g.state and g.state[f"{prefix}.conv.0.0.weight"].shape[1] != 1
    y, k = x, 0
    if expanded:
        y, k = g.conv_bn(y, f"{prefix}.conv.0.0", f"{prefix}.conv.0.1", 1, True), 1
    y = g.conv_bn(y, f"{prefix}.conv.{k}.0", f"{prefix}.conv.{k}.1", stride, True)
    y = g.conv_bn(y, f"{prefix}.conv.{k + 1}", f"{prefix}.conv.{k + 2}", 1, False)
    w_in = g.state[f"{prefix}.conv.0.0.weight"]
    in_ch = w_in.shape[1] if expanded else w_in.shape[0]
    out_ch = g.state[f"{prefix}.conv.{k + 1}.weight"].shape[0]
    return g.node("Add", [x, y], "residual") if stride == 1 and in_ch == out_ch else y


def build_embedder_onnx(state: dict[str, np.ndarray], metadata: dict | None = None, mirror: bool = MIRRORED):
    """An onnx.ModelProto of the embedder (float32 NCHW [-1, 1] input, L2-normalised output, dynamic batch);
    with `mirror`, each face's embedding is averaged with its mirror image's (`models.networks.mirror`)."""
    from onnx import TensorProto, checker, helper

    state = {k: np.asarray(v, np.float32) for k, v in state.items() if not k.endswith("num_batches_tracked")}
    g = _Graph(state)
    x = g.conv_bn(g.with_mirrors("image") if mirror else "image", "features.0.0", "features.0.1", 2, True)
    for i, stride in enumerate(_block_strides(), start=1):
        x = _inverted_residual(g, x, f"features.{i}", stride)
    last = len(_block_strides()) + 1
    x = g.conv_bn(x, f"features.{last}.0", f"features.{last}.1", 1, True)
    x = g.node("Flatten", [g.node("GlobalAveragePool", [x], "pool")], "flat", axis=1)
    scale, bias = g.bn_scale("bn")  # Linear (no bias) then BatchNorm1d, folded into one Gemm
    weight = state["embedding.weight"] * scale[:, None]
    x = g.node("Gemm", [x, g.const("emb_w", weight.astype(np.float32)), g.const("emb_b", bias.astype(np.float32))],
               "embedding", transB=1)
    dim = weight.shape[0]
    if mirror:
        x = g.sum_halves(g.l2_normalise(x), dim)
    g.l2_normalise(x, out="embedding")
    graph = helper.make_graph(
        g.nodes,
        "ffr_embedder",
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["batch", 3, INPUT_SIZE, INPUT_SIZE])],
        [helper.make_tensor_value_info("embedding", TensorProto.FLOAT, ["batch", dim])],
        g.inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="ffr-edge")
    model.ir_version = 8
    meta = {"kind": "generic", "input_size": INPUT_SIZE, "mean": MEAN, "std": STD, "color": "RGB", "layout": "NCHW",
            "embedding_dim": dim, "normalised": "l2", "mirror": "averaged" if mirror else "none",
            "extra": json.dumps(metadata or {})}
    for key, value in meta.items():
        entry = model.metadata_props.add()
        entry.key, entry.value = f"{METADATA_PREFIX}{key}", str(value)
    checker.check_model(model)
    return model

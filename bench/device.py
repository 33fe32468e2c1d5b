"""On-device speed and quality: our ONNX pipeline vs the `face_recognition` package (dlib).

python -m bench.device --out bench/results

Latency, end to end per 640x480 frame: detect, quality gate + crop, preprocess, embed, and
match against 100 templates; median and p95 at 1 and 2 threads. The peer does the same with
its own HOG detector, its ResNet encoder and `face_distance` against 100 encodings.
Quality: AUC/EER on the held-out identities of each real set (the same 70/30 identity split,
seed 0, as `bench.verify_quality`, which has the full table), for the embedder a fresh device
ships with (the face-pretrained weights, built as ONNX without torch) and face_recognition, on
the same pairs. The teacher (SFace) is timed per aligned face beside our embedder.

face_recognition needs `face_recognition`, `face_recognition_models` and `dlib-bin` (prebuilt
dlib), installed with --no-deps by `make bench-device`.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import cv2
import numpy as np

from bench.common import faces_dir, result_name, time_calls, write_results
from bench.held_out_sets import ALIGNED, GIVEN, HAAR, PHOTO_SETS, SETS, held_out
from bench.latency import frames
from bench.peer import euclidean, load_face_recognition, peer_embeddings, peer_per_frame
from edge_client.capture import FaceQuality, check_face, device_detector
from models.evaluation.metrics import cosine_scores, make_pairs, roc_report
from models.runtime import OnnxEmbedder

N_TEMPLATES = 100


def ours_per_frame(embedder: OnnxEmbedder, detector, templates: np.ndarray, frame_bgr: np.ndarray) -> float | None:
    check = check_face(frame_bgr, detector, FaceQuality())
    if check.crop is None:
        return None
    emb = embedder.embed(check.crop[None])[0]
    return float(np.max(templates @ (emb / np.linalg.norm(emb))))


def latency_rows(onnx_path: Path, fr, repeats: int) -> list[dict]:
    rng = np.random.default_rng(0)
    rgb_frames = frames(20)
    bgr_frames = [cv2.cvtColor(f, cv2.COLOR_RGB2BGR) for f in rgb_frames]
    rows = []
    for threads in (1, 2):
        cv2.setNumThreads(threads)
        embedder = OnnxEmbedder(onnx_path, threads=threads)
        detector = device_detector("auto")
        templates = rng.normal(size=(N_TEMPLATES, embedder.info.embedding_dim)).astype(np.float32)
        templates /= np.linalg.norm(templates, axis=1, keepdims=True)
        k = iter(range(10**9))
        t = time_calls(lambda: ours_per_frame(embedder, detector, templates, bgr_frames[next(k) % 20]), repeats)
        found = sum(ours_per_frame(embedder, detector, templates, f) is not None for f in bgr_frames)
        view = "mirror-averaged" if embedder.info.mirror else "one view"
        rows.append({"pipeline": f"ffr-edge ({type(detector).__name__.removesuffix('Detector')} at 320 px + "
                                 f"5-point alignment + MobileNetV2-1.0 ONNX, {view})", "threads": threads,
                     "median_ms": t["median_ms"], "p95_ms": t["p95_ms"], "frames_with_face": f"{found}/20"})
        face = np.zeros((1, 128, 128, 3), np.uint8) + 127
        t = time_calls(lambda: embedder.embed(face), repeats)
        rows.append({"pipeline": "  of which: our embedder alone, per aligned face", "threads": threads,
                     "median_ms": t["median_ms"], "p95_ms": t["p95_ms"], "frames_with_face": "-"})
        from models.networks.teacher import load_teacher

        teacher = load_teacher("sface", threads=threads)
        t = time_calls(lambda: teacher.embed(face[:, :112, :112]), repeats)
        rows.append({"pipeline": "  the teacher (SFace, fp32 in ONNX Runtime), per aligned face", "threads": threads,
                     "median_ms": t["median_ms"], "p95_ms": t["p95_ms"], "frames_with_face": "-"})
    if fr is not None:
        cv2.setNumThreads(1)
        templates = rng.normal(size=(N_TEMPLATES, 128)) * 0.1
        k = iter(range(10**9))
        t = time_calls(lambda: peer_per_frame(fr, templates, rgb_frames[next(k) % 20]), max(10, repeats // 4), 2)
        found = sum(peer_per_frame(fr, templates, f) is not None for f in rgb_frames)
        rows.append({"pipeline": "face_recognition 1.3 (dlib HOG + ResNet)", "threads": 1, "median_ms": t["median_ms"],
                     "p95_ms": t["p95_ms"], "frames_with_face": f"{found}/20"})
    return rows


def quality_rows(onnx_path: Path, fr, max_pairs: int) -> list[dict]:
    from models.evaluation.evaluate import embed_all

    root, rows = faces_dir(), []
    for name in SETS:
        if root is None or not (root / name).is_dir():
            continue
        held = held_out(root / name, ALIGNED if name in PHOTO_SETS else GIVEN, 0)[1].holdout
        pairs, same = make_pairs(held.labels, max_pairs, 0)
        scored = {"ffr-edge, face-pretrained (fresh device)":
                  cosine_scores(embed_all(OnnxEmbedder(onnx_path, threads=2), held.images), pairs)}
        if fr is not None:  # dlib on its usual square crops
            square = held_out(root / name, HAAR, 0)[1].holdout if name in PHOTO_SETS else held
            scored["face_recognition (dlib)"] = -euclidean(peer_embeddings(fr, square.images), pairs)
        for model, scores in scored.items():
            report = roc_report(scores, same)
            rows.append({"set": name, "model": model, "auc": report["auc"], "eer": report["eer"],
                         "tar@far=1e-2": report["tar_at_far"]["0.01"], "identities": len(held.identities),
                         "images": len(held), "pairs": f"{int(same.sum())}/{int((~same).sum())}"})
            print(rows[-1], flush=True)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--max-pairs", type=int, default=50_000)
    parser.add_argument("--skip-quality", action="store_true")
    parser.add_argument("--one-view", action="store_true",
                        help="our model embedding each face once, not averaged with its mirror (the default)")
    parser.add_argument("--name", type=result_name, default="device", help="results as NAME_latency and NAME_quality")
    args = parser.parse_args(argv)
    try:
        fr = load_face_recognition()
    except ImportError as exc:
        print(f"face_recognition not installed ({exc}); the peer is skipped", file=sys.stderr)
        fr = None
    from models.networks.face_weights import write_default_onnx

    with tempfile.TemporaryDirectory() as tmp:
        # what `ffr device install-model --default` installs
        onnx_path = write_default_onnx(Path(tmp) / "generic.onnx", mirror=not args.one_view)
        latency = latency_rows(onnx_path, fr, args.repeats)
        quality = [] if args.skip_quality else quality_rows(onnx_path, fr, args.max_pairs)
    command = "python -m bench.device " + " ".join(argv if argv is not None else sys.argv[1:])
    write_results(args.out, f"{args.name}_latency", {"templates": N_TEMPLATES, "one_view": args.one_view}, latency,
                  "End-to-end latency per 640x480 frame (detect, crop, embed, match 100 templates)", command.strip())
    if quality:
        write_results(args.out, f"{args.name}_quality", {"one_view": args.one_view}, quality,
                      "Verification on held-out people: ffr-edge vs face_recognition", command.strip())
    return 0


if __name__ == "__main__":
    sys.exit(main())

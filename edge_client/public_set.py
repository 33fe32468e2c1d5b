"""The public face set D_g that FedFR puts on every device: one read-only safetensors file.

Aligned crops of people who are nobody's enrolled people (e.g. `utkface_aligned/`), uint8
N x 128 x 128 x 3 under the key `images`, with its sha256 so a device can check the copy it was
given (in deployment, the file the coordinator serves once; in the fleet, one file per run). The
device reads it, samples hard negatives from it, and never sends anything about it.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

KEY = "images"
SIZE = 128  # the embedder's input: a 112 px ArcFace-template crop resized is the same template scaled


class PublicSetError(ValueError):
    pass


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def build_public_set(folder: Path, out: Path, limit: int = 2000, seed: int = 0, progress: bool = False) -> str:
    """Sample up to `limit` aligned face images under `folder` (flat or per identity) into `out`; its sha256."""
    from models.distill_data import list_images, load_crops

    files = list_images([Path(folder)])
    if len(files) > limit:
        chosen = np.random.default_rng(seed).choice(len(files), limit, replace=False)
        files = [files[i] for i in sorted(chosen)]
    images, _, unreadable = load_crops(files, SIZE, progress=progress)
    if len(images) == 0:
        raise PublicSetError(f"no readable face images under {folder} ({len(unreadable)} unreadable)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    save_file({KEY: np.ascontiguousarray(images)}, str(tmp), metadata={"source": str(folder), "seed": str(seed)})
    tmp.replace(out)
    return sha256_file(out)


def load_public_set(path: Path, sha256: str | None = None) -> np.ndarray:
    """The crops of a public set file, refused when its hash or shape is not what it should be."""
    path = Path(path)
    if not path.is_file():
        raise PublicSetError(f"public set not found: {path}")
    if sha256 is not None and sha256_file(path) != sha256:
        raise PublicSetError(f"public set {path} does not match its sha256 {sha256[:16]}...")
    try:
        images = load_file(str(path))[KEY]
    except Exception as exc:  # noqa: BLE001 - a corrupt or foreign file is refused with its reason
        raise PublicSetError(f"{path} is not a public set file ({exc})") from None
    if images.dtype != np.uint8 or images.ndim != 4 or images.shape[1:] != (SIZE, SIZE, 3):
        raise PublicSetError(f"{path}: expected uint8 N x {SIZE} x {SIZE} x 3 crops, got {images.dtype} {images.shape}")
    return images

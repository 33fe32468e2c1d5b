"""The public face set D_g that FedFR puts on every device: one read-only safetensors file.

Aligned crops of people who are nobody's enrolled people, uint8 N x 128 x 128 x 3 under the key
`images`; when the source holds one folder per person (e.g. `glint24_aligned/`), int64 identity
numbers under `labels`, so the sampled public people can join the local classification (FedFR's
balanced CosFace, eq. 3); a flat folder (e.g. `utkface_aligned/`) gives an unlabelled set. Its
sha256 lets a device check the copy it was given (in deployment, the file the coordinator serves
once over HTTP; in the fleet, one file per run). The device reads it, samples hard negatives from
it, and never sends anything about it.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

from models.networks.pretrained import sha256_of

KEY = "images"
LABELS = "labels"
SIZE = 128  # the embedder's input: a 112 px ArcFace-template crop resized is the same template scaled


class PublicSetError(ValueError):
    pass


@dataclass
class PublicSet:
    images: np.ndarray               # N x SIZE x SIZE x 3 uint8
    labels: np.ndarray | None = None  # N identity numbers, or None for an unlabelled set

    def __len__(self) -> int:
        return len(self.images)


def identity_labels(files: list[Path], root: Path) -> np.ndarray | None:
    """Identity numbers from one-folder-per-person layouts (the folder under `root`); None when any
    file lies directly in `root` (a flat, unlabelled set)."""
    folders = [f.relative_to(root).parts[0] if len(f.relative_to(root).parts) > 1 else None for f in files]
    if any(name is None for name in folders):
        return None
    names = sorted(set(folders))
    return np.array([names.index(name) for name in folders], dtype=np.int64)


def build_public_set(folder: Path, out: Path, limit: int = 2000, seed: int = 0, progress: bool = False) -> str:
    """Sample up to `limit` aligned face images under `folder` (flat or per identity) into `out`; its sha256."""
    from models.training.distill_data import list_images, load_crops

    folder = Path(folder)
    files = list_images([folder])
    if len(files) > limit:
        chosen = np.random.default_rng(seed).choice(len(files), limit, replace=False)
        files = [files[i] for i in sorted(chosen)]
    labels = identity_labels(files, folder)
    images, kept, unreadable = load_crops(files, SIZE, progress=progress)
    if len(images) == 0:
        raise PublicSetError(f"no readable face images under {folder} ({len(unreadable)} unreadable)")
    tensors = {KEY: np.ascontiguousarray(images)}
    if labels is not None:
        position = {f: i for i, f in enumerate(files)}
        tensors[LABELS] = labels[[position[f] for f in kept]]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    save_file(tensors, str(tmp), metadata={"source": str(folder), "seed": str(seed)})
    tmp.replace(out)
    return sha256_of(out)


def _check_crops(path: Path, is_uint8: bool, shape: tuple, dtype) -> None:
    if not is_uint8 or len(shape) != 4 or tuple(shape[1:]) != (SIZE, SIZE, 3):
        raise PublicSetError(f"{path}: expected uint8 N x {SIZE} x {SIZE} x 3 crops, got {dtype} {shape}")


def check_public_set_file(path: Path) -> None:
    """A public set file's header checked without reading its crops (an operator's `--public-set`, at start-up):
    a missing, foreign or mis-shaped file is refused in one line then, not found out in some later round."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise PublicSetError(f"public set not found: {path}")
    try:
        with safe_open(str(path), framework="numpy") as f:
            shape, dtype = f.get_slice(KEY).get_shape(), f.get_slice(KEY).get_dtype()
    except Exception as exc:  # noqa: BLE001 - a corrupt or foreign file is refused with its reason
        raise PublicSetError(f"{path} is not a public set file (make one with `ffr edge public-set`): "
                             f"{' '.join(str(exc).split())}") from None
    _check_crops(path, dtype == "U8", tuple(shape), dtype)


def load_public_set(path: Path, sha256: str | None = None) -> PublicSet:
    """The crops (and identity labels, if any) of a public set file, refused when its hash, shape or
    labels are not what they should be."""
    path = Path(path)
    if not path.is_file():
        raise PublicSetError(f"public set not found: {path}")
    if sha256 is not None and sha256_of(path) != sha256:
        raise PublicSetError(f"public set {path} does not match its sha256 {sha256[:16]}...")
    try:
        tensors = load_file(str(path))
        images = tensors[KEY]
    except Exception as exc:  # noqa: BLE001 - a corrupt or foreign file is refused with its reason
        raise PublicSetError(f"{path} is not a public set file ({exc})") from None
    _check_crops(path, images.dtype == np.uint8, images.shape, images.dtype)
    labels = tensors.get(LABELS)
    if labels is not None and (labels.dtype != np.int64 or labels.shape != (len(images),) or
                               (len(labels) and (labels.min() < 0 or labels.max() >= len(images)))):
        raise PublicSetError(f"{path}: expected {len(images)} int64 identity labels in [0, N), "
                             f"got {labels.dtype} {labels.shape}")
    return PublicSet(images, labels)


HELD_SHARE = 0.3  # of an operator's public set, kept by the coordinator for its quality gate, never served


def hold_back(path: Path, out_dir: Path, share: float = HELD_SHARE, seed: int = 0) -> tuple[Path, Path]:
    """(the part of the public set at `path` to serve, the part the coordinator keeps for its gate), written into
    `out_dir` under the source's hash at every start, never read back (the same source and seed give the same bytes,
    so a device's cached copy stays valid). A labelled set is split by person (no one is on both sides); an
    unlabelled one by image. A device can download what it will be trained with, never what its models are judged on."""
    source = sha256_of(Path(path))[:16]
    served, held = out_dir / f"public_set-{source}-served.safetensors", out_dir / f"gate_faces-{source}.safetensors"
    public = load_public_set(path)
    rng = np.random.default_rng(seed)
    if public.labels is not None:
        people = np.unique(public.labels)
        kept = rng.choice(people, max(2, int(round(len(people) * share))), replace=False)
        mask = np.isin(public.labels, kept)
    else:
        mask = np.zeros(len(public), bool)
        mask[rng.choice(len(public), max(3, int(round(len(public) * share))), replace=False)] = True
    if mask.all() or not mask.any():
        raise PublicSetError(f"{path} is too small to keep a share for the quality gate and serve the rest "
                             "(give the gate its own faces with --gate-data, or a larger public set)")
    out_dir.mkdir(parents=True, exist_ok=True)
    for target, part in ((served, ~mask), (held, mask)):
        tensors = {KEY: np.ascontiguousarray(public.images[part])}
        if public.labels is not None:
            tensors[LABELS] = np.unique(public.labels[part], return_inverse=True)[1].astype(np.int64)
        tmp = target.with_suffix(".tmp")
        save_file(tensors, str(tmp), metadata={"source": str(path), "seed": str(seed)})
        tmp.replace(target)
    return served, held

"""A folder of aligned face crops as one compressed file, for taking a training set to a GPU machine.

Lent GPU machines take at most 64 MiB of files with them and reach no network, so the
35,000 aligned crops (150 MB of JPEGs) travel re-encoded as WebP (about 1.3 kB each at quality
75) in a single `.npz` of plain arrays: the encoded bytes end to end, their offsets and the
files' relative names (UTF-8, one per line). Nothing in it is pickled, so `np.load` reads it with `allow_pickle=False`.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import cv2
import numpy as np
from tqdm import tqdm

from models.progress import bar_disable
from models.training.distill_data import list_images, load_crops

PACK_SUFFIX = ".npz"
MAX_PACKED_IMAGES = 1_000_000   # a hostile pack cannot make us allocate without bound


def is_pack(path: Path) -> bool:
    return Path(path).is_file() and Path(path).suffix == PACK_SUFFIX


def pack_crops(dirs: list[Path], out: Path, size: int = 112, quality: int = 75, threads: int = 2,
               progress: bool = True, max_images: int | None = None, seed: int = 0) -> dict:
    """Encode every readable crop under `dirs` at `size` as WebP into `out`; returns counts and bytes.
    `max_images`: a seeded random subset, in listing order, so a pack fits what a GPU call can carry."""
    files = list_images(dirs)
    if max_images is not None and len(files) > max_images:
        keep = np.sort(np.random.default_rng(seed).permutation(len(files))[:max_images])
        files = [files[i] for i in keep]
    images, kept, unreadable = load_crops(files, size, threads, progress)
    encode = lambda rgb: cv2.imencode(".webp", rgb[..., ::-1], [cv2.IMWRITE_WEBP_QUALITY, quality])[1]  # noqa: E731
    with ThreadPoolExecutor(max(1, threads)) as pool:
        blobs = list(tqdm(pool.map(encode, images), total=len(images), desc="packing", unit="img",
                          disable=bar_disable(progress), leave=False))
    offsets = np.cumsum([0] + [len(b) for b in blobs]).astype(np.int64)
    names = [str(f.relative_to(next(d for d in dirs if f.is_relative_to(d)))) for f in kept]
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp.npz")
    np.savez(tmp, data=np.concatenate(blobs) if blobs else np.zeros(0, np.uint8), offsets=offsets,
             names=np.frombuffer("\n".join(names).encode(), np.uint8), size=np.int64(size))
    tmp.replace(out)
    return {"images": len(kept), "unreadable": [str(f) for f in unreadable], "bytes": out.stat().st_size}


def unpack_crops(path: Path, threads: int = 2) -> tuple[np.ndarray, list[str]]:
    """(N,size,size,3) RGB uint8 crops and their names; raises ValueError on a damaged or hostile pack."""
    with np.load(path, allow_pickle=False) as pack:
        try:
            data, offsets, size = pack["data"], pack["offsets"], int(pack["size"])
            names = pack["names"].tobytes().decode("utf-8", errors="replace").split("\n")
        except (KeyError, ValueError, TypeError) as exc:
            raise ValueError(f"{path} is not a crop pack ({exc})") from None
    n = len(offsets) - 1
    if data.dtype != np.uint8 or data.ndim != 1 or offsets.dtype != np.int64 or offsets.ndim != 1:
        raise ValueError(f"{path} is a damaged crop pack (its arrays have the wrong types)")
    if not (0 < n <= MAX_PACKED_IMAGES and len(names) == n and 16 <= size <= 512 and offsets[0] == 0
            and offsets[-1] == len(data) and (np.diff(offsets) > 0).all()):
        raise ValueError(f"{path} is a damaged crop pack (inconsistent offsets, names or size)")

    def decode(i: int) -> np.ndarray | None:
        bgr = cv2.imdecode(data[offsets[i]:offsets[i + 1]], cv2.IMREAD_COLOR)
        return None if bgr is None or bgr.shape != (size, size, 3) else bgr[..., ::-1]

    with ThreadPoolExecutor(max(1, threads)) as pool:
        crops = list(pool.map(decode, range(n)))
    bad = [str(names[i]) for i, c in enumerate(crops) if c is None]
    if bad:
        raise ValueError(f"{path}: {len(bad)} crops do not decode to {size}x{size} (first: {bad[0]})")
    return np.ascontiguousarray(np.stack(crops)), names

"""Distillation data: aligned face crops in memory and the teacher's embeddings of them, cached on disk.

The teacher is the expensive part (an SFace forward costs more than a student training step
on a CPU), so each (image, view) is embedded once and kept in a memory-mapped file beside a
done-mask; an interrupted run, a second run on the same data or a later session reads them back.
View 0 is the image, view 1 its mirror image, and views 2 and up (`--views N`) small geometric
jitters (scale, shift, rotation, mirror), each fixed per (view, image) so that the student is
shown exactly the view the teacher embedded, before the student's photometric augmentation.
"""
from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import cv2
import numpy as np
from tqdm import tqdm

from models.faces.imageio import UnreadableImage, is_image_file, read_rgb
from models.progress import bar_disable

N_VIEWS = 2  # the image and its mirror image (the default; --views N adds N - 2 geometric jitters)
VIEWS_SUFFIX = "-views"  # a cache of N != 2 views is named `targets_dir`'s name + "-viewsN"
VIEW_SEED = 20261124  # part of each jittered view's identity: changing it changes every cached view


def list_images(dirs: list[Path]) -> list[Path]:
    """Every image file under `dirs` (recursively), sorted, so the order is the same on every machine."""
    files: list[Path] = []
    for root in dirs:
        root = Path(root)
        if not root.is_dir():
            raise FileNotFoundError(f"pretraining data folder not found: {root}")
        files.extend(sorted(p for p in root.rglob("*") if p.is_file() and is_image_file(p)))
    if not files:
        raise FileNotFoundError(f"no image files under {', '.join(map(str, dirs))}")
    return files


def _read(path: Path, size: int) -> np.ndarray | None:
    try:
        rgb = read_rgb(path)
    except UnreadableImage:
        return None
    if rgb.shape[:2] != (size, size):
        rgb = cv2.resize(rgb, (size, size), interpolation=cv2.INTER_AREA)
    return rgb


def load_crops(files: list[Path], size: int = 112, threads: int = 2, progress: bool = True
               ) -> tuple[np.ndarray, list[Path], list[Path]]:
    """Aligned crops (N,size,size,3 RGB uint8); unreadable files are returned apart, never silently lost."""
    with ThreadPoolExecutor(max(1, threads)) as pool:
        crops = list(tqdm(pool.map(lambda p: _read(p, size), files), total=len(files), desc="reading faces",
                          unit="img", disable=bar_disable(progress), leave=False))
    ok = [i for i, c in enumerate(crops) if c is not None]
    bad = [files[i] for i, c in enumerate(crops) if c is None]
    images = np.stack([crops[i] for i in ok]) if ok else np.zeros((0, size, size, 3), np.uint8)
    return images, [files[i] for i in ok], bad


def view_uniforms(v: int, index: np.ndarray) -> np.ndarray:
    """The (len(index), 5) uniforms that fix view `v` of each image: the same on every machine and run."""
    return np.stack([np.random.default_rng((VIEW_SEED, v, int(i))).random(5) for i in index])


def view(images: np.ndarray, v: int, index: np.ndarray | None = None) -> np.ndarray:
    """View `v` of a batch of NHWC uint8 crops (`index`: their image numbers, needed for v >= 2): 0 is the
    image, 1 its mirror image, v >= 2 the geometric jitter fixed for (v, image), rounded back to uint8."""
    if v == 0:
        return images
    if v == 1:
        return np.ascontiguousarray(images[:, :, ::-1])
    import torch

    from models.training.online_views import ViewJitter, affines_from_uniforms, warp

    if index is None or len(index) != len(images):
        raise ValueError("a jittered view needs the images' numbers")
    theta = affines_from_uniforms(torch.from_numpy(view_uniforms(v, index)).float(), ViewJitter())
    chw = torch.from_numpy(np.ascontiguousarray(images)).permute(0, 3, 1, 2)
    return warp(chw, theta).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).numpy()


def dataset_key(files: list[Path]) -> str:
    """Names and contents of the files, in order: a changed file or list gives a new cache.

    Contents, not mtimes: a data folder copied onto another machine (or re-mounted for a new
    session) keeps its bytes but not its mtimes, and the teacher's embeddings stay valid.
    Hashing 35,000 aligned crops (150 MB) takes about 3 s against 15 minutes of teacher forwards.
    """
    digest = hashlib.sha256()
    for f in files:
        digest.update(f"{f.name}|{hashlib.sha256(f.read_bytes()).hexdigest()}\n".encode())
    return digest.hexdigest()[:16]


@dataclass
class TeacherTargets:
    """(views, N, D) float16 teacher embeddings on disk, filled lazily, with a done-mask per entry."""

    root: Path
    values: np.ndarray
    done: np.ndarray

    @classmethod
    def open(cls, root: Path, n: int, dim: int, views: int = N_VIEWS, meta: dict | None = None) -> TeacherTargets:
        root.mkdir(parents=True, exist_ok=True)
        meta_file = root / "meta.json"
        expected = {"n": n, "dim": dim, "views": views, **(meta or {})}
        damaged = ValueError(f"{root} holds damaged teacher targets; delete it or use another cache dir")
        try:
            recorded = json.loads(meta_file.read_text()) if meta_file.exists() else expected
        except ValueError:
            raise damaged from None
        if recorded != expected:
            raise ValueError(f"{root} holds teacher targets for other data; delete it or use another cache dir")
        mode = "r+" if (root / "values.f16").exists() else "w+"
        try:  # a cut or foreign array is refused by numpy's header check
            values = np.lib.format.open_memmap(root / "values.f16", mode=mode, dtype=np.float16,
                                               shape=(views, n, dim))
            done = np.lib.format.open_memmap(root / "done.u8", mode=mode, dtype=np.uint8, shape=(views, n))
        except ValueError:
            raise damaged from None
        meta_file.write_text(json.dumps(expected))
        return cls(root, values, done)

    def reuse_siblings(self) -> int:
        """Copy in the views this cache shares with the caches of the same teacher and data for another `--views`
        (view v is the same transform of the same image whatever N is), so that `--views 4` after `--views 2`
        embeds only views 2 and 3. A sibling whose description or arrays do not match is skipped, not trusted.
        Returns how many embeddings were copied."""
        base = self.root.name.split(VIEWS_SUFFIX)[0]  # the name `targets_dir` gives the same teacher and data
        siblings = [d for d in sorted(self.root.parent.iterdir())
                    if d != self.root and (d.name == base or d.name.startswith(base + VIEWS_SUFFIX))]
        return sum(self._copy_from(d) for d in siblings)

    def _copy_from(self, other: Path) -> int:
        mine = json.loads((self.root / "meta.json").read_text())
        try:
            theirs = json.loads((other / "meta.json").read_text())
            values = np.load(other / "values.f16", mmap_mode="r")
            done = np.load(other / "done.u8", mmap_mode="r")
        except (OSError, ValueError):
            return 0
        views = theirs.get("views") if isinstance(theirs, dict) else None
        same = isinstance(views, int) and {**theirs, "views": mine["views"]} == mine
        if not same or values.shape != (views, *self.values.shape[1:]) or values.dtype != np.float16 \
                or done.shape != (views, self.values.shape[1]) or done.dtype != np.uint8:
            return 0
        copied = 0
        for v in range(min(views, self.values.shape[0])):
            take = np.flatnonzero((done[v] == 1) & (self.done[v] == 0))
            if len(take) and np.isfinite(values[v, take]).all():
                self.values[v, take] = values[v, take]
                self.values.flush()
                self.done[v, take] = 1
                self.done.flush()
                copied += len(take)
        return copied

    @property
    def complete(self) -> bool:
        return bool(self.done.all())

    def fill(self, teacher, images: np.ndarray, batch_size: int = 64, progress: bool = True,
             between: Callable[[], object] | None = None) -> int:
        """Embed every (view, image) not yet done; flushed every batch, so Ctrl-C loses at most one; `between()`
        runs before each batch (a pause for the tests, `models.training.cpu_share`); what another run sharing the
        cache filled meanwhile is skipped. Returns how many embeddings the teacher computed (0: the cache was
        complete)."""
        computed = 0
        todo = [(v, i) for v in range(self.done.shape[0]) for i in np.flatnonzero(self.done[v] == 0)]
        bar = tqdm(total=len(todo), desc="teacher embeddings (cached)", unit="img", disable=bar_disable(progress))
        for start in range(0, len(todo), batch_size):
            if between is not None:
                between()
            chunk = todo[start:start + batch_size]
            for v in sorted({v for v, _ in chunk}):
                idx = np.array([i for w, i in chunk if w == v and not self.done[v, i]])  # another run may have
                if not len(idx):                                                      # filled it meanwhile
                    continue
                self.values[v, idx] = teacher.embed(view(images[idx], v, idx)).astype(np.float16)
                computed += len(idx)
                self.values.flush()
                self.done[v, idx] = 1
                self.done.flush()
            bar.update(len(chunk))
        bar.close()
        return computed


def targets_dir(cache_root: Path, teacher_sha256: str, files: list[Path], views: int = N_VIEWS) -> Path:
    """One cache per teacher, data and number of views (the two-view cache keeps its old name)."""
    suffix = "" if views == N_VIEWS else f"{VIEWS_SUFFIX}{views}"
    return Path(cache_root) / "teacher_targets" / f"{teacher_sha256[:12]}-{dataset_key(files)}{suffix}"


def default_cache_root() -> Path:
    return Path(os.environ.get("FFR_CACHE_DIR", Path.home() / ".cache" / "ffr-edge"))

"""LFW's standard verification protocol: `pairs.txt` with 10 folds of 300 + 300 pairs.

Line 1 is `FOLDS PAIRS_PER_CLASS`; then per fold PAIRS genuine lines `name n1 n2` and PAIRS
impostor lines `name1 n1 name2 n2`, image files being `name/name_NNNN.jpg`.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass
class PairList:
    a: list[str]          # relative paths "Name/Name_0001.jpg"
    b: list[str]
    same: np.ndarray
    folds: np.ndarray


def _image(name: str, number: str) -> str:
    return f"{name}/{name}_{int(number):04d}.jpg"


def read_pairs(path: str | Path) -> PairList:
    path = Path(path)
    lines = [line.split() for line in path.read_text().splitlines() if line.strip()]
    if not lines:
        raise ValueError(f"{path}: empty pairs file")
    n_folds, per_class = (int(lines[0][0]), int(lines[0][1])) if len(lines[0]) == 2 else (10, None)
    body = lines[1:] if len(lines[0]) == 2 else lines
    a, b, same = [], [], []
    for k, parts in enumerate(body, 2):
        if len(parts) == 3:
            a.append(_image(parts[0], parts[1]))
            b.append(_image(parts[0], parts[2]))
            same.append(True)
        elif len(parts) == 4:
            a.append(_image(parts[0], parts[1]))
            b.append(_image(parts[2], parts[3]))
            same.append(False)
        else:
            raise ValueError(f"{path}:{k}: expected 3 or 4 fields, got {' '.join(parts)!r}")
    per_fold = 2 * per_class if per_class else int(np.ceil(len(a) / n_folds))
    folds = np.minimum(np.arange(len(a)) // per_fold, n_folds - 1)
    return PairList(a, b, np.array(same), folds)


def pair_indices(pairs: PairList, paths: list[str], root: Path) -> tuple[np.ndarray, np.ndarray]:
    """Rows of `paths` for each pair; pairs with an image that was not cropped are dropped.

    Returns (index pairs, mask of kept pairs over the original list).
    """
    base = Path(os.path.abspath(root))  # not resolve(): datasets are often trees of symlinks
    row = {Path(os.path.abspath(p)).relative_to(base).as_posix(): i for i, p in enumerate(paths)}
    ia = np.array([row.get(p, -1) for p in pairs.a])
    ib = np.array([row.get(p, -1) for p in pairs.b])
    kept = (ia >= 0) & (ib >= 0)
    return np.stack([ia[kept], ib[kept]], 1), kept

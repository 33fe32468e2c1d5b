"""Find the labelled images of a face dataset in the layouts users already have.

Layouts:
- `folders`: one folder per identity (VGGFace2, ORL, Extended Yale B, CASIA-WebFace ...),
  images directly inside each folder.
- `lfw`: LFW, i.e. folders per identity, optionally inside a single `lfw*/` folder, usually
  next to a `pairs.txt`.
- `celeba`: CelebA's `identity_CelebA.txt` (`000001.jpg 2880` per line) beside, or in
  `Anno/` next to, its image folder (`img_align_celeba/`, `img_celeba/`, `Img/...`).
A dataset written by `models.faces.synthetic` carries a marker file and is flagged
`synthetic` so that every report can say so.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from models.faces.imageio import IMAGE_EXTENSIONS, is_image_file

SYNTHETIC_MARKER = "SYNTHETIC_FACES.txt"
CELEBA_IDENTITY_FILE = "identity_CelebA.txt"
CELEBA_IMAGE_DIRS = ("img_align_celeba", "img_celeba", "Img/img_align_celeba", "Img/img_celeba", "images", "img")
LAYOUTS = ("auto", "folders", "lfw", "celeba")


class DatasetError(ValueError):
    """The data a user pointed at cannot be used; the message says why and what to do."""


@dataclass(frozen=True)
class FaceSample:
    path: Path
    identity: str


@dataclass
class FaceIndex:
    """The labelled image files of one dataset (nothing decoded yet)."""

    root: Path
    layout: str
    samples: list[FaceSample]
    synthetic: bool = False
    pairs_file: Path | None = None
    attributes_file: Path | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def identities(self) -> list[str]:
        return sorted({s.identity for s in self.samples})

    def counts(self) -> Counter:
        return Counter(s.identity for s in self.samples)

    def subset(self, identities: set[str]) -> FaceIndex:
        kept = [s for s in self.samples if s.identity in identities]
        return FaceIndex(self.root, self.layout, kept, self.synthetic, self.pairs_file, self.attributes_file)


def load_index(root: str | Path, layout: str = "auto") -> FaceIndex:
    """Index the dataset at `root`; raise `DatasetError` when nothing usable is there."""
    root = Path(root).expanduser()
    if not root.exists():
        raise DatasetError(f"dataset path does not exist: {root}")
    if not root.is_dir():
        raise DatasetError(f"dataset path is not a folder: {root}")
    if layout not in LAYOUTS:
        raise DatasetError(f"unknown layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
    if layout == "auto":
        layout = _guess_layout(root)
    index = {"folders": _index_folders, "lfw": _index_lfw, "celeba": _index_celeba}[layout](root)
    index.synthetic = (root / SYNTHETIC_MARKER).exists()
    if not index.samples:
        raise DatasetError(
            f"no images found in {root} (layout {layout}); expected one folder per identity holding "
            f"image files ({'/'.join(sorted(e.lstrip('.') for e in IMAGE_EXTENSIONS))}), LFW, "
            f"or CelebA's {CELEBA_IDENTITY_FILE}"
        )
    return index


def _guess_layout(root: Path) -> str:
    if _find_celeba_identity_file(root) is not None:
        return "celeba"
    if (root / "pairs.txt").exists() or _single_lfw_folder(root) is not None:
        return "lfw"
    return "folders"


def _index_folders(root: Path) -> FaceIndex:
    samples = []
    for folder in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        samples += [FaceSample(f, folder.name) for f in sorted(folder.iterdir()) if is_image_file(f)]
    return FaceIndex(root, "folders", samples)


def _single_lfw_folder(root: Path) -> Path | None:
    subdirs = [p for p in root.iterdir() if p.is_dir() and p.name.lower().startswith("lfw")]
    return subdirs[0] if len(subdirs) == 1 else None


def _index_lfw(root: Path) -> FaceIndex:
    images_root = _single_lfw_folder(root) or root
    index = _index_folders(images_root)
    pairs = next((p for p in (root / "pairs.txt", images_root / "pairs.txt") if p.exists()), None)
    return FaceIndex(images_root, "lfw", index.samples, pairs_file=pairs)


def _find_celeba_identity_file(root: Path) -> Path | None:
    for candidate in (root / CELEBA_IDENTITY_FILE, root / "Anno" / CELEBA_IDENTITY_FILE):
        if candidate.exists():
            return candidate
    return None


def _index_celeba(root: Path) -> FaceIndex:
    identity_file = _find_celeba_identity_file(root)
    if identity_file is None:
        raise DatasetError(f"{root}: CelebA layout needs {CELEBA_IDENTITY_FILE} (in the folder or in Anno/)")
    image_dir = next((root / d for d in CELEBA_IMAGE_DIRS if (root / d).is_dir()), None)
    if image_dir is None:
        raise DatasetError(f"{root}: no CelebA image folder; expected one of {', '.join(CELEBA_IMAGE_DIRS)}")
    samples, missing = [], 0
    for line_no, line in enumerate(identity_file.read_text().splitlines(), 1):
        parts = line.split()
        if not parts:
            continue
        if len(parts) != 2:
            raise DatasetError(f"{identity_file}:{line_no}: expected 'IMAGE IDENTITY', got {line!r}")
        path = image_dir / parts[0]
        if path.exists():
            samples.append(FaceSample(path, parts[1]))
        else:
            missing += 1
    attributes = next(
        (p for p in (root / "list_attr_celeba.txt", root / "Anno" / "list_attr_celeba.txt") if p.exists()), None
    )
    index = FaceIndex(root, "celeba", samples, attributes_file=attributes)
    if missing:
        index.notes.append(f"{missing} images listed in {identity_file.name} are not in {image_dir}")
    return index

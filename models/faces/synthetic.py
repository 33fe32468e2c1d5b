"""SYNTHETIC faces: drawn cartoon identities for demos and tests that must run with no data.

These are not photographs of anyone. Each identity is a fixed set of facial proportions,
colours and marks; each image of it varies pose, lighting, expression and noise, so a
model has to learn the identity rather than the picture. Everything is deterministic
from (seed, identity, image). Datasets written to disk carry `SYNTHETIC_FACES.txt` and
identity folders named `synthetic_NNNN`, so no report can mistake them for real faces.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import cv2
import numpy as np

from models.faces.datasets import SYNTHETIC_MARKER
from models.faces.imageio import write_image

CANVAS = 160
HAIR_COLOURS = [(30, 25, 20), (85, 55, 30), (150, 110, 60), (210, 180, 110), (140, 60, 25), (160, 160, 160)]


@dataclass(frozen=True)
class Identity:
    """The fixed traits of one synthetic person (canvas pixels, RGB colours)."""

    skin: tuple[int, int, int]
    face_axes: tuple[int, int]
    hair: tuple[int, int, int]
    hair_style: int
    eye_dx: int
    eye_y: int
    eye_axes: tuple[int, int]
    iris: tuple[int, int, int]
    brow_thickness: int
    brow_tilt: float
    nose_length: int
    nose_width: int
    mouth_width: int
    mouth_y: int
    lips: tuple[int, int, int]
    moles: tuple[tuple[int, int], ...]
    glasses: bool
    beard: bool


def make_identity(rng: np.random.Generator) -> Identity:
    r = int(rng.integers(140, 245))
    g = int(rng.integers(int(r * 0.6), int(r * 0.85)))
    b = int(rng.integers(int(g * 0.6), int(g * 0.9)))
    return Identity(
        skin=(r, g, b),
        face_axes=(int(rng.integers(38, 50)), int(rng.integers(50, 62))),
        hair=HAIR_COLOURS[int(rng.integers(len(HAIR_COLOURS)))],
        hair_style=int(rng.integers(4)),
        eye_dx=int(rng.integers(14, 24)),
        eye_y=int(rng.integers(-16, -6)),
        eye_axes=(int(rng.integers(5, 10)), int(rng.integers(3, 6))),
        iris=tuple(int(v) for v in rng.integers(20, 160, 3)),
        brow_thickness=int(rng.integers(2, 5)),
        brow_tilt=float(rng.uniform(-0.35, 0.35)),
        nose_length=int(rng.integers(10, 22)),
        nose_width=int(rng.integers(4, 10)),
        mouth_width=int(rng.integers(10, 24)),
        mouth_y=int(rng.integers(20, 32)),
        lips=(int(rng.integers(120, 220)), int(rng.integers(40, 100)), int(rng.integers(40, 100))),
        moles=tuple((int(rng.integers(-30, 30)), int(rng.integers(-20, 40))) for _ in range(int(rng.integers(0, 4)))),
        glasses=bool(rng.random() < 0.25),
        beard=bool(rng.random() < 0.2),
    )


def _draw_frontal(person: Identity, rng: np.random.Generator) -> np.ndarray:
    """The identity facing the camera, with a random expression and background."""
    img = np.empty((CANVAS, CANVAS, 3), np.uint8)
    img[:] = rng.integers(40, 220, 3)
    c = CANVAS // 2
    ax, ay = person.face_axes
    aa = cv2.LINE_AA
    if person.hair_style == 1:  # long hair behind the face
        cv2.ellipse(img, (c, c + 10), (ax + 12, ay + 14), 0, 0, 360, person.hair, -1, aa)
    cv2.ellipse(img, (c, c), (ax, ay), 0, 0, 360, person.skin, -1, aa)
    if person.beard:
        cv2.ellipse(img, (c, c + 18), (ax - 4, ay - 18), 0, 0, 180, person.hair, -1, aa)
    if person.hair_style != 2:  # 2 is bald
        cv2.ellipse(img, (c, c - ay // 2), (ax + 3, ay // 2 + 2), 0, 180, 360, person.hair, -1, aa)
    if person.hair_style == 3:  # fringe
        cv2.rectangle(img, (c - ax + 8, c - ay // 2 - 6), (c + ax - 8, c - ay // 2 + 6), person.hair, -1)
    openness = rng.uniform(0.45, 1.0)
    ex, ey = person.eye_axes
    for side in (-1, 1):
        centre = (c + side * person.eye_dx, c + person.eye_y)
        cv2.ellipse(img, centre, (ex, max(1, int(ey * openness))), 0, 0, 360, (245, 245, 245), -1, aa)
        cv2.circle(img, centre, max(1, int(min(ex, ey) * 0.8 * openness)), person.iris, -1, aa)
        brow_y = centre[1] - ey - 6
        tilt = int(side * person.brow_tilt * ex)
        cv2.line(img, (centre[0] - ex, brow_y + tilt), (centre[0] + ex, brow_y - tilt), person.hair,
                 person.brow_thickness, aa)
    shade = tuple(int(v * 0.75) for v in person.skin)
    nose_top, nose_tip = (c, c + person.eye_y + 4), (c, c + person.eye_y + 4 + person.nose_length)
    cv2.line(img, nose_top, nose_tip, shade, 2, aa)
    cv2.line(img, (c - person.nose_width, nose_tip[1]), (c + person.nose_width, nose_tip[1]), shade, 2, aa)
    smile = rng.uniform(-1.0, 1.0)
    mouth_c = (c, c + person.mouth_y)
    curve = int(abs(smile) * 6) + 1
    cv2.ellipse(img, mouth_c, (person.mouth_width, curve), 0, 0 if smile >= 0 else 180, 180 if smile >= 0 else 360,
                person.lips, 3, aa)
    for mx, my in person.moles:
        cv2.circle(img, (c + mx, c + my), 2, (60, 40, 30), -1, aa)
    if person.glasses:
        for side in (-1, 1):
            cv2.circle(img, (c + side * person.eye_dx, c + person.eye_y), ex + 4, (20, 20, 20), 2, aa)
        cv2.line(img, (c - person.eye_dx + ex + 4, c + person.eye_y), (c + person.eye_dx - ex - 4, c + person.eye_y),
                 (20, 20, 20), 2, aa)
    return img


def _pose_and_light(img: np.ndarray, rng: np.random.Generator, size: int) -> np.ndarray:
    """Rotate, scale, shift and turn (yaw as horizontal squash), then light and add sensor noise."""
    yaw = rng.uniform(-0.25, 0.25)
    scale = rng.uniform(0.9, 1.1) * size / CANVAS * 1.15
    m = cv2.getRotationMatrix2D((CANVAS / 2, CANVAS / 2), rng.uniform(-12, 12), scale)
    m[0, :2] *= 1.0 - abs(yaw) * 0.35
    m[:, 2] += (size - CANVAS) / 2 + rng.uniform(-6, 6, 2) + np.array([yaw * 10, 0])
    out = cv2.warpAffine(img, m, (size, size), flags=cv2.INTER_LINEAR, borderMode=cv2.BORDER_REFLECT)
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32) / size - 0.5
    angle = rng.uniform(0, 2 * np.pi)
    light = rng.uniform(0.75, 1.15) + rng.uniform(0.2, 0.6) * (np.cos(angle) * xx + np.sin(angle) * yy)
    out = out.astype(np.float32) * light[..., None]
    out += rng.normal(0, rng.uniform(2, 8), out.shape)
    out = np.clip(out, 0, 255).astype(np.uint8)
    if rng.random() < 0.3:
        out = cv2.GaussianBlur(out, (3, 3), rng.uniform(0.3, 1.2))
    return out


def identity_rng(seed: int, identity: int, image: int | None = None) -> np.random.Generator:
    key = [seed, identity] if image is None else [seed, identity, image + 1]
    return np.random.default_rng(key)


def render(seed: int, identity: int, image: int, size: int = 128) -> np.ndarray:
    """Image `image` of synthetic identity `identity` as (size,size,3) RGB uint8."""
    person = make_identity(identity_rng(seed, identity))
    rng = identity_rng(seed, identity, image)
    return _pose_and_light(_draw_frontal(person, rng), rng, size)


def generate(n_identities: int, n_images: int, seed: int = 0, size: int = 128) -> tuple[np.ndarray, np.ndarray]:
    """All images as (N,size,size,3) uint8 and their identity labels."""
    if n_identities < 1 or n_images < 1:
        raise ValueError("need at least one identity and one image per identity")
    images = [render(seed, i, j, size) for i in range(n_identities) for j in range(n_images)]
    labels = np.repeat(np.arange(n_identities), n_images)
    return np.stack(images), labels


def identity_name(identity: int) -> str:
    return f"synthetic_{identity:04d}"


def write_dataset(out: str | Path, n_identities: int, n_images: int, seed: int = 0, size: int = 128,
                  suffix: str = ".png") -> Path:
    """Write a folder-per-identity SYNTHETIC dataset that every `ffr` command can read: at least two people of at
    least two images each, the least that verification (one genuine and one impostor pair) needs."""
    if n_identities < 2 or n_images < 2:
        raise ValueError(f"a SYNTHETIC dataset needs at least 2 identities of at least 2 images each (got "
                         f"{n_identities} x {n_images}): --synthetic-identities and --synthetic-images")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for i in range(n_identities):
        folder = out / identity_name(i)
        folder.mkdir(exist_ok=True)
        for j in range(n_images):
            write_image(folder / f"{j:03d}{suffix}", render(seed, i, j, size))
    (out / SYNTHETIC_MARKER).write_text(
        "SYNTHETIC faces drawn by ffr-edge (models/faces/synthetic.py): not photographs of real people.\n"
        f"identities={n_identities} images_per_identity={n_images} seed={seed} size={size}\n"
    )
    return out

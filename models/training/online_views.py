"""Augmentation as batched tensor operations, on whatever device holds the crops.

Two halves, because a distillation target is only right for the view the teacher saw. Shown to teacher and student
alike:
- `geometric_views`: small scale, shift, rotation and mirror jitter (one affine warp per crop,
  `F.affine_grid` + `F.grid_sample`);
- `mixed_faces` and `relit_faces`: two faces blended, one-sided light and shadow (changes of the face itself);
shown to the student only:
- `photometric`: brightness, contrast, saturation, greyscale, blur and erasing, shown to the
  student only ("Knowledge distillation: A good teacher is patient and consistent", Beyer et
  al., CVPR 2022: consistent views, aggressive augmentation, long schedules).
Everything is drawn from one `torch.Generator`, so a run is reproducible from its seed and step.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

from models.faces.preprocess import INPUT_SIZE, MEAN, STD


@dataclass(frozen=True)
class ViewJitter:
    """Ranges of the geometric jitter; the defaults stay within what a landmark aligner gets wrong."""

    scale: float = 0.08        # zoom in [1 - scale, 1 + scale]
    shift: float = 0.06        # translation, as a fraction of the crop side
    rotate_deg: float = 10.0
    mirror: float = 0.5        # probability of a horizontal flip


def _uniform(n: int, low: float, high: float, generator: torch.Generator) -> torch.Tensor:
    return low + (high - low) * torch.rand(n, generator=generator, device=generator.device)


def affines_from_uniforms(u: torch.Tensor, jitter: ViewJitter) -> torch.Tensor:
    """(n, 5) uniforms in [0, 1) -> (n, 2, 3) affine matrices in `affine_grid`'s normalised coordinates
    (output -> input): zoom, rotation, shift x, shift y, mirror. A fixed u gives a fixed view, which is how a
    cached view is recomputed exactly (`models.training.distill_data.view`)."""
    scale = 1 - jitter.scale + 2 * jitter.scale * u[:, 0]
    angle = (2 * u[:, 1] - 1) * jitter.rotate_deg * (math.pi / 180)
    shift = (2 * u[:, 2:4] - 1) * 2 * jitter.shift
    mirror = torch.where(u[:, 4] < jitter.mirror, -1.0, 1.0).to(u.dtype)
    cos, sin = torch.cos(angle) / scale, torch.sin(angle) / scale
    return torch.stack([torch.stack([cos * mirror, -sin, shift[:, 0]], 1),
                        torch.stack([sin * mirror, cos, shift[:, 1]], 1)], 1)


def random_affines(n: int, jitter: ViewJitter, generator: torch.Generator) -> torch.Tensor:
    """(n, 2, 3) random view affines drawn from `generator`."""
    return affines_from_uniforms(torch.rand(n, 5, generator=generator, device=generator.device), jitter)


def warp(crops: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
    """uint8 (N,3,H,W) crops and (N,2,3) affines -> float (N,3,H,W) views in 0..255 (reflected at the borders)."""
    x = crops.float()
    grid = F.affine_grid(theta.to(x.dtype), list(x.shape), align_corners=False)
    return F.grid_sample(x, grid, mode="bilinear", padding_mode="reflection", align_corners=False)


def geometric_views(crops: torch.Tensor, jitter: ViewJitter, generator: torch.Generator) -> torch.Tensor:
    """uint8 (N,3,H,W) crops -> float (N,3,H,W) randomly jittered views in 0..255."""
    return warp(crops, random_affines(len(crops), jitter, generator))


def mixed_faces(views: torch.Tensor, fraction: float, generator: torch.Generator) -> torch.Tensor:
    """The first `fraction` of the batch replaced by pixel blends a*x_i + (1-a)*x_j of two of its faces,
    a ~ U(0.3, 0.7): new faces of people no crop holds, which the teacher then embeds (issue 50's arm (e);
    mixup's blend, Zhang et al., ICLR 2018, used for unseen identities rather than labels)."""
    n = int(round(fraction * len(views)))
    if n == 0:
        return views
    partner = (torch.arange(n, device=views.device) + 1 + torch.randint(len(views) - 1, (1,), generator=generator,
                                                                        device=views.device)) % len(views)
    a = _uniform(n, 0.3, 0.7, generator).view(n, 1, 1, 1)
    return torch.cat([a * views[:n] + (1 - a) * views[partner], views[n:]])


def relit_faces(views: torch.Tensor, fraction: float, generator: torch.Generator) -> torch.Tensor:
    """Float (N,3,H,W) views in 0..255 with about `fraction` of them lit from one side: each times a shading field
    ambient + (1 - ambient) * sigmoid(k (x cos phi + y sin phi) + b) and an exposure gain, clipped at 255. The
    light's direction phi ~ U(0, 2 pi), its edge k ~ U(2, 8) at offset b ~ U(-1, 1), ambient ~ U(0.05, 0.5), gain
    ~ U(1, 1.6): the half-shadowed, half-burnt faces of a single lamp or a window, which colour jitter's uniform
    factors never make. Shown to the teacher as well (its target is for the face as lit), so the student learns how
    the teacher ranks such faces, where the distillation gap is widest (`bench/results/distill_gap_curve.md`)."""
    chosen = _chosen(fraction, len(views), generator)
    if not len(chosen):
        return views
    n, (_, _, h, w) = len(chosen), views.shape
    phi = _uniform(n, 0, 2 * math.pi, generator).view(n, 1, 1, 1)
    edge, offset = _uniform(n, 2, 8, generator).view(n, 1, 1, 1), _uniform(n, -1, 1, generator).view(n, 1, 1, 1)
    ambient, gain = _uniform(n, 0.05, 0.5, generator).view(n, 1, 1, 1), _uniform(n, 1, 1.6, generator).view(n, 1, 1, 1)
    ys = torch.linspace(-1, 1, h, device=views.device, dtype=views.dtype).view(1, 1, h, 1)
    xs = torch.linspace(-1, 1, w, device=views.device, dtype=views.dtype).view(1, 1, 1, w)
    shading = ambient + (1 - ambient) * torch.sigmoid(edge * (xs * torch.cos(phi) + ys * torch.sin(phi)) + offset)
    out = views.clone()
    out[chosen] = (views[chosen] * shading * gain).clamp(0, 255)
    return out


FaceChange = Callable[..., torch.Tensor]  # (views, generator=) -> views: a change of the face itself


def face_changes(mix_fraction: float = 0.0, relight_fraction: float = 0.0) -> list[FaceChange]:
    """The changes of the face itself that are on (blends, then light), in the order a run applies them; one that is
    off draws nothing from the generator, so a run without it is the run it was before the option existed."""
    return [partial(change, fraction=f) for change, f in ((mixed_faces, mix_fraction), (relit_faces, relight_fraction))
            if f]


def teacher_views(crops: torch.Tensor, jitter: ViewJitter, changes: list[FaceChange],
                  generator: torch.Generator) -> torch.Tensor:
    """uint8 (N,3,H,W) crops -> the float views in 0..255 the teacher embeds: geometric jitter, then each change."""
    views = geometric_views(crops, jitter, generator)
    for change in changes:
        views = change(views, generator=generator)
    return views


def _chosen(p: float, n: int, generator: torch.Generator) -> torch.Tensor:
    """Indices of the samples an augmentation applied with probability `p` picks (work only on those)."""
    return torch.nonzero(torch.rand(n, generator=generator, device=generator.device) < p).flatten()


def _grey(x: torch.Tensor) -> torch.Tensor:
    return 0.299 * x[:, 0:1] + 0.587 * x[:, 1:2] + 0.114 * x[:, 2:3]


def _blur(x: torch.Tensor, sigma: float = 1.0) -> torch.Tensor:
    r = torch.arange(-2, 3, device=x.device, dtype=x.dtype)
    k = torch.exp(-r ** 2 / (2 * sigma ** 2))
    k = k / k.sum()
    x = F.conv2d(F.pad(x, (2, 2, 0, 0), mode="reflect"), k.view(1, 1, 1, 5).expand(3, 1, 1, 5), groups=3)
    return F.conv2d(F.pad(x, (0, 0, 2, 2), mode="reflect"), k.view(1, 1, 5, 1).expand(3, 1, 5, 1), groups=3)


def _colour(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Brightness, contrast and saturation factors in [0.7, 1.3], [0.7, 1.3], [0.8, 1.2] (ColorJitter's order)."""
    n = len(x)
    bright, contrast, saturation = (1 + _uniform(n, -a, a, generator).view(n, 1, 1, 1) for a in (0.3, 0.3, 0.2))
    x = x * bright
    mean = _grey(x).mean(dim=(1, 2, 3), keepdim=True)
    x = (x - mean) * contrast + mean
    grey = _grey(x)
    return (x - grey) * saturation + grey


def _erase(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Random erasing (Zhong et al., AAAI 2020): one rectangle of 2-8% of each crop, filled with noise."""
    n, _, h, w = x.shape
    area = _uniform(n, 0.02, 0.08, generator) * h * w
    aspect = torch.exp(_uniform(n, math.log(0.3), math.log(3.3), generator))
    eh, ew = (area * aspect).sqrt().clamp(1, h - 1), (area / aspect).sqrt().clamp(1, w - 1)
    top, left = _uniform(n, 0, 1, generator) * (h - eh), _uniform(n, 0, 1, generator) * (w - ew)
    rows = torch.arange(h, device=x.device).view(1, h, 1)
    cols = torch.arange(w, device=x.device).view(1, 1, w)
    inside = ((rows >= top.view(n, 1, 1)) & (rows < (top + eh).view(n, 1, 1)) &
              (cols >= left.view(n, 1, 1)) & (cols < (left + ew).view(n, 1, 1))).unsqueeze(1)
    noise = torch.rand(x.shape, generator=generator, device=generator.device, dtype=x.dtype)
    return torch.where(inside, noise, x)


def photometric(x01: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Float (N,3,H,W) in 0..1 -> the same under the student's photometric augmentation, in 0..1: colour jitter
    (p 0.5), greyscale (p 0.05), blur (p 0.1), erasing (p 0.1): moderate, since far from the teacher's input its
    target stops being the right
    answer (Beyer et al., CVPR 2022)."""
    x = x01.clone()
    for p, op in ((0.5, lambda v: _colour(v, generator)), (0.05, lambda v: _grey(v).expand_as(v)),
                  (0.1, _blur), (0.1, lambda v: _erase(v.clamp(0, 1), generator))):
        chosen = _chosen(p, len(x), generator)
        if len(chosen):
            x[chosen] = op(x[chosen])
    return x.clamp(0, 1)


def student_input(x01: torch.Tensor, size: int = INPUT_SIZE) -> torch.Tensor:
    """0..1 crops -> the student's normalised input at its size (as `models.faces.preprocess.to_input`)."""
    if x01.shape[-1] != size:
        x01 = F.interpolate(x01, size=(size, size), mode="bilinear", align_corners=False)
    return (x01 - MEAN) / STD

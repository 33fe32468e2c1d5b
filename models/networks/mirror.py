"""Mirror averaging: a face's embedding is the L2-normalised sum of its own and its mirror image's embeddings.

Why: a face and its left-right mirror are the same person, so the two views' sum cancels part of what one view's
pose and lighting put into it; this is the usual test-time step of face verification (SphereFace's and
ArcFace's LFW protocol sums the two). It costs a second pass through the embedder per face.
`bench.mirror_averaging` measures both sides on every held-out set, through the ONNX file a device runs.

This module is the one home of the choice: both ONNX builders (`models.networks.embedder_onnx`, numpy only, and
`models.networks.onnx_export`, torch) read `MIRRORED` and write it into the file's metadata (`ffr.mirror`), so a
device's templates, probes, thresholds and adoption check all see one function. Torch evaluation (training,
the fleet's figures) embeds one view, as before. No torch import at module level: the numpy builder reads it.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

MIRRORED = True  # every ONNX a device runs averages each face with its mirror
WIDTH_AXIS = 3   # NCHW


def averaged(embed: Callable, image):
    """`embed` (a batch -> L2-normalised rows) applied to the images and their mirrors in one batch, the two halves
    summed and normalised again; equal for an image and its mirror."""
    import torch
    from torch.nn import functional as F

    both = embed(torch.cat([image, image.flip(WIDTH_AXIS)]))
    return F.normalize(both.reshape(2, -1, both.shape[1]).sum(0), dim=1)


def averaged_crops(embed: Callable, crops: np.ndarray) -> np.ndarray:
    """The same for an embedder of (N,H,W,3) crops in numpy (the ONNX teacher): each crop's and its mirror's rows
    normalised, summed and normalised again."""
    from models.evaluation.metrics import l2_normalise

    mirrored = np.ascontiguousarray(crops[:, :, ::-1])
    return l2_normalise(l2_normalise(embed(crops)) + l2_normalise(embed(mirrored)))

"""ffr-edge models, one home per concern:

- `faces`: reading, detecting, aligning and cropping faces; data sets and partitions;
- `networks`: backbone, heads, DFC branch, face model, teachers, shipped weights, ONNX export;
- `training`: the one training loop and what runs in it (supervised, distillation, local loss terms);
- `evaluation`: verification metrics, ROC, the separation check, plots;
- `maths`: torch-free maths over state dicts that the coordinator needs;
- `runtime` (ONNX inference) and `public_set` (the public negatives' file): torch-free, for devices;
- `cli`: the models' commands and the option builders other packages share.

Importing this package does not import torch: the on-device verification path
(`models.runtime`, `models.faces`) must run with onnxruntime, OpenCV and numpy only.
"""

import os as _os

# Images are attacker-written files: OpenCV refuses one whose header declares more pixels than this before decoding
# (its default allows 2^30, ~3 GB decoded). OpenCV reads the variable once, when it is loaded: hence here, before
# any module of this project imports cv2 (models.faces.imageio checks the common formats' headers itself too).
MAX_IMAGE_PIXELS = 40_000_000
_os.environ.setdefault("OPENCV_IO_MAX_IMAGE_PIXELS", str(MAX_IMAGE_PIXELS))

"""ffr-edge models: face pipeline, networks, metrics and export.

Importing this package does not import torch: the on-device verification path
(`models.runtime`, `models.faces`) must run with onnxruntime, OpenCV and numpy only.
"""

import os as _os

# Images are attacker-written files: OpenCV refuses one whose header declares more pixels than this before decoding
# (its default allows 2^30, ~3 GB decoded). OpenCV reads the variable once, when it is loaded: hence here, before
# any module of this project imports cv2 (models.faces.imageio checks the common formats' headers itself too).
MAX_IMAGE_PIXELS = 40_000_000
_os.environ.setdefault("OPENCV_IO_MAX_IMAGE_PIXELS", str(MAX_IMAGE_PIXELS))

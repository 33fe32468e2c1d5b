"""The edge device: enrolled faces, local training with the DFC branch, and backbone deltas out."""

import models  # noqa: F401,E402 - sets OpenCV's image-size limit before this package imports cv2

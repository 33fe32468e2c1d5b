"""ffr-edge models: face pipeline, networks, metrics and export.

Importing this package does not import torch: the on-device verification path
(`models.runtime`, `models.faces`) must run with onnxruntime, OpenCV and numpy only.
"""

"""`python -m ffr.models_only COMMAND ...`: `ffr`'s model commands alone (train, pretrain, pack-crops, export, eval).

For a machine with the training stack and nothing else: a lent GPU machine has torch, ONNX Runtime and OpenCV but
not the broker, web service and signing libraries the other commands import (`bench/gpu_distill.sh` runs this).
"""
from __future__ import annotations

import sys

from ffr.cli import main

if __name__ == "__main__":
    sys.exit(main(models_only=True))

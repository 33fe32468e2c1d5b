"""The benchmarks (`python -m bench.NAME`). Each measures with the CPU to itself: importing the package holds it
(`models.training.cpu_share`), so a background `ffr pretrain` pauses until the benchmark's process exits."""
from models.training.cpu_share import hold_cpu

_CPU = hold_cpu()

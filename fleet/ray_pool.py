"""Device turns as Ray tasks: the same `fleet.devices.run_turn` (the real edge client), scheduled by Ray.

On one machine Ray is started for the run (`--backend ray`); with `--ray-address` the turns go to an
existing Ray cluster, each asking for `--cpus-per-device` CPUs and `--gpus-per-device` GPUs, so Ray
places as many devices on a node as it has room for. The broker and the coordinator stay in the
simulating process: a device turn talks to them over MQTT like a real device, so every node must reach
the broker's address, mount the run folder at the same path, and have ffr-edge installed (README:
"Fleet simulation on a Ray cluster").
"""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from fleet.devices import Turn, run_turn

OBJECT_STORE_BYTES = 256 << 20  # turns and their results are a few kB: Ray's default (30 % of RAM) is waste here


def _turn_task(turn: Turn, threads: int) -> dict:
    import logging

    import torch

    torch.set_num_threads(threads)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    return run_turn(turn)


class RayPool:
    """The `DevicePool` interface (run / close / terminate) over Ray tasks."""

    def __init__(self, address: str | None, cpus_per_device: float = 1.0, gpus_per_device: float = 0.0,
                 num_cpus: int | None = None):
        try:
            import ray
        except ImportError as exc:
            raise RuntimeError("--backend ray needs Ray: pip install 'ray>=2.40'") from exc
        self.ray = ray
        self.started_here = not ray.is_initialized()
        if self.started_here:
            if address:
                ray.init(address=address, log_to_driver=False)
            else:
                ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False,
                         object_store_memory=OBJECT_STORE_BYTES)
        self.task = ray.remote(_turn_task).options(num_cpus=cpus_per_device, num_gpus=gpus_per_device,
                                                   max_retries=0)
        self.threads = max(1, int(cpus_per_device))
        self.pending: list = []

    def run(self, turns: list[Turn]) -> Iterator[dict]:
        """Results as devices finish (not in submission order); a task Ray could not run (its worker died, or
        was killed for memory) is that device's failed turn, as with the process pool, not the run's end."""
        refs = {self.task.remote(turn, self.threads): turn for turn in turns}
        self.pending = list(refs)
        while self.pending:
            done, self.pending = self.ray.wait(self.pending, num_returns=1)
            try:
                yield self.ray.get(done[0])
            except self.ray.exceptions.RayError as exc:
                turn = refs[done[0]]
                yield {"device_id": Path(turn.credential).parent.name, "round_id": turn.round_id, "ok": False,
                       "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}

    def close(self) -> None:
        if self.started_here:
            self.ray.shutdown()

    def terminate(self) -> None:
        """Ctrl-C: cancel every turn not finished. Device state is written atomically, so homes stay usable."""
        for ref in self.pending:
            self.ray.cancel(ref, force=True)
        self.pending = []
        self.close()

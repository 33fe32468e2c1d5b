"""Virtual devices: a small pool of worker processes runs devices' turns one after another.

A turn is the real edge client (`edge_client.daemon.EdgeDevice`) connecting to the broker,
doing what the coordinator asks (register, or train the open round and upload its delta),
and disconnecting. Everything a device owns (key, head, DFC branch, local backbone, pending
update) lives in its home folder between turns, so memory is bounded by the pool, not by
the number of devices.
"""
from __future__ import annotations

import logging
import multiprocessing
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from edge_client.memory import release_memory


@dataclass(frozen=True)
class Turn:
    credential: str     # the device's credential file (its id, the coordinator's key, its broker login)
    data: str
    home: str
    broker: str
    crop_cache: str
    detector: str
    seed: int
    round_id: int | None = None   # None: only register
    timeout_s: float = 600.0
    attack: str | None = None     # a malicious device's attack (fleet.attacks), None for honest ones
    public_set: str | None = None  # FedFR's D_g, one read-only file shared by every device of the run
    attack_bound: float | None = None  # the norm bound the coordinator enforces (a collapse attacker stays inside)
    attack_epochs: int = 1             # the round's local epochs: the coordinator caps a claim at images x epochs
    attack_share: float = 1.0          # an attacker's estimate of its weight in the mean (1 / training devices)
    attack_photos: str | None = None   # an impersonation's photos (fleet.impersonation.write_photos)


def _init_worker(threads: int) -> None:
    """Workers ignore Ctrl-C (the simulator stops them) and share the cores between them."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import torch

    torch.set_num_threads(threads)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")


def freeze_imports() -> None:
    """Once per worker process, after the heavy imports: move what exists now (modules, torch's and numpy's
    objects) out of the garbage collector's sight, so the full collection after every turn walks only what
    the turn made (measured in a small fleet: 0.33-0.40 s -> 2-21 ms a turn); imports live as long as the process."""
    import gc

    global _FROZEN
    if not _FROZEN:
        gc.collect()
        gc.freeze()
        _FROZEN = True


_FROZEN = False


def run_turn(turn: Turn) -> dict:
    """One device's turn; returns its round log entry (loss, accuracy, bytes sent) or why it failed."""
    from edge_client.daemon import EdgeDevice
    from fleet.poisoning_device import PoisoningDevice

    freeze_imports()
    started = time.perf_counter()
    result = {"device_id": Path(turn.credential).parent.name, "round_id": turn.round_id, "ok": False}
    try:
        kind = EdgeDevice if turn.attack is None else PoisoningDevice
        device = kind(Path(turn.credential), Path(turn.data), Path(turn.home), broker=turn.broker,
                      detector=turn.detector, export_onnx=False, seed=turn.seed, crop_cache=Path(turn.crop_cache),
                      public_set=None if turn.public_set is None else Path(turn.public_set))
        device.prepare()  # the device's faces, decoded here so that a bad folder is this turn's error
    except Exception as exc:  # noqa: BLE001 - a device that cannot start is reported, not fatal to the pool
        return {**result, "error": f"{type(exc).__name__}: {exc}", "turn_seconds": time.perf_counter() - started}
    if turn.attack is not None:
        device.arm(turn.attack, turn.attack_bound, len(device.crops) * turn.attack_epochs, turn.attack_share,
                   turn.attack_photos)
    device.start()
    try:
        deadline = time.monotonic() + turn.timeout_s
        if turn.round_id is None:
            result["ok"] = device.registered.wait(turn.timeout_s)
            result.setdefault("error", None if result["ok"] else "not registered in time")
            return result
        while turn.round_id not in device.done_rounds:
            if turn.round_id in device.failed_rounds:
                result["error"] = device.failed_rounds[turn.round_id]
                return result
            if time.monotonic() > deadline:
                result["error"] = f"round {turn.round_id} not done within {turn.timeout_s:.0f} s"
                return result
            time.sleep(0.05)
        entry = next(e for e in reversed(device.home.rounds_log()) if e["round_id"] == turn.round_id)
        result.update(entry, ok=bool(entry.get("acked")))
        return result
    finally:
        device.stop()
        del device
        release_memory()
        result["turn_seconds"] = time.perf_counter() - started


class DevicePool:
    """`workers` processes (spawned: the parent holds MQTT threads), `threads` torch threads each."""

    def __init__(self, workers: int, threads: int):
        context = multiprocessing.get_context("spawn")
        self.pool = context.Pool(workers, initializer=_init_worker, initargs=(threads,))

    def run(self, turns: list[Turn]) -> Iterator[dict]:
        """Results as devices finish (not in submission order)."""
        return self.pool.imap_unordered(run_turn, turns)

    def close(self) -> None:
        self.pool.close()
        self.pool.join()

    def terminate(self) -> None:
        """Ctrl-C: stop mid-turn. Device state is written atomically, so every home stays usable."""
        self.pool.terminate()
        self.pool.join()

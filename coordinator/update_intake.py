"""A round's updates coming in: a signed header, then chunks, then a verified delta folded into the round.

Every step refuses what does not match what came before it: chunks must belong to a signed header's transfer
and match its sha256 and size; the reassembled payload must decode to the model's exact layout in the round's
codec, with a finite norm the update filter accepts. Only then is the update made durable (the store) and
acknowledged, and, under the mean rule, folded into the round's running mean (memory O(model)).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np

from coordinator.robust import l2_norm
from coordinator.round_state import OpenRound
from coordinator.settings import RoundSettings
from coordinator.store import Store
from coordinator.update_filters import UpdateFilter
from protocol.chunks import Reassembler, from_bytes
from protocol.codecs import Staging, decode_verified
from protocol.messages import Ack, MessageError, UpdateHeader
from protocol.tensors import PayloadError

log = logging.getLogger("coordinator")
REFUSED_TRANSFERS_KEPT = 1024


class UpdateIntake:
    def __init__(self, settings: RoundSettings, store: Store, layout: tuple, update_filter: UpdateFilter,
                 tell: Callable[[str, object], None], images: dict[str, int],
                 observe: Callable[[dict], np.ndarray | None] = lambda delta: None):
        """`images`: each device's registered image count (the engine's dict, kept current on admission);
        `observe`: what the round's update screen keeps of each update (`coordinator.update_screen`)."""
        self.settings, self.store, self.layout, self.filter = settings, store, layout, update_filter
        self.tell, self.images, self.observe = tell, images, observe
        self.staging = Staging(*layout, settings.training.transport.codec)  # every accepted update is decoded into it

    def on_header(self, current: OpenRound | None, device_id: str, header: UpdateHeader) -> None:
        if current is None or header.round_id != current.round_id:
            if self.store.update_accepted(header.round_id, device_id):
                self.tell(device_id, Ack(of="update", round_id=header.round_id))  # its ack was lost in transit
                return
            raise MessageError(f"round {header.round_id} is not open")
        if device_id not in current.participants:
            raise MessageError(f"{device_id} was not selected for round {header.round_id}")
        if header.base_version != current.base_version:
            raise MessageError(f"stale base version {header.base_version}; round {current.round_id} "
                               f"trains version {current.base_version}")
        if device_id in current.done:
            if current.headers[device_id].transfer_id in (header.transfer_id, "restored"):
                self.tell(device_id, Ack(of="update", round_id=current.round_id))  # a resend: the ack was lost
                return
            raise MessageError(f"{device_id} already delivered its update for round {current.round_id}")
        if header.payload_bytes > self.settings.max_update_bytes:
            raise MessageError(f"update of {header.payload_bytes} bytes exceeds {self.settings.max_update_bytes}")
        previous = current.headers.get(device_id)
        if previous is not None and previous.transfer_id != header.transfer_id:
            current.transfers.pop(previous.transfer_id, None)  # a new attempt replaces a half-received one
        current.headers[device_id] = header

    def on_chunk(self, current: OpenRound | None, device_id: str, frame: bytes) -> None:
        if current is None:
            raise MessageError("no round is open")
        chunk = from_bytes(frame)
        header = current.headers.get(device_id)
        if header is None or chunk.transfer_id != header.transfer_id:
            if chunk.transfer_id in current.refused_transfers:
                raise MessageError(f"chunk of refused transfer {chunk.transfer_id!r}")
            current.refused_transfers[chunk.transfer_id] = True
            while len(current.refused_transfers) > REFUSED_TRANSFERS_KEPT:
                current.refused_transfers.popitem(last=False)
            raise MessageError(f"chunks of transfer {chunk.transfer_id!r} have no valid signed update header")
        if chunk.sha256 != header.payload_sha256 or chunk.total_bytes != header.payload_bytes:
            raise PayloadError("chunk does not match the signed update header")
        assembler = current.transfers.get(chunk.transfer_id)
        if assembler is None:
            inflight = sum(t.total_bytes for t in current.transfers.values())
            if inflight + chunk.total_bytes > self.settings.max_inflight_bytes:
                raise MessageError("the coordinator is receiving too many updates at once; send again later")
            assembler = Reassembler.for_chunk(chunk, self.settings.max_update_bytes)
            current.transfers[chunk.transfer_id] = assembler
        try:
            payload = assembler.add(chunk)
        except PayloadError:
            current.transfers.pop(chunk.transfer_id, None)  # start over: the device's resend can still succeed
            raise
        if payload is not None:
            self._accept(current, device_id, header, payload)

    def _verified_delta(self, header: UpdateHeader, payload: bytes) -> tuple[dict, float]:
        """The delta (layout, dtype, finite norm, the filter's screen) or PayloadError."""
        if header.codec != self.settings.training.transport.codec:
            raise PayloadError(
                f"update sent with codec {header.codec}; this round takes {self.settings.training.transport.codec}"
            )
        # the reassembler matched these bytes to the signed header's sha256 (chunk.sha256 is checked against it)
        delta = decode_verified(payload, header.codec, *self.layout, into=self.staging)
        norm = l2_norm(delta)
        if not np.isfinite(norm):
            raise PayloadError("update norm overflows")
        self.filter.screen(norm)
        return delta, norm

    def _accept(self, current: OpenRound, device_id: str, header: UpdateHeader, payload: bytes) -> None:
        """Check the delta, make it durable, then acknowledge it."""
        current.transfers.pop(header.transfer_id, None)
        started = time.perf_counter()
        try:
            delta, norm = self._verified_delta(header, payload)
        except PayloadError as exc:
            self.store.record_update(current.round_id, device_id, header.n_samples, False, str(exc)[:300],
                                     len(payload), header.metrics)
            raise
        weight = self.weight(device_id, header.n_samples)
        self.store.save_update(current.round_id, device_id, payload)
        current.headers[device_id] = header
        current.done.add(device_id)
        current.weights[device_id], current.norms[device_id] = weight, norm
        self._keep_sketch(current, device_id, delta)  # now: `delta` lives in the staging buffer the next one reuses
        current.metrics[device_id] = header.metrics
        current.bytes_received += len(payload)
        if self.settings.combine == "mean":
            delta, scale = self.filter.prepare(delta, norm)
            current.running.add(delta, weight, scale)
        current.fold_seconds += time.perf_counter() - started
        self.store.record_update(current.round_id, device_id, header.n_samples, True, "", len(payload),
                                 {**header.metrics, "update_norm": norm, "weight": weight})
        self.tell(device_id, Ack(of="update", round_id=current.round_id))
        log.info("round %d: update from %s (%d samples, weight %.0f, norm %.3g, %d bytes), %d/%d", current.round_id,
                 device_id, header.n_samples, weight, norm, len(payload), len(current.done), len(current.participants))

    def _keep_sketch(self, current: OpenRound, device_id: str, delta: dict) -> None:
        kept = self.observe(delta)
        if kept is not None:
            current.sketches[device_id] = kept

    def weight(self, device_id: str, n_samples: int) -> float:
        """The update's weight as the filter sets it, from its claim and what the device registered."""
        epochs = self.settings.training.optimisation.epochs
        return self.filter.weight(n_samples, max(1, self.images.get(device_id, 1)) * epochs)

    def restore(self, current: OpenRound, load_delta: Callable[[OpenRound, str], dict]) -> None:
        """After a crash: the round's durable, acknowledged updates back in `current` (and its running mean)."""
        for update in self.store.accepted_updates(current.round_id):
            device_id = update["device_id"]
            if not self.store.update_path(current.round_id, device_id).exists():
                continue
            current.done.add(device_id)
            current.weights[device_id] = update["metrics"].get("weight", update["n_samples"])
            current.norms[device_id] = update["metrics"].get("update_norm", 0.0)
            current.metrics[device_id] = update["metrics"]
            delta = load_delta(current, device_id)  # read once for the screen and the running mean
            self._keep_sketch(current, device_id, delta)
            current.bytes_received += update["bytes"] or 0  # the round's cost counts the kept update too
            current.headers[device_id] = UpdateHeader(
                round_id=current.round_id, base_version=current.base_version, n_samples=update["n_samples"],
                transfer_id="restored", payload_sha256="0" * 64, payload_bytes=max(1, update["bytes"] or 1))
            if self.settings.combine == "mean":
                current.running.add(delta, current.weights[device_id])

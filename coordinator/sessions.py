"""Who may talk to the coordinator, and proof that they did: admission, signatures, sequence numbers, validators.

A device is let in once by the operator (a one-time admission token, `coordinator.admission`); its first hello
proves the token and registers its Ed25519 key. Every later message must be signed with that key and carry a
sequence number above the last one seen (replays and reorderings are refused). What one message proved about
its sender is returned as a `Sender`, never kept on the instance: only an authenticated sender is told why a
message was refused, and at most `errors_per_minute` times.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from coordinator.store import Store
from protocol.auth import ReplayGuard, proof_matches
from protocol.messages import Envelope, Hello, MessageError, authenticate, parse

log = logging.getLogger("coordinator")
COORDINATOR = "coordinator"


@dataclass
class Sender:
    """What one message has proved about who sent it, so far."""

    device_id: str
    authenticated: bool = False
    resume_seq: int | None = None  # after a refused sequence number: where the device should number from
    refused_admission: bool = False  # its credential (token, key, device id) is refused: it is told, so it can stop


class DeviceSessions:
    def __init__(self, store: Store, now: Callable[[], float], errors_per_minute: int):
        self.store, self.now, self.errors_per_minute = store, now, errors_per_minute
        self.keys = store.device_keys()
        self.images = store.device_images()
        self.guard = ReplayGuard(store.last_seqs())
        self.validators: set[str] = set()  # devices that said (signed) they score FV candidates
        self.heard: set[str] = set()         # devices that proved themselves to this process (admitted ones only)
        self.states: dict[str, str] = {}      # each one's last signed heartbeat ("final v3": took the final model)
        self._error_times: dict[str, list[float]] = {}

    def open(self, sender: Sender, payload: bytes) -> tuple[Envelope, bool]:
        """Parse and authenticate a message. Returns (envelope, True when it was an admission just granted).

        An admission hello under the key already registered is no new admission: the device never heard its
        Registered (it stopped, or the reply was lost) and its one-time token is spent; that key's signature
        proves it, and it is answered with Registered again."""
        envelope = parse(payload)
        device_id = sender.device_id
        if envelope.sender != device_id:
            raise MessageError(f"sender {envelope.sender!r} does not match the topic's device {device_id!r}")
        if envelope.to not in (None, COORDINATOR):
            raise MessageError("message addressed to someone else")
        body, key = envelope.body, self.keys.get(device_id)
        if isinstance(body, Hello) and body.token_proof is not None and body.public_key != key:
            self._admit(envelope, sender)
            return envelope, True
        if key is None:
            sender.refused_admission = self._operator_admitted(device_id)
            raise MessageError(f"unknown device {device_id!r}: it must be admitted (ffr coordinator admit) first")
        self._authenticate(envelope, key, sender)
        self.store.seen(device_id, envelope.seq)
        self.heard.add(device_id)
        return envelope, False

    def hello(self, device_id: str, hello: Hello) -> None:
        """A registered device says hello again: same key, and whether it validates now."""
        if hello.public_key != self.keys.get(device_id):
            raise MessageError("hello with a public key that is not this device's: re-admit the device")
        (self.validators.add if hello.validator else self.validators.discard)(device_id)

    def _authenticate(self, envelope: Envelope, public_key: str, sender: Sender) -> None:
        """Signature first (then the sender may be answered), then the sequence number."""
        authenticate(envelope, public_key)
        sender.authenticated = True
        try:
            self.guard.accept(envelope.sender, envelope.seq, int(self.now() * 1000))
        except ValueError as exc:
            sender.resume_seq = self.guard.resume_point(envelope.sender)
            raise MessageError(f"{exc}; number messages above {sender.resume_seq}") from None

    def _admit(self, envelope: Envelope, sender: Sender) -> None:
        """First contact (or re-enrolment): the admission token proves the operator let this device in,
        the signature proves it holds the private half of the key it registers."""
        hello: Hello = envelope.body
        device_id = sender.device_id
        token = self.store.admission_token(device_id)
        if token is None or not proof_matches(token, device_id, hello.public_key, hello.token_proof):
            sender.refused_admission = self._operator_admitted(device_id)
            raise MessageError(f"{device_id!r} is not admitted, or its admission token is wrong or already used")
        authenticate(envelope, hello.public_key)
        self.guard.last_seen.pop(device_id, None)  # a new key starts a new sequence
        self.guard.accept(device_id, envelope.seq, int(self.now() * 1000))
        self.store.register(device_id, hello.public_key, hello.n_images, hello.n_identities)
        self.store.use_admission(device_id)
        self.store.seen(device_id, envelope.seq)
        self.keys[device_id], self.images[device_id] = hello.public_key, hello.n_images
        if hello.validator:
            self.validators.add(device_id)
        sender.authenticated = True
        self.heard.add(device_id)
        log.info("admitted %s (%d identities, %d images)", device_id, hello.n_identities, hello.n_images)

    def awaiting(self, state: str) -> list[str]:
        """Devices heard from by this process whose last heartbeat is not `state`."""
        return sorted(d for d in self.heard if self.states.get(d) != state)

    def _operator_admitted(self, device_id: str) -> bool:
        """Whether the operator admitted this id (its token unused, or a key registered under it): only such a
        device is told that its credential is refused, never a stranger flooding made-up ids."""
        return device_id in self.keys or self.store.admission_token(device_id) is not None

    def may_explain(self, sender: Sender) -> bool:
        """Only an authenticated sender hears why, or a device the operator admitted whose credential is refused (the
        broker's ACL lets only that device's login read its inbox; it hears that it cannot join, and stops), at most
        `errors_per_minute` times: refusals never flood, and made-up ids hear nothing."""
        if not (sender.authenticated or sender.refused_admission):
            return False
        now = time.monotonic()
        recent = [t for t in self._error_times.get(sender.device_id, []) if now - t < 60.0]
        allowed = len(recent) < self.errors_per_minute
        self._error_times[sender.device_id] = recent + [now] if allowed else recent
        return allowed

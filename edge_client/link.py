"""The device's session with its coordinator: the broker connection, signatures, admission, and uploads.

Trust: the device pins the coordinator's public key from its credential file and drops every message that
is not signed by it (with a log line saying so); it signs its own messages with a key pair it generated
itself, and proves its admission token without ever sending it. Whatever a signed message asks of the
device beyond the session (rounds, releases, validation) goes to the `on_body` it was given.
Threads: paho's network thread only routes; nothing here trains or blocks it.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

import paho.mqtt.client as mqtt

from edge_client.downloads import ChunkDownloads
from edge_client.home import DeviceHome
from protocol import topics
from protocol.auth import Signer, token_proof
from protocol.chunks import split, to_bytes
from protocol.credential import Credential
from protocol.messages import Error, Hello, MessageError, Registered, UpdateHeader, open_envelope, seal
from protocol.tensors import PayloadError
from protocol.transport import BrokerAddress, make_client

log = logging.getLogger("edge_client")


def refuse_plaintext(address: BrokerAddress, credential: Credential, ca_file: str | None) -> None:
    """A device whose credential names a TLS broker (or carries its CA), or that was given a CA file, never talks to
    a plain mqtt:// address: a `--broker` override must not silently send its login and updates in the clear."""
    expects = ("its credential's broker is TLS" if credential.ca_pem or BrokerAddress.parse(credential.broker).tls
               else "--ca-file was given" if ca_file else None)
    if expects and not address.tls:
        raise ValueError(f"{address} is plain MQTT but {expects}: refusing to send the device's login and updates "
                         "unencrypted (use the mqtts:// address)")


LOGIN_REFUSED = ("Not authorized", "Bad user name or password")  # MQTT 5 reason codes 135, 134
LOGIN_REFUSALS_TO_STOP = 3  # one refusal can be a broker restarting with its password file half written


class CoordinatorLink:
    def __init__(self, credential: Credential, home: DeviceHome, on_body: Callable[[object], None],
                 hello_facts: Callable[[], dict], broker: str | None = None, ca_file: str | None = None):
        """`hello_facts()`: what the hello says of the device (its numbers of people and images, validator)."""
        self.credential, self.home, self.device_id = credential, home, credential.device_id
        self.coordinator_key = credential.coordinator_public_key
        self._on_body, self._hello_facts = on_body, hello_facts
        self.signer = Signer.load_or_create(home.signing_key)
        self._seq = int(time.time() * 1000)
        self.registered = threading.Event()
        if home.registered_with() == (self.coordinator_key, credential.token):
            self.registered.set()
        self.dropped_messages = 0
        self.last_error: str | None = None
        self.cannot_join: str | None = None  # why this device can never take part (its daemon then stops)
        self.login_refusals = 0  # the broker's consecutive refusals of this device's login
        self.stopping = False
        self.address = BrokerAddress.parse(broker or credential.broker, credential.broker_username,
                                           credential.broker_password)
        refuse_plaintext(self.address, credential, ca_file)
        if credential.ca_pem and ca_file is None:
            ca_file = str(home.write_ca(credential.ca_pem))
        self.client = make_client(f"ffr-edge-{self.device_id}", self.address, ca_file)
        self.client.on_connect = self._on_connect
        self.client.on_connect_fail = self._on_connect_fail
        self.client.on_disconnect = self._on_disconnect
        self.client.on_message = self._on_message
        self.broker_failures = 0
        self.downloads = ChunkDownloads(lambda t: self.client.subscribe(t, qos=1), self.client.unsubscribe,
                                        self.device_id)

    def start(self) -> None:
        self.client.connect_async(self.address.host, self.address.port, keepalive=30)
        self.client.loop_start()

    def stop(self) -> None:
        # disconnect first: the network thread then ends at once; stopping the loop first waits out its
        # select() timeout (0.7 s measured with paho 2, per device turn in a fleet)
        self.stopping = True
        self.client.disconnect()
        self.client.loop_stop()

    # sending ----------------------------------------------------------------
    def send(self, leaf: str, body) -> mqtt.MQTTMessageInfo:
        self._seq += 1
        return self.client.publish(topics.device(self.device_id, leaf),
                                   seal(self.device_id, self._seq, body, self.signer, to="coordinator"), qos=1)

    def hello(self) -> Hello:
        """Until the coordinator has registered this key, prove the admission token (never send it)."""
        proof = None if self.registered.is_set() else token_proof(self.credential.token, self.device_id,
                                                                   self.signer.public_hex)
        return Hello(public_key=self.signer.public_hex, token_proof=proof, **self._hello_facts())

    def send_update(self, header: UpdateHeader, data: bytes, chunk_bytes: int) -> None:
        self.send("update", header)
        for chunk in split(header.transfer_id, data, chunk_bytes):
            self.client.publish(topics.device(self.device_id, "update/chunks"), to_bytes(chunk), qos=1)

    def resend_pending(self) -> None:
        """After a reconnect, send again any update that was never acknowledged."""
        for header_path in sorted((self.home.root / "pending").glob("round*.json")):
            payload_path = header_path.with_suffix(".safetensors")
            try:
                saved = json.loads(header_path.read_text())
                header, chunk_bytes = UpdateHeader(**saved["header"]), int(saved["chunk_bytes"])
            except (ValueError, KeyError, TypeError) as exc:  # damaged: it cannot be resent, so it goes
                log.warning("%s: dropping the damaged pending update %s (%s)", self.device_id, header_path.name,
                            type(exc).__name__)
                header_path.unlink(missing_ok=True)
                payload_path.unlink(missing_ok=True)
                continue
            if payload_path.exists():
                log.info("%s: resuming the unacknowledged update of round %d", self.device_id, header.round_id)
                self.send_update(header, payload_path.read_bytes(), chunk_bytes)

    def drop_stale_pending(self, current_round: int) -> None:
        """An unacknowledged update of a round that has since closed can never be accepted."""
        for path in (self.home.root / "pending").glob("round*.*"):
            number = path.stem.removeprefix("round")
            if number.isdigit() and int(number) < current_round:  # a stranger's file in pending/ is left alone
                path.unlink(missing_ok=True)

    # paho's callbacks -------------------------------------------------------
    def _on_connect_fail(self, client: mqtt.Client, userdata) -> None:
        """The broker cannot be reached: said once per try, with paho's back-off (1 s doubling to 30 s) named."""
        self.broker_failures += 1
        delay = min(30, 2 ** (self.broker_failures - 1))
        log.warning("%s: waiting for the broker at %s (try %d failed; next in about %d s)", self.device_id,
                    self.address, self.broker_failures, delay)

    def _on_disconnect(self, client: mqtt.Client, userdata, flags, reason_code, properties) -> None:
        if not self.stopping:
            log.warning("%s: lost the broker at %s (%s); reconnecting", self.device_id, self.address, reason_code)

    def _on_connect(self, client: mqtt.Client, userdata, flags, reason_code, properties) -> None:
        if reason_code.is_failure:
            log.error("%s: broker refused the connection: %s", self.device_id, reason_code)
            if str(reason_code) in LOGIN_REFUSED:
                self.login_refusals += 1
                if self.login_refusals >= LOGIN_REFUSALS_TO_STOP:
                    self.cannot_join = (f"the broker at {self.address} refused this device's login "
                                        f"{self.login_refusals} times ({reason_code}): the credential's broker "
                                        "password is wrong or was revoked; ask the operator for a new credential "
                                        "(ffr coordinator admit)")
            return
        self.login_refusals = 0
        if self.broker_failures:
            log.info("%s: connected to the broker at %s after %d failed tries", self.device_id, self.address,
                     self.broker_failures)
            self.broker_failures = 0
        client.subscribe([(topics.device(self.device_id, "inbox"), 1), (topics.round_announcements(), 1)])
        if self.downloads.topic is not None:  # a download the broker's restart cut short: its chunks are retained
            client.subscribe(self.downloads.topic, qos=1)
        self.send("hello", self.hello())
        if self.registered.is_set():
            self.resend_pending()

    def _on_message(self, client: mqtt.Client, userdata, msg: mqtt.MQTTMessage) -> None:
        try:
            if msg.topic.startswith(f"{topics.PREFIX}/models/"):
                self.downloads.on_chunk(msg.payload)
                return
            if not msg.payload:
                return  # a cleared retained message
            envelope = open_envelope(msg.payload, self.coordinator_key)
            if envelope.sender != "coordinator" or envelope.to not in (None, self.device_id):
                raise MessageError(f"addressed from {envelope.sender!r} to {envelope.to!r}")
            if msg.topic.endswith("/inbox") and envelope.to != self.device_id:
                raise MessageError("an inbox message not addressed to this device")
            self._on_session(envelope.body)
        except (MessageError, PayloadError, ValueError) as exc:
            self.dropped_messages += 1
            log.warning("%s: dropping a message on %s that is not from the pinned coordinator or is invalid: %s",
                        self.device_id, msg.topic[:120], str(exc)[:200])
        except Exception:  # noqa: BLE001 - nothing on the network may kill paho's thread
            self.dropped_messages += 1
            log.exception("%s: error handling a message on %s", self.device_id, msg.topic[:120])

    def _on_session(self, body) -> None:
        """Admission and sequence numbers are the session's; everything else is the device's business."""
        if isinstance(body, Registered) and body.device_id == self.device_id:
            self.home.save_registration(self.coordinator_key, self.credential.token)
            if not self.registered.is_set():
                self.registered.set()
                log.info("%s: admitted by the coordinator", self.device_id)
                self.resend_pending()
        elif isinstance(body, Error) and body.code == "admission":  # the coordinator's signed word: no retry helps
            self.cannot_join = (f"the coordinator refuses this device's credential: {body.reason}; ask the operator "
                                "for a new one (ffr coordinator admit)")
            log.error("%s: %s", self.device_id, self.cannot_join)
        elif isinstance(body, Error):
            self.last_error = body.reason
            log.warning("%s: coordinator refused a message: %s", self.device_id, body.reason)
            if body.resume_seq is not None:
                self._seq = body.resume_seq  # the coordinator's word (signed): number on from there
                self.send("hello", self.hello())
        else:
            self._on_body(body)


def load_credential(credential: Credential | Path | str) -> Credential:
    return credential if isinstance(credential, Credential) else Credential.load(Path(credential))

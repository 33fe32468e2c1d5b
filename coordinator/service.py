"""`ffr coordinator serve`: the round engine wired to an MQTT broker and an HTTP server.

With no broker URL an embedded mosquitto is started, so one command runs everything; it
enforces per-device logins and topic ACLs, and keeps its port across restarts. The
coordinator's signing key and the HTTP API token are created in `--state` on first start.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import paho.mqtt.client as mqtt
import uvicorn

from coordinator.admission import Credential, admit, coordinator_signer
from coordinator.aggregation import strategy_for
from coordinator.broker import EmbeddedBroker, broker_file
from coordinator.broker_acl import BrokerUsers
from coordinator.engine import Engine, RoundSettings
from coordinator.inbound_queue import InboundQueue
from coordinator.quality_gate import GateSetup, QualityGate, stand_in_faces
from coordinator.store import Store
from protocol import topics
from protocol.auth import write_secret
from protocol.folder_lock import FolderHeld, hold
from protocol.transport import BrokerAddress, make_client

log = logging.getLogger("coordinator")
EXIT_GRACE_S = 60.0  # --exit-when-done: how long the devices get to take the final model


@dataclass
class ServiceConfig:
    state: Path
    broker: str | None = None
    username: str | None = None
    password: str | None = None
    ca_file: str | None = None
    http_host: str = "127.0.0.1"
    http_port: int = 8080
    init: str = "face"                 # round 0: the shipped face embedder, imagenet, or none (random)
    tick_seconds: float = 0.2
    keepalive_s: int = 30       # MQTT keepalive: the broker drops a client silent for 1.5 times this
    start_paused: bool = False  # rounds start only when the caller resumes the engine or opens one
    broker_acl: bool = True     # the embedded broker enforces per-device logins and ACLs
    tls: bool = False           # the embedded broker speaks TLS with a CA generated in STATE/tls
    public_set: Path | None = None  # FedFR's D_g, served at GET /public-set (coordinator.public_set)
    gate: GateSetup = field(default_factory=GateSetup)  # its faces (default: the public set), off or not, its bar

    def __post_init__(self) -> None:
        """What would fail only after the broker started, refused first."""
        if Path(self.state).exists() and not Path(self.state).is_dir():
            raise ValueError(f"--state {self.state} is a file; give a folder for the coordinator's state")
        if not 1 <= self.keepalive_s <= 65535:  # MQTT's two-byte field; 0 would switch keepalive off
            raise ValueError(f"--keepalive must be 1 to 65535 seconds (got {self.keepalive_s})")


def api_token(state: Path) -> tuple[str, bool]:
    """The HTTP API's bearer token (STATE/api-token, mode 0600), created on first start; (token, created)."""
    path = Path(state) / "api-token"
    if path.exists():
        return path.read_text().strip(), False
    token = secrets.token_urlsafe(32)
    write_secret(path, token)
    return token, True


class Service:
    """Owns the broker (when embedded), the MQTT client, the engine and its clock thread."""

    def __init__(self, config: ServiceConfig, settings: RoundSettings):
        self.config, self.settings = config, settings
        self._stop = threading.Event()
        Path(config.state).mkdir(parents=True, exist_ok=True)
        try:  # two coordinators on one state would fight over its store and its broker
            self._lock_fd = hold(Path(config.state) / "coordinator.lock")
        except FolderHeld as held:
            raise ValueError(f"--state {config.state} is in use by process {held.holder} (another `ffr coordinator "
                             "serve`, or a simulation); stop it first, or give another --state") from None
        self.broker, self.client = None, None
        try:
            self._start(config, settings)
        except BaseException:
            self._stop.set()  # a disconnect now is this stop, not an outage to log
            self._release()  # a coordinator that failed to start holds nothing: no broker, no socket, no lock
            raise

    def _start(self, config: ServiceConfig, settings: RoundSettings) -> None:
        """The broker (when embedded), the MQTT client, the engine and its clock."""
        self.signer = coordinator_signer(config.state)
        self.api_token, self.api_token_created = api_token(config.state)
        username, password = config.username, config.password
        if config.broker:
            BrokerAddress.parse(config.broker)  # a bad URL is refused before it is recorded for `admit`
            self.broker = None
            broker_file(config.state).write_text(json.dumps({"url": config.broker, "embedded": False, "acl": False}))
        else:
            if config.broker_acl:
                username, password = BrokerUsers(config.state).prepare()
            tls = None
            if config.tls:
                from coordinator.tls import ensure_broker_tls

                tls = ensure_broker_tls(config.state)
            self.broker = EmbeddedBroker(state_dir=config.state, acl=config.broker_acl, tls=tls)
        self.broker_url = config.broker or self.broker.url
        address = BrokerAddress.parse(self.broker_url, username, password)
        ca_file = config.ca_file or (str(Path(config.state) / "tls" / "ca.pem") if config.tls and not config.broker
                                     else None)
        self.client = make_client("ffr-coordinator", address, ca_file)  # with a login its id is the login
        self.client.on_connect = self._on_connect
        self.client.on_disconnect = self._on_disconnect
        self.client.manual_ack_set(True)  # a message is acknowledged once handled, off paho's thread
        self.disconnects, self.last_disconnect = 0, None
        try:  # before the store and the gate: nothing is written for a broker that is not there
            self.client.connect(address.host, address.port, keepalive=config.keepalive_s)
        except OSError as exc:  # refused, unknown host, unreachable: said in one line, not as a traceback
            raise ValueError(f"cannot reach the broker {self.broker_url} ({exc.strerror or exc}); start it first, "
                             "or leave out --broker to run the embedded one") from None
        strategy, store = strategy_for(settings), Store(config.state)  # a damaged store: refused before the gate's say
        self.gate = self._gate(settings.server_step)
        self.engine = Engine(store, strategy, settings, self._publish, self._initial_model, self.signer, gate=self.gate)
        if config.start_paused:
            self.engine.pause()
        self.inbound = InboundQueue(self.client, self.engine.on_message)  # the engine waits out a round there
        self.client.on_message = self.inbound.on_message
        self.client.loop_start()
        self._ticker = threading.Thread(target=self._tick_loop, name="coordinator-clock", daemon=True)
        self._ticker.start()
        log.info("coordinator: broker %s, state %s, method %s", self.broker_url, config.state,
                 settings.training.method.name)

    def _gate(self, server_step: float) -> QualityGate | None:
        """The quality gate on --gate-data, else on the public set, else on stand-in faces judging `server_step`
        only (`coordinator.quality_gate.stand_in_faces`); none with --no-gate."""
        faces = self.config.gate.data or self.config.public_set
        if self.config.gate.off:
            log.warning("quality gate off (--no-gate): a model that accepts impostors can be published")
            return None
        if faces is None:
            gate = QualityGate(stand_in_faces(Path(self.config.state)), self.config.gate.bar,
                               "stand-in faces", steps=(server_step,))
            log.warning("quality gate on %d SYNTHETIC stand-in faces: they catch a collapse or a drift of every "
                        "score, not one person pulled onto another; give the coordinator real faces (--gate-data "
                        "DIR or --public-set FILE)", len(gate.faces.images))
            return gate
        gate = QualityGate.from_path(Path(faces), self.config.gate.bar)
        log.info("quality gate: %d faces (%s) from %s", len(gate.faces.images),
                 "labelled" if gate.faces.labels is not None else "unlabelled", faces)
        return gate

    def admit(self, device_id: str, out: Path | None = None) -> Credential:
        """Admit a device (as `ffr coordinator admit` does); write its credential file when `out` is given."""
        credential = admit(self.config.state, device_id, self.broker_url)
        if out is not None:
            credential.save(out)
        return credential

    def record_evaluation(self, version: int, metrics: dict[str, float], source: str) -> None:
        """An operator's measurement of a released model, made elsewhere (the dashboard plots it)."""
        self.engine.store.record_evaluation(version, metrics, source)

    def mqtt_state(self) -> str:
        """'connected' only while paho's network thread is alive and connected to the broker."""
        thread = getattr(self.client, "_thread", None)
        alive = thread is not None and thread.is_alive()
        return "connected" if alive and self.client.is_connected() else "disconnected"

    def _initial_model(self):
        """Round 0's model. The face weights are read with safetensors + numpy: no torch on the coordinator."""
        t = self.settings.training
        if self.config.init == "face":
            from models.networks.face_weights import check_face_init, face_global_state

            check_face_init(t.model.width_mult, t.model.embedding_dim)
            return face_global_state()
        from models.networks.face_model import initial_global_state

        return initial_global_state(t.model.width_mult, t.model.embedding_dim, self.config.init)

    def _publish(self, topic: str, payload: bytes, retain: bool) -> None:
        self.client.publish(topic, payload, qos=1, retain=retain)

    def _on_connect(self, client: mqtt.Client, userdata, flags, reason_code, properties) -> None:
        if reason_code.is_failure:
            log.error("broker refused the connection: %s", reason_code)
            return
        self.inbound.on_connect()
        if self.disconnects:
            log.warning("reconnected to the broker %s", self.broker_url)
        client.subscribe(topics.all_device_messages(), qos=1)

    def _on_disconnect(self, client: mqtt.Client, userdata, flags, reason_code, properties) -> None:
        """Said in the log and in /health: a coordinator that cannot hear its devices must not be silent."""
        if self._stop.is_set():
            return
        self.last_disconnect = {"at": time.time(), "reason": str(reason_code)}
        log.error("disconnected from the broker %s (%s); reconnecting", self.broker_url, reason_code)
        self.disconnects += 1  # last: whoever sees the count sees the reason and the log line with it

    def broker_health(self) -> dict:
        return {"mqtt": self.mqtt_state(), "broker_disconnects": self.disconnects,
                "messages_waiting": self.inbound.waiting, "messages_dropped": self.inbound.dropped,
                "last_broker_disconnect": self.last_disconnect}

    def _tick_loop(self) -> None:
        while not self._stop.wait(self.config.tick_seconds):
            try:
                self.engine.tick()
            except Exception:  # noqa: BLE001 - the clock must keep running; the error is logged
                log.exception("round engine tick failed")

    @property
    def finished(self) -> bool:
        return self.engine.finished

    def awaiting_final_model(self) -> list[str]:
        """After the last round: devices heard from in this run that have not said they took the final model."""
        with self.engine.lock:
            return self.engine.sessions.awaiting(f"final v{self.engine.version}")

    def close(self) -> None:
        self._stop.set()
        self._ticker.join(timeout=5)
        self.client.loop_stop()
        self.inbound.stop()
        self._release()

    def _release(self) -> None:
        """The MQTT connection, the embedded broker and the state's lock, in that order; what was not started is
        skipped."""
        try:
            if self.client is not None:
                self.client.disconnect()
            if self.broker is not None:
                self.broker.close()
        finally:
            os.close(self._lock_fd)  # the state is free for the next coordinator


def serve(config: ServiceConfig, settings: RoundSettings, exit_when_done: bool = False, docs: bool = False,
          exit_grace_s: float = EXIT_GRACE_S) -> int:
    """Run until Ctrl-C or SIGTERM (or, with `exit_when_done`, until the last round is aggregated and the devices
    took the final model, `exit_grace_s` at most); either way the broker is stopped and the state flushed before
    returning."""
    from coordinator.api import create_app

    os.umask(0o077)  # every file the coordinator writes (models, updates, logs of rounds) is its user's alone
    previous = signal.signal(signal.SIGTERM, _interrupt)  # until uvicorn takes over: SIGTERM during start-up too
    service = None
    try:
        check_port_free(config.http_host, config.http_port)
        service = Service(config, settings)
        server = _Server(uvicorn_config(create_app(service, docs), config.http_host, config.http_port))
        if exit_when_done:
            threading.Thread(target=_exit_when_done, args=(service, server, exit_grace_s), daemon=True).start()
        _print_start(service, config, docs)
        server.run()
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        if service is not None:
            service.close()
            log.info("coordinator stopped: broker stopped, state saved in %s", config.state)
    return 0


def check_port_free(host: str, port: int, flag: str = "--http-port") -> None:
    """Refuse a taken HTTP port (`flag`) before the broker and the engine start: uvicorn would fail only after
    them, and in a thread (a fleet's dashboard) only in the log."""
    if port == 0:
        return
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT is no owner
            probe.bind((host, port))
    except (OSError, OverflowError) as exc:  # taken, not this machine's address, or not a port at all
        raise ValueError(f"{flag} {port} on {host} cannot be used ({getattr(exc, 'strerror', None) or exc}): "
                         f"another coordinator may hold it; choose another {flag}") from None


def _exit_when_done(service: Service, server, grace_s: float) -> None:
    """Stop the server after the last round, once every device heard from has taken the final model (an embedded
    broker goes with the coordinator: a device that had not fetched it by then could not), `grace_s` at most."""
    while not service.finished:
        time.sleep(0.5)
    deadline, missing = time.monotonic() + grace_s, service.awaiting_final_model()
    if missing:
        log.info("waiting up to %.0f s for %d device(s) to take the final model: %s", grace_s, len(missing),
                 _some(missing))
    while missing and time.monotonic() < deadline:
        time.sleep(0.5)
        missing = service.awaiting_final_model()
    if missing:
        log.warning("stopping before %d device(s) took the final model (%s): they fetch it from a coordinator that "
                    "serves it again", len(missing), _some(missing))
    server.should_exit = True


def _some(names: list[str], shown: int = 5) -> str:
    return ", ".join(names[:shown]) + (", ..." if len(names) > shown else "")


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


NO_PUBLIC_SET = ("no public set (--public-set): devices get no strangers' faces, so each calibrates its door on its "
                 "own people only and verifies with the global model, never its personalised one; pack faces of "
                 "nobody's people with `ffr edge public-set --data FACES --out FILE`")


def _print_start(service: Service, config: ServiceConfig, docs: bool) -> None:
    """What an operator needs once everything started: the addresses, the key devices pin, where the API token is,
    and what serving no public set costs (said once the settings were accepted, never above a refusal)."""
    base = f"http://{config.http_host}:{config.http_port}"
    if config.public_set is None:
        print(NO_PUBLIC_SET, flush=True)
    print(f"coordinator: broker {service.broker_url}, HTTP {base}, dashboard {base}/dashboard"
          + (f", API docs {base}/docs" if docs else ""), flush=True)
    print(f"coordinator public key (devices pin it): {service.signer.public_hex}", flush=True)
    token_file = Path(config.state) / "api-token"
    if service.api_token_created and sys.stdout.isatty():  # a terminal, never a log file
        print(f"HTTP API token (shown once; kept in {token_file}): {service.api_token}", flush=True)
    else:
        print(f"HTTP API token: in {token_file} (mode 0600)", flush=True)


def uvicorn_config(app, host: str, port: int) -> uvicorn.Config:
    return uvicorn.Config(app, host=host, port=port, log_level="warning")


class _Server(uvicorn.Server):
    """uvicorn that ends on SIGINT/SIGTERM without raising the signal again afterwards (uvicorn >= 0.29 does, which
    killed the process before `serve` stopped the broker, and left mosquitto running)."""

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

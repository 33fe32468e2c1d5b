"""`ffr coordinator serve`: the round engine wired to an MQTT broker and an HTTP server.

With no broker URL an embedded mosquitto is started, so one command runs everything.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path

import paho.mqtt.client as mqtt

from coordinator.aggregation import make_strategy
from coordinator.broker import EmbeddedBroker
from coordinator.engine import Engine, RoundSettings
from coordinator.store import Store
from protocol import topics
from protocol.transport import BrokerAddress, make_client

log = logging.getLogger("coordinator")


@dataclass
class ServiceConfig:
    state: Path
    broker: str | None = None
    username: str | None = None
    password: str | None = None
    ca_file: str | None = None
    http_host: str = "127.0.0.1"
    http_port: int = 8080
    strategy: str = "fedavg"
    prox_mu: float = 0.01
    server_momentum: float = 0.9
    init: str = "face"                 # round 0: the shipped face embedder, imagenet, or none (random)
    tick_seconds: float = 0.2
    start_paused: bool = False  # rounds start only when the caller sets engine.running (the fleet simulator)


class Service:
    """Owns the broker (when embedded), the MQTT client, the engine and its clock thread."""

    def __init__(self, config: ServiceConfig, settings: RoundSettings):
        self.config, self.settings = config, settings
        self.broker = None if config.broker else EmbeddedBroker()
        self.broker_url = config.broker or self.broker.url
        address = BrokerAddress.parse(self.broker_url, config.username, config.password)
        self.client = make_client("ffr-coordinator", address, config.ca_file)
        self.client.on_connect = self._on_connect
        self.client.on_message = lambda c, u, msg: self.engine.on_message(msg.topic, msg.payload)
        options = {"mu": config.prox_mu} if config.strategy == "fedprox" else \
            {"momentum": config.server_momentum} if config.strategy == "fedavgm" else {}
        strategy = make_strategy(config.strategy, **options)
        self.engine = Engine(Store(config.state), strategy, settings, self._publish, self._initial_model)
        self.engine.running = not config.start_paused
        self._stop = threading.Event()
        self.client.connect(address.host, address.port, keepalive=30)
        self.client.loop_start()
        self._ticker = threading.Thread(target=self._tick_loop, name="coordinator-clock", daemon=True)
        self._ticker.start()
        log.info("coordinator: broker %s, state %s, strategy %s", self.broker_url, config.state, config.strategy)

    def _initial_model(self):
        """Round 0's model. The face weights are read with safetensors + numpy: no torch on the coordinator."""
        t = self.settings.training
        if self.config.init == "face":
            from models.face_weights import check_face_init, face_global_state

            check_face_init(t.width_mult, t.embedding_dim)
            return face_global_state()
        from models.face_model import initial_global_state

        return initial_global_state(t.width_mult, t.embedding_dim, self.config.init)

    def _publish(self, topic: str, payload: bytes, retain: bool) -> None:
        self.client.publish(topic, payload, qos=1, retain=retain)

    def _on_connect(self, client: mqtt.Client, userdata, flags, reason_code, properties) -> None:
        if reason_code.is_failure:
            log.error("broker refused the connection: %s", reason_code)
            return
        client.subscribe(topics.all_device_messages(), qos=1)

    def _tick_loop(self) -> None:
        while not self._stop.wait(self.config.tick_seconds):
            try:
                self.engine.tick()
            except Exception:  # noqa: BLE001 - the clock must keep running; the error is logged
                log.exception("round engine tick failed")

    @property
    def finished(self) -> bool:
        return self.engine.store.completed_rounds() >= self.settings.rounds and self.engine.current is None

    def close(self) -> None:
        self._stop.set()
        self._ticker.join(timeout=5)
        self.client.loop_stop()
        self.client.disconnect()
        if self.broker is not None:
            self.broker.close()


def serve(config: ServiceConfig, settings: RoundSettings, exit_when_done: bool = False) -> int:
    """Run until Ctrl-C (or, with `exit_when_done`, until the last round is aggregated)."""
    import uvicorn

    from coordinator.api import create_app

    service = Service(config, settings)
    server = uvicorn.Server(uvicorn.Config(create_app(service.engine), host=config.http_host, port=config.http_port,
                                           log_level="warning"))
    if exit_when_done:
        def watch() -> None:
            while not service.finished:
                threading.Event().wait(0.5)
            server.should_exit = True
        threading.Thread(target=watch, daemon=True).start()
    print(f"coordinator: broker {service.broker_url}, HTTP http://{config.http_host}:{config.http_port}/docs", flush=True)
    try:
        server.run()
    finally:
        service.close()
    return 0

"""The embedded broker binds client ids to logins and caps messages: attacks by an admitted device, over a real
Mosquitto with the coordinator's generated logins and ACLs."""
from __future__ import annotations

import threading
import time

import paho.mqtt.client as mqtt

from coordinator.engine import RoundSettings
from protocol import topics
from protocol.messages import TrainingConfig
from protocol.transport import BrokerAddress


def _service(tmp_path, **config):
    from coordinator.service import Service, ServiceConfig

    return Service(ServiceConfig(state=tmp_path / "state", init="none", **config),
                   RoundSettings(rounds=1, min_clients=5, training=TrainingConfig(width_mult=0.25)))


# the longest any wait may last, in seconds: each returns as soon as its event comes, so a loaded machine waits
# longer instead of failing
WAIT = 60


def _raw_client(service, credential, client_id: str) -> tuple[mqtt.Client, threading.Event, list]:
    """paho with exactly the client id given (make_client would use the login), and its disconnect reasons."""
    address = BrokerAddress.parse(service.broker_url)
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id)
    client.username_pw_set(credential.broker_username, credential.broker_password)
    connected, reasons = threading.Event(), []
    client.on_connect = lambda c, u, f, rc, p: connected.set() if not rc.is_failure else None
    client.on_disconnect = lambda c, u, f, rc, p: reasons.append(str(rc))
    client.connect(address.host, address.port)
    client.loop_start()
    return client, connected, reasons


def _mallory(service) -> tuple[mqtt.Client, list]:
    """An admitted device, connected under its own login and id; its client and disconnect reasons."""
    client, connected, reasons = _raw_client(service, service.admit("mallory"), "mallory")
    assert connected.wait(WAIT)
    return client, reasons


def test_a_device_cannot_take_over_the_coordinators_session(tmp_path):
    service = _service(tmp_path)
    try:
        mallory = service.admit("mallory")
        states, stop = [], time.monotonic() + 6
        attackers = []
        while time.monotonic() < stop:  # log in again and again under the coordinator's client ids
            for client_id in ("coordinator", "ffr-coordinator"):
                client, connected, _ = _raw_client(service, mallory, client_id)
                assert connected.wait(WAIT), "the attacker's own login works (the test is not vacuous)"
                attackers.append(client)
            for _ in range(5):
                states.append(service.mqtt_state())
                time.sleep(0.1)
        assert set(states) == {"connected"} and service.disconnects == 0
        assert service.broker_health()["broker_disconnects"] == 0
        # the coordinator still hears devices: a real device registers after the attack
        from edge_client.daemon import EdgeDevice
        from models.faces.synthetic import write_dataset

        credential = tmp_path / "alice.json"
        service.admit("alice", credential)
        data = write_dataset(tmp_path / "faces", 2, 2, seed=1)
        device = EdgeDevice(credential, data, tmp_path / "home", export_onnx=False)
        device.start()
        try:
            assert device.registered.wait(2 * WAIT) and "alice" in service.engine.keys
        finally:
            device.stop()
        for client in attackers:
            client.loop_stop()
            client.disconnect()
    finally:
        service.close()


def test_a_message_above_the_protocols_largest_is_refused_by_the_broker(tmp_path):
    from coordinator.broker import MAX_MESSAGE_BYTES

    service = _service(tmp_path)
    try:
        client, reasons = _mallory(service)
        handled = service.engine.handled
        client.publish(topics.device("mallory", "heartbeat"), b"x" * 1024, qos=1).wait_for_publish(WAIT)
        deadline = time.monotonic() + WAIT
        while service.engine.handled == handled and time.monotonic() < deadline:
            time.sleep(0.05)
        assert service.engine.handled == handled + 1, "a small message gets through (the test is not vacuous)"
        client.publish(topics.device("mallory", "heartbeat"), b"x" * (MAX_MESSAGE_BYTES + 200_000), qos=1)
        deadline = time.monotonic() + WAIT
        while not reasons and time.monotonic() < deadline:
            time.sleep(0.05)
        assert reasons, "the broker disconnects a client that sends an oversized packet"
        time.sleep(0.5)
        assert service.engine.handled == handled + 1 and service.mqtt_state() == "connected"
        client.loop_stop()
    finally:
        service.close()


def test_coordinator_disconnect_is_logged_and_shown_in_health(tmp_path, caplog):
    service = _service(tmp_path)
    try:
        deadline = time.monotonic() + WAIT
        while service.mqtt_state() != "connected" and time.monotonic() < deadline:
            time.sleep(0.05)
        service.broker.process.kill()  # the broker dies under the coordinator
        service.broker.process.wait(WAIT)
        deadline = time.monotonic() + WAIT
        while service.disconnects == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        health = service.broker_health()
        assert health["mqtt"] == "disconnected" and health["broker_disconnects"] >= 1
        assert health["last_broker_disconnect"]["reason"]
        assert any("disconnected from the broker" in r.getMessage() for r in caplog.records)
    finally:
        service.close()


def test_the_coordinator_keeps_its_connection_while_a_round_holds_the_engine(tmp_path):
    """A round's aggregation and quality gate hold the engine's lock for minutes on a loaded machine. A device's
    message arriving meanwhile used to block paho's network thread on that lock: it read nothing more, sent no
    keepalive ping, and the broker dropped the coordinator. Here, with the lock held and device messages waiting for
    it, the network thread still completes a round trip to the broker (a QoS-1 publish acknowledged; with the old
    handler this never completes, whatever the machine's speed), and every message is handled, in order, once the
    lock is free."""
    service = _service(tmp_path)
    try:
        client, _ = _mallory(service)
        handled = service.engine.handled
        with service.engine.lock:  # what a long aggregation does
            for _ in range(5):
                client.publish(topics.device("mallory", "heartbeat"), b"not a message", qos=1).wait_for_publish(WAIT)
            deadline = time.monotonic() + WAIT
            while service.inbound.received < 5 and time.monotonic() < deadline:  # all five reached the coordinator
                time.sleep(0.05)
            probe = service.client.publish("ffr/v1/probe", b"x", qos=1)
            probe.wait_for_publish(WAIT)
            assert probe.is_published(), "paho's network thread is blocked: the broker's ack was never read"
            assert service.engine.handled == handled and service.broker_health()["messages_waiting"] == 5
            assert service.disconnects == 0 and service.mqtt_state() == "connected"
        deadline = time.monotonic() + WAIT
        while service.engine.handled < handled + 5 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert service.engine.handled == handled + 5 and service.disconnects == 0
        assert service.engine.rejected >= 5, "each message reached the engine (and was refused as malformed)"
        client.loop_stop()
    finally:
        service.close()


def test_a_flood_of_qos0_messages_during_a_round_is_bounded_and_counted(tmp_path):
    """QoS-0 messages have no broker window to hold them back while the engine is busy: beyond a bound they are
    dropped and counted, so a device cannot fill the coordinator's memory while a round aggregates."""
    from coordinator.inbound_queue import MAX_UNACKED

    service = _service(tmp_path)
    try:
        client, _ = _mallory(service)
        flood = MAX_UNACKED + 200
        with service.engine.lock:
            for _ in range(flood):
                client.publish(topics.device("mallory", "heartbeat"), b"x", qos=0)
            deadline = time.monotonic() + WAIT
            while service.inbound.received + service.inbound.dropped < flood and time.monotonic() < deadline:
                time.sleep(0.05)
            health = service.broker_health()
            assert health["messages_dropped"] == 200 and health["messages_waiting"] == MAX_UNACKED
            assert health["mqtt"] == "connected"
        client.loop_stop()
    finally:
        service.close()

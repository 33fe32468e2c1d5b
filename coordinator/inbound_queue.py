"""Messages from the broker, handled off paho's network thread and acknowledged once handled.

Why: the engine holds its lock through a round's aggregation and quality gate, minutes on a loaded machine. A
handler that waited for that lock on paho's thread stopped the connection's keepalive pings, and the broker dropped
the coordinator ("Unspecified error") at the end of a round, losing what devices said meanwhile. Here the network
thread only enqueues; one worker thread hands the messages to the engine in arrival order.

Memory stays bounded by the broker, not by the senders: QoS-1 messages are acknowledged (paho's manual ack) only
after they are handled, so once the broker's in-flight window to the coordinator is full (`max_inflight_messages`)
it holds the rest back in its own bounded per-client queue. QoS-0 messages have no window (no protocol message is
sent that way); beyond `MAX_UNACKED` waiting they are dropped and counted.
"""
from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

import paho.mqtt.client as mqtt

log = logging.getLogger("coordinator")
MAX_UNACKED = 1000  # QoS-0 messages waiting beyond this are dropped (QoS-1 ones are bounded by the broker's window)


class InboundQueue:
    """Route paho's `on_message` here (`client.on_message = queue.on_message`) after `manual_ack_set(True)`; the
    `handle(topic, payload)` given must not raise (the engine's `on_message` guards itself)."""

    def __init__(self, client: mqtt.Client, handle: Callable[[str, bytes], None]):
        self.client, self.handle = client, handle
        self.dropped = 0
        self.received = self.handled = 0  # each written by one thread only (paho's, the worker's)
        self.connection = 0  # bumped on every (re)connect: an ack is valid only on the connection it came on
        self._messages: queue.Queue = queue.Queue()
        self._worker = threading.Thread(target=self._work, name="coordinator-messages", daemon=True)
        self._worker.start()

    def on_connect(self) -> None:
        """A new connection (clean session): acks still owed belong to the old one and are not sent."""
        self.connection += 1

    def on_message(self, client: mqtt.Client, userdata, msg: mqtt.MQTTMessage) -> None:
        """paho's network thread: enqueue and return at once."""
        if msg.qos == 0 and self.waiting >= MAX_UNACKED:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                log.warning("dropped %d QoS-0 message(s) on %s: too many waiting", self.dropped, msg.topic[:160])
            return
        self.received += 1
        self._messages.put((msg.topic, msg.payload, msg.qos, msg.mid, self.connection))

    @property
    def waiting(self) -> int:
        """Received and not yet handled (the one in the engine's hands included)."""
        return self.received - self.handled

    def stop(self, timeout: float = 5.0) -> None:
        """Handle what already waits, then stop (`timeout` seconds at most: the rest is dropped unacknowledged, as
        a coordinator stopping would; devices resend an update the coordinator never acknowledged)."""
        self._messages.put(None)
        self._worker.join(timeout)

    def _work(self) -> None:
        while (item := self._messages.get()) is not None:
            topic, payload, qos, mid, connection = item
            try:
                self.handle(topic, payload)
            except Exception:  # noqa: BLE001 - the last line before the worker: one message, never the thread
                log.exception("message handler failed on %s", topic[:160])
            self.handled += 1
            if qos > 0 and connection == self.connection:
                self.client.ack(mid, qos)

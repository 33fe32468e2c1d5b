"""MQTT connections for both sides (paho-mqtt 2.x): URL parsing, credentials, TLS, reconnect backoff."""
from __future__ import annotations

import ssl
import uuid
from dataclasses import dataclass
from urllib.parse import urlparse

import paho.mqtt.client as mqtt


@dataclass(frozen=True)
class BrokerAddress:
    host: str
    port: int
    tls: bool = False
    username: str | None = None
    password: str | None = None

    @classmethod
    def parse(cls, url: str, username: str | None = None, password: str | None = None) -> BrokerAddress:
        """`mqtt://host:1883` or `mqtts://host:8883` (credentials may also sit in the URL)."""
        parsed = urlparse(url if "://" in url else f"mqtt://{url}")
        if parsed.scheme not in ("mqtt", "mqtts", "tcp", "ssl"):
            raise ValueError(f"unsupported broker URL scheme {parsed.scheme!r}; use mqtt://HOST:PORT or mqtts://HOST:PORT")
        if not parsed.hostname:
            raise ValueError(f"broker URL {url!r} has no host")
        try:
            port = parsed.port
        except ValueError:  # urllib's "Port out of range 0-65535" or a port that is not a number
            port = -1
        if port is not None and not 1 <= port <= 65535:
            raise ValueError(f"broker URL {url!r} has no valid port (1-65535)")
        tls = parsed.scheme in ("mqtts", "ssl")
        return cls(parsed.hostname, port or (8883 if tls else 1883), tls,
                   username or parsed.username, password or parsed.password)

    def __str__(self) -> str:
        return f"{'mqtts' if self.tls else 'mqtt'}://{self.host}:{self.port}"


def make_client(client_id: str | None, address: BrokerAddress, ca_file: str | None = None) -> mqtt.Client:
    """A client that reconnects by itself, backing off from 1 s to 30 s. With a login its client id is the login:
    brokers that bind ids to logins (`use_username_as_clientid`) then see the id they assign anyway."""
    client_id = address.username or client_id or f"ffr-{uuid.uuid4().hex[:8]}"
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, clean_session=True)
    if address.username:
        client.username_pw_set(address.username, address.password)
    if address.tls:
        client.tls_set(ca_certs=ca_file, cert_reqs=ssl.CERT_REQUIRED)
    client.reconnect_delay_set(min_delay=1, max_delay=30)
    client.max_inflight_messages_set(100)
    client.max_queued_messages_set(0)
    return client

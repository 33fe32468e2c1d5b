"""An embedded MQTT broker for one-command setups: a `mosquitto` child process on localhost."""
from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

MOSQUITTO_PATHS = ("mosquitto", "/usr/sbin/mosquitto", "/usr/local/sbin/mosquitto")


def find_mosquitto() -> str | None:
    return next((p for p in (shutil.which(c) or (c if Path(c).is_file() else None) for c in MOSQUITTO_PATHS) if p), None)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EmbeddedBroker:
    """Mosquitto bound to 127.0.0.1 on a free (or given) port; stopped with `close()`."""

    def __init__(self, port: int | None = None, message_size_limit: int = 0):
        binary = find_mosquitto()
        if binary is None:
            raise RuntimeError("no mosquitto binary for the embedded broker: install it (apt-get install mosquitto) "
                               "or point at a broker with --broker mqtt://HOST:PORT")
        self.port = port or free_port()
        self._dir = tempfile.TemporaryDirectory(prefix="ffr-broker-")
        conf = Path(self._dir.name) / "mosquitto.conf"
        lines = [f"listener {self.port} 127.0.0.1", "allow_anonymous true", "persistence false",
                 "max_queued_messages 100000", "log_dest stderr", "log_type error"]
        if message_size_limit:
            lines.append(f"message_size_limit {message_size_limit}")
        conf.write_text("\n".join(lines) + "\n")
        self.process = subprocess.Popen([binary, "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self._wait_ready()

    @property
    def url(self) -> str:
        return f"mqtt://127.0.0.1:{self.port}"

    def _wait_ready(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"mosquitto exited: {self.process.stderr.read().decode(errors='replace')}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.05)
        self.close()
        raise RuntimeError(f"mosquitto did not open port {self.port} within {timeout:.0f} s")

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self._dir.cleanup()

    def __enter__(self) -> "EmbeddedBroker":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

"""An embedded MQTT broker for one-command setups: a `mosquitto` child process on localhost.

Given the coordinator's state folder, the broker keeps its port and a pid file there, so a
coordinator restarted after `kill -9` stops the orphaned broker and comes back on the same
port (devices reconnect by themselves), and it enforces the logins and ACLs that
`coordinator.broker_acl` writes. With logins on, each client's id is its login
(`use_username_as_clientid`), so no device can take over another's session, the coordinator's
included; an external broker should be set up the same way (README). Every message is capped just
above the protocol's largest, and every client's queue is bounded.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from protocol.json_file import read_json
from protocol.messages import MAX_CHUNK_BYTES


def broker_file(state: str | Path) -> Path:
    """Where a coordinator records the broker it serves on (its URL, port, whether logins are enforced)."""
    return Path(state) / "broker.json"


def broker_record(state: str | Path) -> dict:
    """The recorded broker, {} when none was; a damaged record is named in one line (it is read back by `admit`,
    the ACL and the next start)."""
    path = broker_file(state)
    if not path.exists():
        return {}
    return read_json(path, "ffr-edge", "delete it and start `ffr coordinator serve` once, which records the broker "
                     "again")


MOSQUITTO_PATHS = ("mosquitto", "/usr/sbin/mosquitto", "/usr/local/sbin/mosquitto")
MAX_MESSAGE_BYTES = MAX_CHUNK_BYTES + 64 * 1024  # the largest chunk frame the protocol allows, with its header
PACKET_OVERHEAD = 64 * 1024                       # topic and MQTT headers on top of the payload
MAX_QUEUED_MESSAGES = 20_000
MAX_QUEUED_BYTES = 256 * 1024 * 1024
MAX_INFLIGHT = 100


def find_mosquitto() -> str | None:
    return next(
        (p for p in (shutil.which(c) or (c if Path(c).is_file() else None) for c in MOSQUITTO_PATHS) if p), None
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EmbeddedBroker:
    """Mosquitto bound to 127.0.0.1 on a free (or given, or persisted) port; stopped with `close()`."""

    def __init__(self, port: int | None = None, message_size_limit: int = 0, state_dir: Path | None = None,
                 acl: bool = False, tls: dict[str, Path] | None = None):
        binary = find_mosquitto()
        if binary is None:
            raise RuntimeError("no mosquitto binary for the embedded broker: install it (apt-get install mosquitto) "
                               "or point at a broker with --broker mqtt://HOST:PORT")
        self._tmp = None if state_dir else tempfile.TemporaryDirectory(prefix="ffr-broker-")
        self.dir = Path(state_dir) / "broker" if state_dir else Path(self._tmp.name)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.pid_file = self.dir / "mosquitto.pid"
        _stop_orphan(self.pid_file)
        record = broker_file(state_dir) if state_dir else None
        remembered = broker_record(state_dir).get("port") if state_dir else None
        self.port = port or remembered or free_port()
        conf = self.dir / "mosquitto.conf"
        import getpass

        # stay the coordinator's user (mosquitto started as root would switch to `mosquitto` and lose the 0600 files)
        lines = [f"listener {self.port} 127.0.0.1", f"user {getpass.getuser()}", "persistence false",
                 # per client: a slow or silent subscriber cannot make the broker hold unbounded data
                 f"max_queued_messages {MAX_QUEUED_MESSAGES}", f"max_queued_bytes {MAX_QUEUED_BYTES}",
                 f"max_inflight_messages {MAX_INFLIGHT}", "log_dest stderr", "log_type error"]
        self.tls = tls is not None
        if tls:
            lines += [f"cafile {tls['ca']}", f"certfile {tls['cert']}", f"keyfile {tls['key']}",
                      "tls_version tlsv1.2"]
        if acl:  # a client's id is its login: no one can take over another's session (the coordinator's included)
            lines += ["allow_anonymous false", f"password_file {self.dir / 'passwd'}", f"acl_file {self.dir / 'acl'}",
                      "use_username_as_clientid true"]
        else:
            lines.append("allow_anonymous true")
        # a packet above the protocol's largest message disconnects its sender before its payload is read
        limit = message_size_limit or MAX_MESSAGE_BYTES
        lines += [f"message_size_limit {limit}", f"max_packet_size {limit + PACKET_OVERHEAD}"]
        conf.write_text("\n".join(lines) + "\n")
        self.process = subprocess.Popen([binary, "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.pid_file.write_text(str(self.process.pid))
        self._wait_ready()
        if record:
            record.write_text(json.dumps({"url": self.url, "port": self.port, "embedded": True, "acl": acl,
                                          "tls": self.tls}))

    @property
    def url(self) -> str:
        return f"{'mqtts' if self.tls else 'mqtt'}://127.0.0.1:{self.port}"

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
        self.pid_file.unlink(missing_ok=True)
        if self._tmp is not None:
            self._tmp.cleanup()

    def __enter__(self) -> EmbeddedBroker:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _stop_orphan(pid_file: Path) -> None:
    """Stop a mosquitto left running by a coordinator that was killed (only if it is still mosquitto)."""
    try:
        pid = int(pid_file.read_text())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, ValueError):
        return
    if b"mosquitto" not in cmdline:
        return
    os.kill(pid, signal.SIGTERM)
    for _ in range(50):
        if not Path(f"/proc/{pid}").exists():
            break
        time.sleep(0.1)
    else:
        os.kill(pid, signal.SIGKILL)

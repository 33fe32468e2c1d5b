"""The coordinator's HTTP front door and process hygiene, against a real uvicorn and a real `ffr coordinator serve`."""
from __future__ import annotations

import json
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from test_federated import wait_for

from coordinator.broker import free_port
from coordinator.engine import RoundSettings
from protocol.messages import TrainingConfig

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def live(tmp_path):
    import uvicorn

    from coordinator.api import create_app
    from coordinator.service import Service, ServiceConfig

    port = free_port()
    service = Service(ServiceConfig(state=tmp_path / "state", http_port=port, init="none"),
                      RoundSettings(rounds=1, min_clients=5, training=TrainingConfig(width_mult=0.25)))
    server = uvicorn.Server(uvicorn.Config(create_app(service), host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    yield service, port
    server.should_exit = True
    service.close()


def _raw(port: int, head: str, body: bytes = b"", timeout: float = 3.0) -> str:
    """Send a request's head (and only `body` of it), then read the status line: the server must answer
    without waiting for the rest of a body it was promised."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(head.encode() + body)
        return s.recv(4096).decode(errors="replace").split("\r\n")[0]


def _status(port: int, path: str, body: bytes | None = None, headers: dict | None = None) -> int:
    import urllib.error
    import urllib.request

    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=body, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_token_is_checked_before_a_body_is_read(live):
    service, port = live
    head = (
        "POST /evaluations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 200000000\r\n\r\n"
    )
    assert " 401 " in _raw(port, head)  # answered at once, not after 200 MB


def test_bodies_are_capped_even_with_the_token(live):
    service, port = live
    auth = f"Authorization: Bearer {service.api_token}\r\n"
    head = (f"POST /evaluations HTTP/1.1\r\nHost: x\r\n{auth}Content-Type: application/json\r\n"
            "Content-Length: 200000000\r\n\r\n")
    assert " 413 " in _raw(port, head)
    chunked = (f"POST /evaluations HTTP/1.1\r\nHost: x\r\n{auth}Content-Type: application/json\r\n"
               "Transfer-Encoding: chunked\r\n\r\n")
    piece = b"x" * 32768
    body = b"".join(b"%x\r\n" % len(piece) + piece + b"\r\n" for _ in range(4))  # 128 KiB, no length given
    assert " 413 " in _raw(port, chunked, body)
    body = json.dumps({"model_version": 0, "metrics": {"auc": 0.9}, "source": "test"}).encode()
    assert _status(port, "/evaluations", body, {"Authorization": f"Bearer {service.api_token}",
                                                "Content-Type": "application/json"}) == 200  # small bodies still work


def test_api_docs_are_off_unless_asked_for(live):
    service, port = live
    for path in ("/docs", "/openapi.json", "/redoc"):
        assert _status(port, path) == 404
    assert _status(port, "/health") == 200


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def _mosquitto_running(pid: int) -> bool:
    try:
        return b"mosquitto" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_serve_stops_cleanly_on_a_signal_and_keeps_its_secrets(tmp_path, sig):
    state, port = tmp_path / "state", free_port()
    serve = [sys.executable, "-m", "ffr.cli", "coordinator", "serve", "--init", "none", "--width-mult", "0.25"]
    process = subprocess.Popen([*serve, "--state", str(state), "--http-port", str(port)],
                               cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(process.stdout), daemon=True)
    reader.start()
    deadline = time.monotonic() + 90
    while not any(line.startswith("HTTP API token") for line in lines) and time.monotonic() < deadline:
        time.sleep(0.1)
    wait_for(lambda: _listening(port), 60, "uvicorn to listen on its port")  # not a fixed sleep: load makes it slow
    broker_pid = int((state / "broker" / "mosquitto.pid").read_text())
    assert _mosquitto_running(broker_pid)
    # a second coordinator on its state, or on its port, is refused in one line before starting anything
    for where, says in ((["--state", str(state), "--http-port", str(free_port())], f"in use by process {process.pid}"),
                        (["--state", str(tmp_path / "other"), "--http-port", str(port)], "cannot be used")):
        second = subprocess.run([*serve, *where], cwd=REPO, capture_output=True, text=True, timeout=60)
        assert second.returncode == 2 and says in second.stderr and second.stderr.count("\n") == 1, second.stderr
    assert not (tmp_path / "other").exists()
    process.send_signal(sig)
    process.wait(30)
    reader.join(5)
    out = "".join(lines)
    assert process.returncode == 0, out
    assert "Traceback" not in out
    wait_for(lambda: not _mosquitto_running(broker_pid), 60, "the embedded broker to stop (was it left running?)")
    token = (state / "api-token").read_text().strip()
    assert token not in out, "the API token was printed into a log"
    assert stat.S_IMODE(state.stat().st_mode) == 0o700
    for path in [p for p in state.rglob("*") if p.is_file()]:
        assert stat.S_IMODE(path.stat().st_mode) & 0o077 == 0, f"{path} is readable by others"
    assert (state / "coordinator.sqlite").exists()


@pytest.mark.parametrize("option, value, says", [
    ("--min-clients", "0", "--min-clients must be at least 1"), ("--fraction", "2", "--fraction must be in (0, 1]"),
    ("--rounds", "0", "--rounds must be at least 1"), ("--lr", "-1", "--lr must be positive"),
    ("--round-timeout", "0", "--round-timeout must be positive"),
    ("--http-port", "99999", "argument --http-port: 99999 is not a port (0-65535"),  # refused by the parser:
    ("--rounds", "x", "argument --rounds: invalid int value: 'x' (see ffr coordinator serve --help)"),  # one line
    ("--broker", "mqtt://127.0.0.1:99999", "broker URL 'mqtt://127.0.0.1:99999' has no valid port (1-65535)"),
    ("--broker", "mqtt://127.0.0.1:1", "cannot reach the broker mqtt://127.0.0.1:1 (Connection refused)")])
def test_serve_refuses_settings_that_cannot_work_in_one_line(tmp_path, option, value, says):
    process = subprocess.run([sys.executable, "-m", "ffr.cli", "coordinator", "serve", "--state", str(tmp_path / "s"),
                              "--http-port", str(free_port()), option, value],
                             cwd=REPO, capture_output=True, text=True, timeout=120)
    assert process.returncode == 2 and process.stdout == ""
    assert process.stderr.startswith(f"ffr coordinator serve: error: {says}") and process.stderr.count("\n") == 1
    assert not (tmp_path / "s" / "coordinator.sqlite").exists()  # refused before anything was started or stored


def test_a_state_path_that_is_a_file_is_refused_before_anything_starts(tmp_path):
    state = tmp_path / "state"
    state.write_text("not a folder")
    process = subprocess.run([sys.executable, "-m", "ffr.cli", "coordinator", "serve", "--state", str(state),
                              "--http-port", str(free_port())], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert process.returncode == 2 and process.stderr.count("\n") == 1, process.stderr
    assert f"--state {state} is a file" in process.stderr and state.read_text() == "not a folder"


def test_exit_when_done_waits_for_the_final_model_and_no_longer_than_its_grace(caplog):
    """The waiting alone, with a stand-in for the service's two queries: a real coordinator would need a device
    that vanishes after the last round. Which devices count is tested on the real engine (tests/test_trust.py)."""
    import logging
    from types import SimpleNamespace

    from coordinator.service import _exit_when_done

    class Fleet:
        finished = True

        def __init__(self, answers: list[list[str]]):
            self.answers, self.asked = answers, 0

        def awaiting_final_model(self) -> list[str]:
            self.asked += 1
            return self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]

    caplog.set_level(logging.INFO, logger="coordinator")
    server, fleet = SimpleNamespace(should_exit=False), Fleet([["d1", "d2"], ["d2"], []])
    _exit_when_done(fleet, server, grace_s=30)
    assert server.should_exit and fleet.asked == 3  # stopped when the last device took it, not at the grace's end
    assert "waiting up to 30 s for 2 device(s)" in caplog.text and "stopping before" not in caplog.text
    server, fleet = SimpleNamespace(should_exit=False), Fleet([["gone"]])
    _exit_when_done(fleet, server, grace_s=1)
    assert server.should_exit and fleet.asked <= 1 + 1 / 0.5 + 1  # the grace's polls at most (fewer on a slow machine)
    assert "stopping before 1 device(s) took the final model (gone)" in caplog.text


def test_a_damaged_state_database_is_named_and_leaves_no_broker_running(tmp_path):
    """The embedded broker starts before the store is opened: a start that fails after it must stop it again."""
    state = tmp_path / "state"
    state.mkdir()
    (state / "coordinator.sqlite").write_text("not a database")
    process = subprocess.run([sys.executable, "-m", "ffr.cli", "-q", "coordinator", "serve", "--state", str(state),
                              "--no-gate", "--http-port", str(free_port())], cwd=REPO, capture_output=True, text=True,
                             timeout=120)
    assert process.returncode == 2 and process.stderr.count("\n") == 1, process.stderr
    assert "coordinator.sqlite is damaged or not an ffr-edge coordinator's" in process.stderr
    mine = [p for p in Path("/proc").glob("[0-9]*/cmdline") if _reads(p) and str(state) in _reads(p)]
    assert not mine, "the embedded broker outlived the failed start"


def _reads(path: Path) -> str:
    try:
        return path.read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:  # the process ended while we looked
        return ""


@pytest.mark.parametrize("url, says", [("mqtt://h:99999", "has no valid port"), ("mqtt://h:0", "has no valid port"),
                                       ("http://h:80", "unsupported broker URL scheme 'http'"),
                                       ("mqtt://:1883", "has no host")])
def test_admit_refuses_a_broker_url_the_device_could_not_use(tmp_path, capsys, url, says):
    """The credential carries the URL to the device: a bad one is refused where it is typed, not on the device."""
    from ffr.cli import main

    out = tmp_path / "dev.cred"
    assert main(["-q", "coordinator", "admit", "--state", str(tmp_path / "s"), "--device-id", "dev0", "--out",
                 str(out), "--broker", url]) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1 and not out.exists(), err


@pytest.mark.parametrize("content", ["garbage", "[1, 2]"])
def test_a_damaged_broker_record_is_named_by_admit_and_serve(tmp_path, capsys, content):
    """broker.json is read back by `admit`, the broker's ACL and the next start: damaged, each names it."""
    from ffr.cli import main

    state = tmp_path / "s"
    state.mkdir()
    (state / "broker.json").write_text(content)
    for argv in (["coordinator", "admit", "--state", str(state), "--device-id", "d0", "--out", str(tmp_path / "c")],
                 ["coordinator", "serve", "--state", str(state), "--no-gate", "--http-port", str(free_port())]):
        assert main(["-q", *argv]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "broker.json is damaged or was not written by ffr-edge" in err, err

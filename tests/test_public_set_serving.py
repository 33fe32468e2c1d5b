"""FedFR's public set served by the coordinator: fetched once over HTTP, checked against its signed hash."""
from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import REPO, admitted, device_datasets, serving_coordinator

from coordinator.broker import free_port
from edge_client.public_set import cached_path, fetch_public_set
from models.public_set import PublicSetError, build_public_set, sha256_of


class _Files(http.server.ThreadingHTTPServer):
    """A real HTTP server on localhost that serves `body` at every path and counts the requests."""

    def __init__(self, body: bytes, drip_s: float = 0.0):
        self.body, self.requests, self.dripped = body, 0, 0
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - the stdlib's spelling
                server.requests += 1
                self.send_response(200)
                self.send_header("Content-Length", str(len(server.body)))
                self.end_headers()
                if not drip_s:
                    self.wfile.write(server.body)
                    return
                for i in range(len(server.body)):  # a byte at a time, each well inside the read timeout
                    self.wfile.write(server.body[i:i + 1])
                    self.wfile.flush()
                    server.dripped += 1
                    time.sleep(drip_s)

            def log_message(self, *args):
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/public-set"


@pytest.fixture(scope="module")
def public_file(synthetic_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("public") / "public.safetensors"
    build_public_set(synthetic_dir, out, limit=20)
    return out


def test_fetched_once_then_kept_by_its_hash(public_file, tmp_path):
    data = public_file.read_bytes()
    sha, server = sha256_of(public_file), _Files(data)
    try:
        path = fetch_public_set(server.url, sha, len(data), tmp_path)
        assert path == cached_path(tmp_path, sha) and path.read_bytes() == data
        assert path.stat().st_mode & 0o222 == 0, "the device's copy is read-only"
        assert fetch_public_set(server.url, sha, len(data), tmp_path) == path and server.requests == 1
    finally:
        server.shutdown()


@pytest.mark.parametrize("tamper", ["other bytes", "longer than announced", "shorter than announced"])
def test_a_body_that_is_not_the_announced_file_is_refused_and_not_kept(public_file, tmp_path, tamper):
    data = public_file.read_bytes()
    sha = sha256_of(public_file)
    body = {"other bytes": data[:-1] + bytes([data[-1] ^ 1]), "longer than announced": data + b"x",
            "shorter than announced": data[:-10]}[tamper]
    server = _Files(body)
    try:
        with pytest.raises(PublicSetError, match="announced|larger"):
            fetch_public_set(server.url, sha, len(data), tmp_path)
        assert list(tmp_path.iterdir()) == [], "nothing half-fetched or unverified stays on the device"
    finally:
        server.shutdown()


def test_a_server_dripping_bytes_cannot_hold_the_device(tmp_path):
    server = _Files(b"x" * 1000, drip_s=0.05)
    try:
        with pytest.raises(PublicSetError, match="giving up"):
            fetch_public_set(server.url, "0" * 64, 1000, tmp_path, timeout_s=1.0, min_rate=1e6)
        assert server.dripped < 1000  # it hung up long before the last byte (50 s of drips), on any machine's speed
        assert list(tmp_path.iterdir()) == []
    finally:
        server.shutdown()


def test_an_unreachable_server_is_a_clear_error(tmp_path):
    with pytest.raises(PublicSetError, match="could not fetch"):
        fetch_public_set(f"http://127.0.0.1:{free_port()}/public-set", "0" * 64, 10, tmp_path, timeout_s=5)


def test_coordinator_serves_the_public_set_to_a_device_without_one(public_file, tmp_path):
    """`ffr coordinator serve --method fedfr --public-set FILE` and an `ffr edge run` with no public set of its own:
    the device fetches the served part once, checks it against the signed round configuration's sha256, and samples
    hard negatives from it in both rounds; the coordinator judges on the part it keeps."""
    (data,) = device_datasets(tmp_path / "data", 1, 2, 4)
    port, state, home = free_port(), tmp_path / "state", tmp_path / "home"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cli = [sys.executable, "-m", "ffr"]
    coordinator, served = serving_coordinator(
        "--rounds", "2", "--min-clients", "1", "--state", str(state), "--http-port", str(port), "--batch-size", "8",
        "--method", "fedfr", "--public-set", str(public_file), "--t-hn", "-1", "--dfc-steps", "20",
        "--exit-when-done", env=env)
    try:
        credential = admitted(state, "dev0", tmp_path / "dev0.credential")
        edge = subprocess.run(cli + ["edge", "run", "--credential", str(credential), "--data", str(data), "--home",
                                     str(home), "--exit-when-done", "--no-export"],
                              cwd=REPO, capture_output=True, text=True, env=env, timeout=400)
        assert edge.returncode == 0, edge.stdout[-3000:] + edge.stderr[-3000:]
        assert coordinator.wait(60) == 0
    finally:
        if coordinator.poll() is None:
            coordinator.kill()
    served = "".join(served)
    assert f"served at http://127.0.0.1:{port}/public-set" in served, served[-2000:]
    # what is served is the public set less the share the coordinator keeps for its gate, which no device gets
    (kept,) = (state / "public").glob("gate_faces-*.safetensors")
    (sent,) = (state / "public").glob("public_set-*-served.safetensors")
    assert f"quality gate: {kept.name}, a share of --public-set kept by the coordinator" in served
    assert cached_path(home / "public", sha256_of(sent)).read_bytes() == sent.read_bytes()
    assert not any(f.read_bytes() == kept.read_bytes() for f in (home / "public").rglob("*") if f.is_file())
    output = edge.stdout + edge.stderr
    assert output.count("fetched from") == 1, "fetched once for both rounds"
    # the coordinator (and its embedded broker) stopped only once the device had taken the final model
    assert "final model v2 adopted" in output and "stopping before" not in served, served[-2000:]
    rounds = json.loads((home / "rounds.json").read_text())
    assert [r["round_id"] for r in rounds] == [1, 2] and all(r["hn_fraction"] == 1.0 for r in rounds), rounds


def test_a_device_holds_the_announced_public_set_for_its_checks_even_without_hard_negatives(public_file, tmp_path):
    """At the defaults (fedprox) rounds sample no hard negatives, yet the device's adoption check and calibration
    need strangers' faces: the announced set is fetched (once) all the same, and no round trains on it."""
    from edge_client.public_set import DevicePublicSet
    from protocol.messages import TrainingConfig

    body = public_file.read_bytes()
    server = _Files(body)
    cfg = TrainingConfig(public_set={"url": server.url, "sha256": sha256_of(public_file), "size_bytes": len(body)})
    public = DevicePublicSet(None, tmp_path / "public", "dev0")
    assert public.negatives_for_adoption() is None
    public.follow(cfg)
    public.follow(cfg)
    assert server.requests == 1
    assert public.negatives_for_adoption() is not None and len(public.negatives_for_adoption()) == 20
    assert public.for_round(cfg) is None, "fedprox's round does not train on it"
    server.shutdown()

"""Admission: the operator lets a device in by handing it a credential file, out of band.

`ffr coordinator admit` writes a one-time token into the coordinator's state and a
credential file (mode 0600) for the device: its id, the token, the coordinator's public key
to pin, the broker's address (and the device's broker login when the broker enforces ACLs).
The device proves it holds the token without sending it (`protocol.auth.token_proof`) and
registers the public half of a key pair it generated itself, so nothing secret ever
crosses the broker.
"""
from __future__ import annotations

from pathlib import Path

from coordinator.broker import broker_record
from protocol.auth import Signer, new_token
from protocol.credential import Credential
from protocol.transport import BrokerAddress


def coordinator_signer(state: Path) -> Signer:
    """The coordinator's Ed25519 identity, created (mode 0600) in its state folder on first use."""
    return Signer.load_or_create(Path(state) / "coordinator.key")


def recorded_broker(state: Path) -> str | None:
    """The broker address the coordinator last served on (written by `ffr coordinator serve`)."""
    return broker_record(state).get("url")


def admit(state: Path, device_id: str, broker: str | None = None) -> Credential:
    """Issue (or reissue, replacing an unused one) a device's credential; the token is stored in the state."""
    import re

    from coordinator.broker_acl import BrokerUsers
    from coordinator.store import Store

    if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", device_id):
        raise ValueError(f"device id {device_id!r} must be 1-64 characters of [A-Za-z0-9_.-]")
    state = Path(state)
    url = broker or recorded_broker(state)
    if url is None:
        raise ValueError(f"no broker address known for {state}: pass --broker mqtt://HOST:PORT "
                         "(or start `ffr coordinator serve --state` once, which records it)")
    BrokerAddress.parse(url)  # a URL the device could not use is refused here, not on the device
    signer = coordinator_signer(state)
    token = new_token()
    store = Store(state)
    try:
        store.admit(device_id, token)
    finally:
        store.db.close()
    login = BrokerUsers(state).add_device(device_id)
    ca = state / "tls" / "ca.pem"
    return Credential(device_id=device_id, token=token, coordinator_public_key=signer.public_hex, broker=url,
                      broker_username=login[0] if login else None, broker_password=login[1] if login else None,
                      ca_pem=ca.read_text() if ca.exists() else None)

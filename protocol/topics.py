"""The MQTT topic scheme, in one place. Every topic starts with `ffr/v1/`.

| topic | publisher | payload |
|---|---|---|
| `ffr/v1/devices/{device}/hello` | device | signed `Hello` |
| `ffr/v1/devices/{device}/heartbeat` | device | signed `Heartbeat` |
| `ffr/v1/devices/{device}/update` | device | signed `UpdateHeader` |
| `ffr/v1/devices/{device}/update/chunks` | device | chunk frames of the update's safetensors |
| `ffr/v1/devices/{device}/inbox` | coordinator | `Ack` / `Error` for that device |
| `ffr/v1/rounds/announce` | coordinator | `RoundAnnouncement` (retained); after the last round, `ModelRelease` |
| `ffr/v1/models/{version}/chunks` | coordinator | chunk frames of a global backbone |
| `ffr/v1/models/{version}/momentum` | coordinator | chunk frames of PFM's global momentum for that version |
| `ffr/v1/models/candidate-{round}-{t}/chunks` | coordinator | a candidate model FV validators score |
| `ffr/v1/devices/{device}/score` | validator | signed `ValidationScore` |
"""
from __future__ import annotations

PREFIX = "ffr/v1"


def device(device_id: str, leaf: str) -> str:
    return f"{PREFIX}/devices/{device_id}/{leaf}"


def round_announcements() -> str:
    return f"{PREFIX}/rounds/announce"


def model_chunks(version: int) -> str:
    return f"{PREFIX}/models/{version}/chunks"


def momentum_chunks(version: int) -> str:
    return f"{PREFIX}/models/{version}/momentum"


def candidate_chunks(round_id: int, candidate: int) -> str:
    return f"{PREFIX}/models/candidate-{round_id}-{candidate}/chunks"


def all_device_messages() -> str:
    return f"{PREFIX}/devices/+/#"

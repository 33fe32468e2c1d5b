"""The targeted impersonation of issue 48, set up and measured: who attacks whom, and how often it works.

The attacker (a malicious training device, `fleet.attacks.impersonate_delta`) pulls its own first person's face
onto a victim: the first person of another training device, four of whose training photos it is given (as from
social media). Success is measured the way the victim's door would fail: the attacker's held-out photos (its
person's test images, never trained on) scored against the victim's template (the mean embedding of the victim's
training photos on the victim's device), at the threshold that model gives a FAR of 1e-3 on strangers (people on no
device) against that device's templates. `success_rate`: the fraction accepted as the victim.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from fleet.data import TEST, TRAIN, FleetData, device_id
from models.evaluation.thresholds import threshold_at_far

PHOTOS = 4          # the victim's photos the attacker holds
FAR = 1e-3          # the victim device's operating point
STRANGERS = 300     # images of people on no device the threshold is set on

Embed = Callable[[np.ndarray], np.ndarray]  # crop indices -> L2-normalised embeddings


@dataclass(frozen=True)
class Plan:
    attacker: int            # the attacking client
    attacker_person: str
    victim: int              # the victim's client
    victim_person: str
    photos: tuple[int, ...]  # crop indices of the victim's photos the attacker holds

    def record(self) -> dict:
        return {**asdict(self), "attacker": device_id(self.attacker), "victim": device_id(self.victim)}


def plan(data: FleetData, attackers: set[int], seed: int) -> Plan | None:
    """The first attacker against the first person of an honest training client chosen by the seed (None without
    an attacker or an honest client)."""
    honest = [k for k in data.training_clients if k not in attackers]
    if not attackers or not honest:
        return None
    attacker = min(attackers)
    victim = int(np.random.default_rng(seed + 48).choice(honest))
    victim_person = sorted(data.partition.clients[victim])[0]
    own = np.flatnonzero((data.names == victim_person) & (data.split == TRAIN))
    photos = np.random.default_rng(seed + 49).permutation(own)[:PHOTOS]
    return Plan(attacker, sorted(data.partition.clients[attacker])[0], victim, victim_person,
                tuple(int(i) for i in np.sort(photos)))


def write_photos(data: FleetData, attack: Plan, path: Path) -> Path:
    """What every attacker is given (colluders share): the attacker person's training photos and the victim's
    photos, as uint8 arrays (`np.savez`, read back without pickle)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    own = np.flatnonzero((data.names == attack.attacker_person) & (data.split == TRAIN))
    with path.open("wb") as f:
        np.savez(f, own=np.ascontiguousarray(data.crops.images[own]),
                 victim=np.ascontiguousarray(data.crops.images[list(attack.photos)]))
    return path


def read_photos(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """(the attacker person's photos, the victim's photos) from `write_photos`' file."""
    with np.load(path, allow_pickle=False) as f:
        return f["own"], f["victim"]


def success_rate(data: FleetData, attack: Plan, embed: Embed, seed: int) -> float | None:
    """The fraction of the attacker's held-out photos the victim's device accepts as the victim under `embed`."""
    held_out = np.flatnonzero((data.names == attack.attacker_person) & (data.split == TEST))
    people = sorted(data.partition.clients[attack.victim])
    strangers = np.flatnonzero(data.holdout_mask())
    if not len(held_out) or not len(strangers):
        return None
    embed = _unit(embed)
    strangers = np.sort(np.random.default_rng(seed).choice(strangers, min(STRANGERS, len(strangers)), replace=False))
    templates = np.stack([_template(embed(np.flatnonzero((data.names == p) & (data.split == TRAIN)))) for p in people])
    threshold, _ = threshold_at_far((embed(strangers) @ templates.T).ravel(), FAR)
    victim = templates[people.index(attack.victim_person)]
    return float(np.mean(embed(held_out) @ victim > threshold))


def _unit(embed: Embed) -> Embed:
    def unit(indices: np.ndarray) -> np.ndarray:
        e = embed(indices).astype(np.float64)
        return e / np.maximum(np.linalg.norm(e, axis=1, keepdims=True), 1e-12)
    return unit


def _template(embeddings: np.ndarray) -> np.ndarray:
    mean = embeddings.mean(0)
    return mean / max(float(np.linalg.norm(mean)), 1e-12)

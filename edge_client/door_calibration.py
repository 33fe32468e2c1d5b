"""Calibrating a device's door: the threshold that keeps the false-accept rate it promises, set on its enrolled
people (genuine pairs, and each other as impostors), more of its people when given, and strangers' faces (the
public set it was given, else the one its last round calibrated on), with the checks that refuse a calibration
that would make the device worse. `ffr device calibrate` and `edge_client.api.Device.calibrate` both call
`calibrate_door`; after a round, `edge_client.verifier_choice` calibrates the model it keeps with the same maths
(`edge_client.recognizer.calibrate`).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edge_client.home import DeviceHome
from edge_client.recognizer import Calibration, Recognizer, calibrate, template_of

MAX_CALIBRATION_FAR = 0.5
MAX_EXPECTED_FRR = 0.2


@dataclass(frozen=True)
class DoorCalibration:
    calibration: Calibration
    problems: list[str]  # why applying it would make the device worse (empty: none)
    line: str            # the one line a person reads: threshold, FAR, expected FRR and what it rests on
    person_thresholds: dict[str, float]  # each person's own (`edge_client.person_threshold`), the device's or above


def calibrate_door(home: DeviceHome, recognizer: Recognizer, far: float,
                   more: list[tuple[str, np.ndarray]] = (), public_set: Path | None = None) -> DoorCalibration:
    """The calibration for FAR `far` (not applied: the caller saves it into the sealed settings); `more`: (name,
    embeddings) of more of the device's people; raises `models.public_set.PublicSetError` for a damaged set."""
    from edge_client.verifier_choice import shift_floor

    if not 0 < far <= MAX_CALIBRATION_FAR:
        raise ValueError(f"far must be in (0, {MAX_CALIBRATION_FAR:g}], got {far:g}")
    people = recognizer.people()
    embeddings = [recognizer.embed(p.crops) for p in people] + [e for _, e in more]
    names = [p.name for p in people] + [n for n, _ in more]
    strangers, shift, source = _strangers(home, recognizer, people, far, public_set)
    same_set = strangers is not None and uses_sealed_set(home, recognizer, public_set)
    floor = shift_floor(recognizer.settings, recognizer.settings.public_set) if same_set else None
    cal = calibrate(embeddings, far, recognizer.model_sha256, strangers, min_shift=max(shift, floor or 0.0))
    if same_set:  # the first shift measured on the sealed public set goes on (`verifier_choice.shift_floor`)
        cal.shift_floor = floor if floor is not None else cal.capture_shift
    note = "" if cal.measurable else (
        f"; only {cal.impostor_pairs} impostor scores, too few to count FAR {far:g}:"
        " the threshold is the higher of the highest of them and a normal fitted to them (add people or --data DIR)")
    own = own_thresholds(cal, names, embeddings)
    raised = [f"{n} {t:.3f}" for n, t in own.items() if t > cal.threshold]
    said = f" (raised for {len(raised)} whom strangers resemble: {', '.join(raised[:5])})" if raised else ""
    line = (f"threshold {cal.threshold:.3f} for FAR {far:g}{said}: expected false-reject rate "
            f"{cal.expected_frr:.3f} ({cal.genuine_pairs} genuine / {cal.impostor_pairs} impostor pairs{source}){note}")
    return DoorCalibration(cal, calibration_problems(cal, embeddings, names), line, own)


def own_thresholds(cal: Calibration, names: list[str], embeddings: list[np.ndarray]) -> dict[str, float]:
    """Each person's own threshold under `cal` (`edge_client.person_threshold`), their template made of `embeddings`;
    a person with no face has none."""
    usable = [(n, e) for n, e in zip(names, embeddings) if len(e)]
    if not usable:
        return {}
    own = cal.thresholds_for(np.stack([template_of(e) for _, e in usable]))
    return {n: float(t) for (n, _), t in zip(usable, own)}


def _strangers(home: DeviceHome, recognizer: Recognizer, people: list, far: float, public_set: Path | None
               ) -> tuple[np.ndarray | None, float, str]:
    """Strangers' faces for the calibration (`public_set`, else the public set the last round calibrated on),
    embedded; the least their scores are moved up by (for the personalised model, the global model's capture
    shift: `edge_client.verifier_choice`); and the words for the line. A personalised model calibrated on the
    device's people alone let strangers in, so without a public set that is said."""
    path = public_set or received_public_set(home, recognizer.settings.public_set)
    if path is None:
        note = ("; no strangers' faces: the personalised model's threshold may let strangers in, give --public-set"
                if recognizer.model_path == home.personalised_onnx else "")
        return None, 0.0, note
    from models.public_set import load_public_set

    # the received set must still be the one the sealed settings name
    public = load_public_set(path, None if public_set else recognizer.settings.public_set).images
    shift = 0.0
    if recognizer.model_path == home.personalised_onnx and len(people) >= 2:
        from edge_client.verifier_choice import global_shift

        crops = [p.crops for p in people]
        labels = np.concatenate([np.full(len(c), i) for i, c in enumerate(crops)])
        shift = global_shift(home, recognizer.settings, far, np.concatenate(crops), labels, public)
    return recognizer.embed(public), shift, f", {len(public)} strangers' faces from {path.name}"


def uses_sealed_set(home: DeviceHome, recognizer: Recognizer, public_set: Path | None) -> bool:
    """Whether the strangers come from the public set the sealed settings name (the received one, or a file given
    that is the same): only then is its shift floor used and kept; another set's shift is measured afresh and not
    kept, since the next round calibrates on the sealed set again."""
    from models.public_set import sha256_of

    sealed = recognizer.settings.public_set
    if sealed is None:
        return False
    if public_set is None:  # the received set, which `_strangers` read only if it still had that hash
        return received_public_set(home, sealed) is not None
    return sha256_of(public_set) == sealed


def received_public_set(home: DeviceHome, sha256: str | None) -> Path | None:
    """The public set the last round calibrated on (`HOME/public/<sha256>.safetensors`, its hash from the sealed
    settings), or None (none recorded, or the file is gone): any other file in that folder may have been put there by
    someone else, and the one named is checked against that hash when read."""
    if sha256 is None or not re.fullmatch(r"[0-9a-f]{64}", sha256):
        return None
    path = home.root / "public" / f"{sha256}.safetensors"
    return path if path.is_file() else None


def calibration_problems(cal: Calibration, embeddings: list[np.ndarray], names: list[str]) -> list[str]:
    """Why a calibration would make the device worse: too many genuine faces refused, or 'impostors' that are
    the same person under two names (their mean cross score as high as their own genuine scores)."""
    problems = []
    if cal.expected_frr > MAX_EXPECTED_FRR:
        problems.append(f"it would refuse {cal.expected_frr:.0%} of genuine faces (above {MAX_EXPECTED_FRR:.0%})")
    own = [float(np.mean((e @ e.T)[np.triu_indices(len(e), 1)])) if len(e) >= 2 else None for e in embeddings]
    twins = [f"{names[i]} / {names[j]}" for i in range(len(embeddings)) for j in range(i + 1, len(embeddings))
             if own[i] is not None and own[j] is not None
             and float(np.mean(embeddings[i] @ embeddings[j].T)) >= 0.9 * min(own[i], own[j])]
    if twins:
        problems.append(f"{len(twins)} pair(s) of people look like one person under two names "
                        f"({', '.join(twins[:3])}{', ...' if len(twins) > 3 else ''})")
    return problems

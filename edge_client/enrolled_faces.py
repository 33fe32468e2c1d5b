"""The people enrolled on this device (`ffr device enroll`) as the faces a federated round trains on.

One enrolment for verifying and federating (issue 49): `ffr edge run` without `--data` trains on the encrypted
crops in the device's store. They are decrypted in memory each time a round asks for them and never written out
in the clear, and whoever was enrolled or removed since the last round is in the next one.
"""
from __future__ import annotations

import logging

import numpy as np

from edge_client.home import DeviceHome
from edge_client.vault import Vault
from models.faces.crops import CropReport, FaceCrops

log = logging.getLogger("edge_client")
MIN_PEOPLE = 2  # a round's margin head and the device's calibration need two people at least


class NotEnoughEnrolled(ValueError):
    """Too few people enrolled to train on; says how to enrol more."""


def enrolled_crops(home: DeviceHome) -> FaceCrops:
    """Every readable enrolled person's stored crops, labelled in name order; a damaged record is left out and
    named in the log."""
    damaged: list[str] = []
    people = sorted(Vault.open(home.root / "store").people(damaged), key=lambda p: p.name)
    for problem in damaged:
        log.warning("%s: not training on a damaged record: %s", home.root, problem)
    if len(people) < MIN_PEOPLE:
        raise NotEnoughEnrolled(f"{len(people)} people enrolled in {home.root}: a round needs {MIN_PEOPLE} at least "
                                "(enrol them with `ffr device enroll --home ...`, or give `ffr edge run --data DIR`)")
    images = np.concatenate([p.crops for p in people])
    labels = np.concatenate([np.full(len(p.crops), k, np.int64) for k, p in enumerate(people)])
    paths = [f"{p.name}#{i}" for p in people for i in range(len(p.crops))]
    return FaceCrops(np.ascontiguousarray(images, np.uint8), labels, [p.name for p in people], paths,
                     CropReport(n_files=len(images), n_cropped=len(images)))

"""A simulated fleet's data: who lives on which device, and which images each device may train on.

Faces are cropped once (cache shared with the devices, keyed by file), identities are
partitioned over clients (`models.faces.partition`), and each identity's images are split
train/validation/test. A device's folder holds links to its *training* images only, in the
folder-per-identity layout the edge client reads; validation and test images stay with the
simulator, which plays the role of the evaluator that a real fleet does not have.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np

from fleet.config import SimConfig
from models.faces.crops import CropConfig, FaceCrops, crop_index, default_cache_dir, resolve_detector
from models.faces.datasets import SYNTHETIC_MARKER, FaceIndex, load_index
from models.faces.partition import Partition, PartitionError, partition, read_celeba_attributes
from models.faces.splits import stratified_split

TRAIN, VAL, TEST = 0, 1, 2


def device_id(client: int) -> str:
    return f"client-{client:03d}"


def dataset_index(config: SimConfig, run_dir: Path) -> FaceIndex:
    """The user's dataset, or SYNTHETIC identities written once into the run folder."""
    if config.data is not None:
        return load_index(config.data, config.layout)
    from models.faces.synthetic import write_dataset

    root = run_dir / "synthetic_data"
    if not (root / SYNTHETIC_MARKER).exists():
        write_dataset(root, config.synthetic_identities, config.synthetic_images, seed=config.seed)
    return load_index(root)


def make_partition(index: FaceIndex, identities: list[str], config: SimConfig) -> Partition:
    """The identity partition `config` asks for; every impossibility is a PartitionError, before training."""
    attributes = None
    if config.partition == "attribute":
        if index.attributes_file is None:
            raise PartitionError(f"{index.root} has no per-image attributes (CelebA's list_attr_celeba.txt), "
                                 "so it cannot be partitioned by attribute")
        if not config.rules:
            raise PartitionError("--partition attribute needs --rules FILE")
        attributes = read_celeba_attributes(index.attributes_file, {s.path.name: s.identity for s in index.samples})
    return partition(identities, config.clients, config.partition, config.seed, config.holdout_identities,
                     config.heldout_clients, config.alpha, config.alpha_x100, config.lognormal_mu,
                     config.lognormal_sigma, attributes, config.rules)


def crop_cache(config: SimConfig) -> Path:
    """Where faces are cropped once, for the simulator and every simulated device alike."""
    return Path(config.crop_cache) if config.crop_cache else default_cache_dir()


@dataclass
class FleetData:
    crops: FaceCrops          # every usable face of the dataset
    split: np.ndarray         # TRAIN/VAL/TEST per crop (held-out identities: all TEST)
    partition: Partition
    detector: str
    gate_people: tuple[str, ...] = ()    # people on no device whom the coordinator keeps for its quality gate
    public_people: tuple[str, ...] = ()  # people on no device whose faces every device is served (its public set)

    @cached_property
    def names(self) -> np.ndarray:
        """The identity of every crop, by name (partitions name people, crops number them)."""
        return np.array(self.crops.identities)[self.crops.labels]

    def client_mask(self, client: int, part: int | None = None) -> np.ndarray:
        mask = np.isin(self.names, self.partition.clients[client])
        return mask if part is None else mask & (self.split == part)

    def holdout_mask(self) -> np.ndarray:
        """The people on no device that the evaluation uses: the unseen people, less the coordinator's own and the
        public set's (faces a device has seen are no stranger's)."""
        return np.isin(self.names, self.partition.holdout_identities) & ~self.gate_mask() & ~self.public_mask()

    def gate_mask(self) -> np.ndarray:
        return np.isin(self.names, self.gate_people)

    def public_mask(self) -> np.ndarray:
        return np.isin(self.names, self.public_people)

    def holdout(self) -> FaceCrops | None:
        """Images of the people on no device: the global model's unseen identities."""
        return self.crops.select(self.holdout_mask()) if self.holdout_mask().any() else None

    @property
    def training_clients(self) -> list[int]:
        return [k for k in range(len(self.partition.clients)) if k not in self.partition.heldout_clients]

    def union(self, part: int, clients: list[int]) -> FaceCrops:
        mask = np.zeros(len(self.crops), bool)
        for k in clients:
            mask |= self.client_mask(k, part)
        return self.crops.select(mask)


def prepare(config: SimConfig, run_dir: Path) -> FleetData:
    """Crop, partition (reusing the saved partition when resuming) and split; nothing is trained here."""
    index = dataset_index(config, run_dir)
    detector = resolve_detector(config.detector, index)
    crop_config = CropConfig(detector=detector, fallback_center=True)
    crops = crop_index(index, crop_config, cache_dir=crop_cache(config), progress=config.progress, min_images=2)
    saved = run_dir / "partition.json"
    if saved.exists():
        part = Partition.load(saved)
        strangers = {i for ids in part.clients for i in ids} - set(crops.identities)
        if strangers:
            raise PartitionError(f"{saved} names {len(strangers)} people who are not in --data; choose another --out")
    else:
        part = make_partition(index, crops.identities, config)
        part.save(saved)
    split = stratified_split(crops.labels, tuple(config.split), config.seed)
    gate = coordinator_people(part.holdout_identities, config)
    data = FleetData(crops, split, part, detector, gate, public_people(part.holdout_identities, gate, config))
    split[data.holdout_mask()] = TEST
    empty = [k for k in data.training_clients if not data.client_mask(k, TRAIN).any()]
    if empty:
        raise PartitionError(f"clients {empty} have no training images")
    return data


def coordinator_people(unseen: list[str], config: SimConfig) -> tuple[str, ...]:
    """A seeded share (`gate_identities`) of the people on no device, for the coordinator's quality gate when the run
    names no gate faces: faces it never serves, which neither a device nor the evaluation sees. None when the share
    is 0, the gate is off or has faces, or either side would keep fewer than two people."""
    if config.gate.off or config.gate.data is not None or config.gate_identities <= 0:
        return ()
    n = int(round(len(unseen) * config.gate_identities))
    if n < 2 or len(unseen) - n < 2:
        return ()
    chosen = np.random.default_rng(config.seed + 7).choice(sorted(unseen), n, replace=False)
    return tuple(sorted(str(name) for name in chosen))


def public_people(unseen: list[str], gate: tuple[str, ...], config: SimConfig) -> tuple[str, ...]:
    """Without --public-data, a seeded share (`public_identities`) of the people on no device, the coordinator's
    left out: the public set every device is served, its strangers' faces for the adoption check, the choice
    between its models and the calibration of its door. None when the share is 0, --public-data is given, or
    either side would keep fewer than two people."""
    if config.public_data is not None or config.public_identities <= 0:
        return ()
    rest = sorted(set(unseen) - set(gate))
    n = int(round(len(unseen) * config.public_identities))
    if n < 2 or len(rest) - n < 2:
        return ()
    chosen = np.random.default_rng(config.seed + 11).choice(rest, n, replace=False)
    return tuple(sorted(str(name) for name in chosen))


def write_people(data: FleetData, people: tuple[str, ...], out: Path) -> Path | None:
    """`people`'s face crops as a folder per person (what `--gate-data DIR` and a public set's builder read), written
    once; None for no people."""
    if not people:
        return None
    done = out / ".complete"
    if not done.exists():
        import cv2

        for i in np.flatnonzero(np.isin(data.names, people)):
            person = out / data.crops.identities[data.crops.labels[i]]
            person.mkdir(parents=True, exist_ok=True)
            cv2.imwrite(str(person / f"{i:06d}.png"), cv2.cvtColor(data.crops.images[i], cv2.COLOR_RGB2BGR))
        done.write_text(json.dumps({"people": list(people)}))
    return out


def write_device_folders(data: FleetData, devices_dir: Path, clients: list[int] | None = None,
                         parts: tuple[int, ...] = (TRAIN,)) -> dict[int, Path]:
    """Per client (default: the training clients), a folder-per-identity view (symbolic links) of its images of
    `parts` (default: its training images)."""
    out = {}
    for k in (data.training_clients if clients is None else clients):
        root = devices_dir / device_id(k) / "data"
        done = root / ".complete"
        out[k] = root
        if done.exists():
            continue
        mask = np.zeros(len(data.crops), bool)
        for part in parts:
            mask |= data.client_mask(k, part)
        for i in np.flatnonzero(mask):
            source = Path(data.crops.paths[i]).resolve()
            link = root / data.crops.identities[data.crops.labels[i]] / f"{i:06d}_{source.name}"
            link.parent.mkdir(parents=True, exist_ok=True)
            if not link.is_symlink():
                link.symlink_to(source)
        if data.crops.synthetic:
            (root / SYNTHETIC_MARKER).write_text("SYNTHETIC faces: links into the simulation's generated dataset\n")
        done.write_text(json.dumps({"client": k, "identities": data.partition.clients[k]}))
    return out


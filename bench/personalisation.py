"""How a device's personalised model is fitted, setting by setting: each device's own people against strangers.

The federation issue asks a device's personalised model for 10 points of TAR@FAR=1e-3 on its own people above the
starting model's, at the same FAR on strangers. A device's personalised model is the global backbone with a DFC
branch fitted on its features (`edge_client.local_training.personalised_global`), and that fit does not change the
backbone, so its settings can be compared on one backbone without any round: the starting model's, as every
device holds it before round 1. Each arm differs only in `TrainingConfig`'s DFC fields (`--arm NAME:k=v,...`);
the devices and strangers are `bench.honest_round`'s (the same partition, people of no device as strangers).

    python -m bench.personalisation --out bench/results \\
        --arm defaults: --arm steps1000:dfc_steps=1000 --arm views4:dfc_views=4 --arm lr3e-2:dfc_lr=0.03
"""
from __future__ import annotations

import argparse
import hashlib
import sys
import time
from pathlib import Path

import numpy as np
import torch

from bench.common import faces_dir, write_results
from bench.honest_round import BASE, _mean, _n, add_fleet_options, device_crops, fleet_data, own_vs_strangers, parse_arm
from edge_client.local_training import personalised_global
from edge_client.verifier_choice import check_split, preferred
from fleet.doors import door as door_of
from fleet.doors import door_faces
from fleet.evaluation import embed
from fleet.report import OWN_GAIN
from models.networks.dfc import DFCBranch
from models.networks.face_model import global_embedder, initial_global_state
from models.public_set import SIZE
from models.training.distill_data import list_images, load_crops
from models.training.fedfr import T_HN, hard_negatives
from protocol.messages import TrainingConfig
from protocol.methods import FedFR

FAR = 1e-3  # the false-accept rate a device promises unless its owner calibrated for another
NEGATIVES = ("none", "all", "hard")  # the arm key `dfc_negatives`: which of the fit share join the DFC fit
# arm keys that set the fitted branch's own settings (`models.networks.dfc.personalised_embedding`'s gamma and beta)
BRANCH_SETTINGS = ("posterior_weight", "custom_weight")


def public_faces(folder: Path | None, limit: int, seed: int) -> tuple[np.ndarray, np.ndarray] | None:
    """Faces of nobody's people as a device gets them (a public set the coordinator serves), split in two
    disjoint halves: the share a personalised fit may use as negatives, and the share it is calibrated on."""
    images = public_images(folder, limit, seed)
    return None if images is None else (images[0::2], images[1::2])


def public_images(folder: Path | None, limit: int, seed: int) -> np.ndarray | None:
    """A seeded `limit` of the faces under `folder`, read as `ffr edge public-set` reads them; None without it."""
    if folder is None or not folder.is_dir():
        return None
    files = list_images([folder])
    chosen = np.random.default_rng(seed).choice(len(files), min(limit, len(files)), replace=False)
    images, _, _ = load_crops([files[i] for i in sorted(chosen)], SIZE, progress=False)
    return images


def door(data, client: int, embedder, public: np.ndarray | None, strangers: np.ndarray, seed: int,
         min_shift: float = 0.0) -> dict | None:
    """What the device's door does with a model (`fleet.doors.door`): calibrated as the device does after a round
    (on the quarter of its images held out of the personalised fit, `check_split`, and the public faces it judges
    on) at FAR, its templates from all its images; TAR on its own people's test images, FAR on strangers' images
    (people of no device, never seen by any calibration) against every template. `min_shift`: the global model's
    capture shift, the personalised model's floor (`edge_client.verifier_choice`); `far_own_shift` and
    `tar_own_shift` are the same door with the model's own shift alone."""
    faces = door_faces(data, client, strangers, public, seed)
    floored, alone = door_of(embedder, faces, FAR, min_shift), door_of(embedder, faces, FAR)
    if floored is None or alone is None:
        return None
    return {**floored, "far_own_shift": alone["far"], "tar_own_shift": alone["tar"]}


def personal_negatives(model_state: dict, crops, config: TrainingConfig, fit: np.ndarray | None, how: str,
                       seed: int) -> np.ndarray | None:
    """The public faces a personalised fit uses as negatives: none, all of the fit share, or FedFR's hard ones
    (cosine above t_hn to one of the device's faces under the global backbone)."""
    if how == "none" or fit is None:
        return None
    if how == "all":
        return fit
    model = global_embedder({k: v.numpy() for k, v in model_state.items()})
    chosen = hard_negatives(torch.from_numpy(embed(model, fit)), torch.from_numpy(embed(model, crops.images)),
                            config.method.t_hn if isinstance(config.method, FedFR) else T_HN)
    return fit[chosen.numpy()]


class Fits:
    """Each device's personalised branch on one backbone, fitted once per fit setting, and the backbone's embedding of
    each image set made once: an arm that changes only the branch's own settings (`BRANCH_SETTINGS`: the vote's
    weight, the halves' shares) re-scores the same fit, so a curve over them costs a fit, not a fit a point. The
    personalised embedding is the branch applied to the generic one, as `FaceModel.embed_personalised` does."""

    def __init__(self, state: dict):
        self.state = {k: torch.from_numpy(v.copy()) for k, v in state.items()}
        self.backbone = global_embedder(state)
        self._branches: dict[tuple, DFCBranch] = {}
        self._generic: dict[str, np.ndarray] = {}  # a face's sha1 -> Theta(face)

    def generic(self, images: np.ndarray) -> np.ndarray:
        """Theta(images), each face embedded once however many calls and arrays it comes in (the strangers come with
        every device's own faces in one array, and alone to its door)."""
        keys = [hashlib.sha1(face.tobytes()).hexdigest() for face in np.ascontiguousarray(images)]
        new = {key: i for i, key in enumerate(keys) if key not in self._generic}
        if new:
            for key, row in zip(new, embed(self.backbone, images[list(new.values())])):
                self._generic[key] = row
        return np.stack([self._generic[key] for key in keys]) if keys else np.zeros((0, 0), np.float32)

    def branch(self, data, client: int, config: TrainingConfig, how: str, seed: int,
               fit: np.ndarray | None) -> DFCBranch:
        """The device's branch fitted as `edge_client.local_training.personalised_global` fits it, on the images the
        choice does not judge (`check_split`)."""
        key = (client, config.model_dump_json(), how, seed)
        if key not in self._branches:
            crops = device_crops(data, client)
            check = check_split(crops.labels, seed)
            fitted = crops if check is None else crops.select(~check)
            model = personalised_global(self.state, fitted, config, seed,
                                        personal_negatives(self.state, fitted, config, fit, how, seed))
            self._branches[key] = model.dfc.eval()
        return self._branches[key]

    def personalised(self, branch: DFCBranch, settings: dict[str, float]):
        """images -> the branch's personalised embedding with `settings` (the branch's own where unset), the branch
        itself unchanged."""
        def embedder(images: np.ndarray) -> np.ndarray:
            with torch.inference_mode():
                return branch.personalise(torch.from_numpy(self.generic(images)), settings.get("posterior_weight"),
                                          settings.get("custom_weight")).numpy()
        return embedder


def score_arm(data, strangers: np.ndarray, fits: Fits, overrides: dict, seed: int,
              public: tuple[np.ndarray, np.ndarray] | None, floors: dict[str, float]) -> dict:
    """Mean over devices of TAR@1e-3 on their own people against strangers, with the arm's personalised model;
    and its door (`door`): TAR and FAR on strangers at the threshold the device calibrates (`floors`: each
    device's capture shift under the global model)."""
    overrides = dict(overrides)
    how = str(overrides.pop("dfc_negatives", "none"))
    settings = {key: float(overrides.pop(key)) for key in BRANCH_SETTINGS if key in overrides}
    if how not in NEGATIVES:
        raise SystemExit(f"dfc_negatives={how!r}: choose one of {', '.join(NEGATIVES)}")
    config = TrainingConfig(**{**BASE, **overrides})
    fit, judge = public if public is not None else (None, None)
    images, per_device, doors = data.crops.images, {}, {}
    for k in data.training_clients:
        mine = fits.personalised(fits.branch(data, k, config, how, seed + k, fit), settings)
        row = own_vs_strangers(data, k, lambda idx: mine(images[idx]), strangers)
        if row is not None:
            per_device[str(k)] = row
        if (gate := door(data, k, mine, judge, strangers, seed + k, floors.get(str(k), 0.0))) is not None:
            doors[str(k)] = gate
    return {"overrides": {**overrides, **({"dfc_negatives": how} if how != "none" else {}),
                          **settings},
            "tar@1e-3": _mean([r["tar@1e-3"] for r in per_device.values()]),
            "tar@1e-2": _mean([r["tar@1e-2"] for r in per_device.values()]), "per_client": per_device,
            **door_means(doors)}


def door_means(doors: dict[str, dict]) -> dict:
    """The doors' figures averaged over devices, and the worst device's FAR on strangers."""
    rows = list(doors.values())
    return {"door_tar": _mean([r["tar"] for r in rows]), "door_far": _mean([r["far"] for r in rows]),
            "door_far_worst": max((r["far"] for r in rows), default=None),
            "door_far_own_shift": _mean([r["far_own_shift"] for r in rows]),
            "door_tar_own_shift": _mean([r["tar_own_shift"] for r in rows]), "doors": doors}


def gains_of(start: dict, scores: dict) -> list[float]:
    """Each device's own people's TAR@1e-3 against strangers with the arm's model, minus the starting model's (the
    devices where both could be measured)."""
    pairs = [(row["tar@1e-3"], start["per_client"].get(k, {}).get("tar@1e-3"))
             for k, row in scores["per_client"].items()]
    return [now - before for now, before in pairs if now is not None and before is not None]


def chosen_doors(start: dict, scores: dict) -> list[dict]:
    """The door of the model each device would verify with: the arm's personalised one only where it keeps more of
    its judged people than the starting model, beyond chance (`verifier_choice.preferred`, as a device decides after a
    round)."""
    doors = []
    for k, own in scores["doors"].items():
        if (first := start["doors"].get(k)) is not None:
            judged = min(first.get("genuine_pairs", 0), own.get("genuine_pairs", 0))  # 0: a result from before
            kind = preferred({"global": first["tar_promised"], "personalised": own["tar_promised"]}, True, judged)
            doors.append({**(own if kind == "personalised" else first), "kind": kind})
    return doors


def row_of(arm: str, settings: str, scores: dict, start: dict) -> dict:
    """One line of the table: the ROC figures (threshold chosen on the strangers), how many devices gained the
    federation issue's 10 points there, the personalised model's door (calibrated) and the door each device would
    verify with (`chosen_doors`)."""
    gains, chosen = gains_of(start, scores), chosen_doors(start, scores)
    return {"arm": arm, "settings": settings, "tar@1e-3": scores["tar@1e-3"], "tar@1e-2": scores["tar@1e-2"],
            "devices +10 points": f"{sum(g >= OWN_GAIN for g in gains)} of {len(gains)}",
            "worst gain": min(gains, default=None),
            "door TAR": scores["door_tar"], "door FAR": scores["door_far"],
            "worst device FAR": scores["door_far_worst"],
            "chosen door TAR": _mean([d["tar"] for d in chosen]), "chosen door FAR": _mean([d["far"] for d in chosen]),
            "chosen worst FAR": max((d["far"] for d in chosen), default=None),
            "personalised chosen": f"{sum(d['kind'] == 'personalised' for d in chosen)} of {len(chosen)}",
            "door TAR, own shift": scores["door_tar_own_shift"], "door FAR, own shift": scores["door_far_own_shift"]}


def table_of(results: dict) -> list[dict]:
    """The table of a run's results (`results`: as the run's JSON keeps them)."""
    start = results["start"]
    table = [row_of("start", "the starting model, no personalisation", start, start)]
    return table + [row_of(n, ", ".join(f"{k}={v}" for k, v in a["overrides"].items()) or "defaults", a, start)
                    for n, a in results["arms"].items()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_fleet_options(p, "personalisation", "dirichlet")
    public = faces_dir() / "celebahq_aligned" if faces_dir() is not None else None
    p.add_argument("--public-faces", type=Path, default=public,
                   help=f"unlabelled faces of nobody's people, the public set a device is served (default {public})")
    p.add_argument("--public-limit", type=int, default=1000,
                   help="at most this many of them, half for a personalised fit's negatives, half for the device's "
                        "calibration (default 1000)")
    args = p.parse_args(argv)
    fleet = fleet_data(args)
    if fleet is None:
        print("no labelled faces: set FFR_FACES_DIR or give --data", file=sys.stderr)
        return 2
    data, strangers, _, _ = fleet
    public = public_faces(args.public_faces, args.public_limit, args.seed)
    fits, images = Fits(initial_global_state()), data.crops.images
    rows = {str(k): row for k in data.training_clients
            if (row := own_vs_strangers(data, k, lambda idx: fits.generic(images[idx]), strangers)) is not None}
    doors = {str(k): gate for k in data.training_clients
             if (gate := door(data, k, fits.generic, None if public is None else public[1], strangers,
                              args.seed + k)) is not None}
    results = {"partition": args.partition, "clients": args.clients, "far": FAR,
               "public_faces": None if public is None else {"source": str(args.public_faces), "fit": len(public[0]),
                                                            "judge": len(public[1])},
               "start": {"tar@1e-3": _mean([r["tar@1e-3"] for r in rows.values()]),
                         "tar@1e-2": _mean([r["tar@1e-2"] for r in rows.values()]), "per_client": rows,
                         **door_means(doors)}, "arms": {}}
    print(f"start (no personalisation): own TAR@1e-3 {_n(results['start']['tar@1e-3'])}; door TAR "
          f"{_n(results['start']['door_tar'])} FAR {_n(results['start']['door_far'], 4)}", flush=True)
    for text in args.arm or ["defaults:"]:
        name, overrides = parse_arm(text)
        started = time.perf_counter()
        results["arms"][name] = score_arm(data, strangers, fits, overrides, args.seed, public,
                                          {k: d["capture_shift"] for k, d in doors.items()})
        arm = results["arms"][name]
        gain = (arm["tar@1e-3"] - results["start"]["tar@1e-3"]
                if None not in (arm["tar@1e-3"], results["start"]["tar@1e-3"]) else None)
        print(f"{name} {overrides or 'defaults'}: own TAR@1e-3 {_n(arm['tar@1e-3'])} "
              f"({'n/a' if gain is None else f'{gain:+.3f}'}); door TAR {_n(arm['door_tar'])} FAR "
              f"{_n(arm['door_far'], 4)} (worst {_n(arm['door_far_worst'], 4)}); "
              f"{time.perf_counter() - started:.0f} s", flush=True)
        write_results(args.out, args.name, results, table_of(results),
                      f"Personalised models fitted on the starting backbone, {args.clients} CelebA devices, "
                      f"{args.partition}: own people against strangers (mean over devices)",
                      "python -m bench.personalisation " + " ".join(sys.argv[1:] if argv is None else argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

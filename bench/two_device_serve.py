"""The federation issue's first run, as a user runs it: `ffr coordinator serve` at its defaults and two `ffr edge run`
devices with 8 CelebA people each, scored on 20 people no device holds.

python -m bench.two_device_serve --out bench/results [--server-step 1] [--public-faces DIR --name NAME]

With `--public-faces` (a folder of unlabelled faces of nobody's people) the coordinator is given a public set made
from it by `ffr edge public-set`, as an operator would: it keeps a share to itself for the quality gate and serves the
rest, which the devices then calibrate their doors on (strangers' faces).

Every command is the real CLI in its own process (embedded mosquitto, ONNX export, the devices' adoption checks and
verifier choice). Afterwards `ffr eval` scores the shipped model, each released global model and each device's two
exported models on the unseen people (AUC and TAR@FAR with its pairs), the devices' own log lines say which
model each verifies with, at what TAR of its own people, and each device's door is scored on the strangers at the
start (the shipped model, calibrated as a first round would) and now.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import face_set, result_name, write_results
from models.networks.face_weights import write_default_onnx

PEOPLE_PER_DEVICE, UNSEEN = 8, 20


def _link_people(source: Path, names: list[str], out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    for name in names:
        (out / name).symlink_to(source / name)
    return out


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ffr(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ffr.cli", *args], capture_output=True, text=True, **kwargs)


def _eval(model: Path, unseen: Path) -> dict:
    done = _ffr("-q", "eval", "--model", str(model), "--data", str(unseen), "--json", "--threads", "2")
    if done.returncode != 0:
        return {"model": str(model), "error": done.stderr.strip().splitlines()[-1:]}
    report = json.loads(done.stdout)
    tar = report.get("tar_at_far", {})
    return {"auc": report["auc"], "tar@1e-3": tar.get("0.001"), "tar@1e-2": tar.get("0.01"),
            "genuine_pairs": report.get("n_genuine_pairs"), "impostor_pairs": report.get("n_impostor_pairs")}


def run(data: Path, work: Path, rounds: int, extra: list[str]) -> dict:
    people = sorted(p.name for p in data.iterdir() if p.is_dir())
    devices = {f"dev{i + 1}": _link_people(data, people[i * PEOPLE_PER_DEVICE:(i + 1) * PEOPLE_PER_DEVICE],
                                           work / f"dev{i + 1}") for i in range(2)}
    unseen = _link_people(data, people[-UNSEEN:], work / "unseen")
    state = work / "state"
    serve = subprocess.Popen([sys.executable, "-m", "ffr.cli", "coordinator", "serve", "--state", str(state),
                              "--rounds", str(rounds), "--min-clients", "2", "--http-port", str(_free_port()),
                              "--exit-when-done", *extra], stdout=subprocess.DEVNULL,
                             stderr=open(work / "serve.log", "w"))
    deadline = time.monotonic() + 120
    while not (state / "broker.json").exists() and time.monotonic() < deadline:  # written once the broker is up
        time.sleep(1)
    time.sleep(3)
    runs = []
    for name, folder in devices.items():
        credential = work / f"{name}.credential"
        admitted = _ffr("coordinator", "admit", "--state", str(state), "--device-id", name, "--out", str(credential))
        if admitted.returncode != 0:
            serve.kill()
            raise RuntimeError(admitted.stderr)
        runs.append(subprocess.Popen([sys.executable, "-m", "ffr.cli", "edge", "run", "--credential", str(credential),
                                      "--data", str(folder), "--home", str(work / f"{name}_home"), "--exit-when-done"],
                                     stdout=subprocess.DEVNULL, stderr=open(work / f"{name}.log", "w")))
    for process in [*runs, serve]:
        process.wait(timeout=3 * 3600)
    scores = {"shipped": _eval(Path(__file__).parents[1] / "models" / "weights" / "face_embedder.safetensors", unseen)}
    for version in sorted((state / "models").glob("v*.safetensors"))[1:]:
        scores[f"global {version.stem}"] = _eval(version, unseen)
    choices = {}
    for name in devices:
        home = work / f"{name}_home" / "models"
        for kind in ("generic", "personalised"):
            if (home / f"{kind}.onnx").exists():
                scores[f"{name} {kind}.onnx"] = _eval(home / f"{kind}.onnx", unseen)
        lines = [line for line in (work / f"{name}.log").read_text().splitlines() if "own people TAR" in line]
        choices[name] = [re.sub(r"^.*?: ", "", line) for line in lines]
    strangers = {name: strangers_let_in(work / f"{name}_home", devices[name], unseen) for name in devices}
    shipped = write_default_onnx(work / "shipped.onnx")
    start = {name: start_door(work / f"{name}_home", devices[name], unseen, shipped) for name in devices}
    return {"scores": scores, "choices": choices, "strangers": strangers, "strangers_start": start,
            "people_per_device": PEOPLE_PER_DEVICE,
            "unseen_people": UNSEEN, "rounds": coordinator_rounds(state),
            "gate": next((re.sub(r"^.*?(quality gate)", r"\1", line) for line in
                          (work / "serve.log").read_text().splitlines() if "quality gate" in line), "none")}


def coordinator_rounds(state: Path) -> list[dict]:
    """Each round as the coordinator recorded it: published or rolled back and why, its step, its gate's figures."""
    from coordinator.store import Store

    keep = ("server_step", "gate_far_current", "gate_far_candidate", "gate_far_limit", "gate_auc_current",
            "gate_auc_candidate")
    return [{"round": r["round_id"], "status": r["status"], "reason": r.get("reason") or "",
             **{k: r["metrics"][k] for k in keep if k in r["metrics"]}} for r in Store(state).rounds()]


@functools.cache
def _crops(folder: Path):
    """A folder's faces cropped as the doors are scored (once: each is scored at the start and now)."""
    from models.faces.crops import CropConfig, crop_index
    from models.faces.datasets import load_index

    return crop_index(load_index(folder), CropConfig(detector="auto", fallback_center=True), progress=False)


def _sealed(home_dir: Path):
    """A device home, its vault and its sealed settings (checked against the vault's key as they are read)."""
    from edge_client.home import DeviceHome
    from edge_client.recognizer import Settings
    from edge_client.vault import Vault

    home = DeviceHome(home_dir)
    vault = Vault.open(home.root / "store")
    return home, vault, Settings.load(home, vault)


def strangers_let_in(home_dir: Path, people: Path, unseen: Path) -> dict:
    """What the device's door does with strangers after the run: the model it verifies with and its calibration (its
    sealed settings), scored by `door_scores`."""
    from edge_client.recognizer import current_model

    home, vault, settings = _sealed(home_dir)
    return door_scores(current_model(home, vault), settings.calibration, _crops(people), _crops(unseen))


def start_door(home_dir: Path, people: Path, unseen: Path, shipped: Path) -> dict:
    """The door the device would have had before the federation, for start -> now: the shipped model calibrated as a
    round calibrates a device that never was (`verifier_choice.calibrated`: the FAR it promises by default, the
    quarter of its people's images it judges on, the public faces it was served, no shift floor yet), scored by
    `door_scores`. Tells whether a stranger let in at the end was let in before the federation too."""
    from edge_client.door_calibration import received_public_set
    from edge_client.verifier_choice import DEFAULT_FAR, calibrated, check_split
    from models.public_set import load_public_set

    home, _, settings = _sealed(home_dir)
    served = received_public_set(home, settings.public_set)  # the one its last round calibrated on, by its hash
    negatives = None if served is None else load_public_set(served, settings.public_set).images
    own = _crops(people)
    calibration = calibrated(shipped, DEFAULT_FAR, own.images, own.labels, negatives, check_split(own.labels), 0.0)
    return door_scores(shipped, calibration, own, _crops(unseen))


def door_scores(model: Path, cal, own, others) -> dict:
    """A door's strangers: each of the device's people's template (`template_of`, as the device makes it) and every
    photo of the people no device holds scored against each, at that person's threshold (`cal.thresholds_for`: the
    device's, and each person's own); `far`: the share of those scores above it, against the FAR promised, and how
    many strangers' photos match someone."""
    import numpy as np

    from edge_client.recognizer import normalise, template_of
    from models.runtime import OnnxEmbedder

    embedder = OnnxEmbedder(model)
    mine = normalise(embedder.embed(own.images))
    templates = np.stack([template_of(mine[own.labels == k]) for k in np.unique(own.labels)])
    scores = normalise(embedder.embed(others.images)) @ templates.T
    each = cal.thresholds_for(templates)  # each person's own, as the device decides (`edge_client.person_threshold`)
    above = scores > each
    pairs = {f"{others.identities[s]} as {own.identities[p]}": int(np.sum(above[others.labels == s, i]))
             for s in np.unique(others.labels) for i, p in enumerate(np.unique(own.labels))}
    return {"model": model.name, "threshold": cal.threshold, "person_thresholds": [round(float(t), 4) for t in each],
            "far_promised": cal.far_target,
            "far": float(above.mean()), "strangers_photos": int(len(others.images)),
            "photos_matching_someone": int(above.any(axis=1).sum()),
            "matches": {pair: n for pair, n in sorted(pairs.items(), key=lambda kv: -kv[1]) if n}}


def _public_set(faces: Path, limit: int, work: Path) -> Path:
    """The operator's public set file, made from `faces` by the real CLI."""
    out = work / "public.safetensors"
    made = _ffr("edge", "public-set", "--data", str(faces), "--out", str(out), "--limit", str(limit))
    if made.returncode != 0:
        raise RuntimeError(made.stderr)
    return out


def _empty(folder: Path) -> Path:
    """A new folder for `--work`, refused if it holds anything (a run's homes and state must not mix)."""
    if folder.exists() and any(folder.iterdir()):
        raise SystemExit(f"--work {folder} is not empty: give a new folder")
    folder.mkdir(parents=True, exist_ok=True)
    return folder.resolve()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", type=Path, help="labelled faces (default: $FFR_FACES_DIR/celeba_subset)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--name", type=result_name, default="two_device_serve")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--server-step", help="passed to `ffr coordinator serve` (default: its own)")
    p.add_argument("--public-faces", type=Path,
                   help="unlabelled faces of nobody's people made into the coordinator's --public-set (default: none)")
    p.add_argument("--public-limit", type=int, default=2000, help="at most this many of them (default 2000)")
    p.add_argument("--work", type=Path, help="keep the run's folders here (the coordinator's state, the devices' "
                   "homes and logs) for a look afterwards (default: a temporary folder, removed)")
    args = p.parse_args(argv)
    data = face_set(args.data)
    if data is None:
        print("no labelled faces: set FFR_FACES_DIR or give --data", file=sys.stderr)
        return 2
    extra = ["--server-step", args.server_step] if args.server_step else []
    with contextlib.nullcontext(str(_empty(args.work))) if args.work else \
            tempfile.TemporaryDirectory(prefix="ffr-serve-") as tmp:
        if args.public_faces is not None:
            extra += ["--public-set", str(_public_set(args.public_faces, args.public_limit, Path(tmp)))]
        result = run(data, Path(tmp), args.rounds, extra)
    command = "python -m bench.two_device_serve " + " ".join(argv if argv is not None else sys.argv[1:])
    table = [{"model": name, **{k: v for k, v in s.items() if k != "error"}, "error": " ".join(s.get("error", []))}
             for name, s in result["scores"].items()]
    md = write_results(args.out, args.name, result, table,
                       "`ffr coordinator serve` at its defaults"
                       + (f" with a public set of {args.public_limit} faces" if args.public_faces else "")
                       + f", two devices of {PEOPLE_PER_DEVICE} CelebA people; "
                       f"{UNSEEN} people no device holds", command)
    doors = ["", "Each device's door at the start (the shipped model, calibrated as a device's first round calibrates: "
             "its judged images and the public faces it was served) and after the run (the model it verifies with): "
             "its threshold and its people's own (the device's, raised for a person whom strangers resemble), and the "
             "photos of the people no device holds scored against each of its people's templates, each at that "
             "person's threshold.", "",
             "| device | door | model | threshold | people's thresholds | FAR promised | FAR on strangers | strangers' "
             "photos matching someone | which stranger as whom (photos) |", "|---|---|---|---|---|---|---|---|---|"]
    for name, now in result["strangers"].items():
        for when, s in (("start", result.get("strangers_start", {}).get(name)), ("now", now)):
            if s is None:  # a result from before the start door was scored
                continue
            matches = ", ".join(f"{pair}: {n}" for pair, n in s["matches"].items()) or "none"
            each = s.get("person_thresholds") or [s["threshold"]]  # a result from before each person's threshold
            doors.append(f"| {name} | {when} | {s['model']} | {s['threshold']:.3f} | {min(each):.3f} - "
                         f"{max(each):.3f} | {s['far_promised']:g} | {s['far']:.4f} | "
                         f"{s['photos_matching_someone']} of {s['strangers_photos']} | {matches} |")
    doors += ["", f"The coordinator's rounds ({result['gate']}):", ""]
    doors += [f"- round {r['round']}: {r['status']}" + (f" ({r['reason']})" if r["reason"] else "")
              + "".join(f", {k} {v:.4g}" for k, v in r.items() if k not in ("round", "status", "reason"))
              for r in result["rounds"]]
    doors += ["", "The devices' own log lines (own people: a quarter of each person's images, held out of the "
              "personalised fit):", ""]
    doors += [f"- {name}: {line}" for name, lines in result["choices"].items() for line in lines]
    md.write_text(md.read_text() + "\n".join(doors) + "\n")
    for name, lines in result["choices"].items():
        print(f"{name}:", *lines, f"strangers at the start: {result['strangers_start'][name]}",
              f"strangers now: {result['strangers'][name]}", sep="\n  ")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

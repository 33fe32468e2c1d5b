"""`ffr device`: enrol and verify through OpenCV's real capture path, the encrypted store, every bad input.

The videos are written by the test with cv2.VideoWriter from real face photos (ORL in
../shared/faces): no camera exists on CI machines. The model is the shipped face-pretrained
embedder, built as ONNX by `install-model --default` with torch blocked: what a fresh device has.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import cv2
import numpy as np
import pytest

from edge_client.vault import Vault

PEOPLE = ["s1", "s2", "s3", "s4"]


def frame_from(photo: Path, scale: float = 3.0) -> np.ndarray:
    """A 640x480 camera-like frame with the face photo in the middle."""
    img = cv2.imread(str(photo))
    img = cv2.resize(img, None, fx=scale, fy=scale, interpolation=cv2.INTER_LINEAR)
    canvas = np.full((480, 640, 3), 96, np.uint8)
    h, w = img.shape[:2]
    y0, x0 = (480 - h) // 2, (640 - w) // 2
    canvas[y0:y0 + h, x0:x0 + w] = img
    return canvas


def write_video(path: Path, frames: list[np.ndarray], fps: int = 10) -> Path:
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"MJPG"), fps, (640, 480))
    assert writer.isOpened(), "OpenCV cannot write MJPG videos here"
    for f in frames:
        writer.write(f)
    writer.release()
    return path


@pytest.fixture(scope="module")
def videos(faces_dir, tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """Per person: an enrolment video (photos 1-5) and a probe video (photos 6-10)."""
    root = tmp_path_factory.mktemp("videos")
    out = {}
    for person in PEOPLE:
        photos = sorted((faces_dir / "orl" / person).iterdir())
        enrol = write_video(root / f"{person}_enrol.avi", [frame_from(p) for p in photos[:5] for _ in range(2)])
        probe = write_video(root / f"{person}_probe.avi", [frame_from(p) for p in photos[5:10]])
        out[person] = (enrol, probe)
    return out


def ffr(*args: str) -> tuple[int, str, str]:
    """The real CLI in a subprocess whose Python cannot import torch (the device path must not need it)."""
    code = ("import sys; sys.modules['torch'] = None; from ffr.cli import main; sys.exit(main(sys.argv[1:]))")
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    return proc.returncode, proc.stdout, proc.stderr


@pytest.fixture(scope="module")
def home(tmp_path_factory, videos) -> Path:
    home = tmp_path_factory.mktemp("device") / "home"
    rc, out, err = ffr("device", "install-model", "--home", str(home), "--default", "--json")
    assert rc == 0, err
    assert json.loads(out)["installed"].endswith("generic.onnx")
    for person in PEOPLE[:3]:
        rc, out, err = ffr("device", "enroll", "--home", str(home), "--name", person, "--video", str(videos[person][0]),
                           "--json")
        assert rc == 0, err
        assert json.loads(out)["faces_kept"] == 5
        assert json.loads(out)["faces_aligned"] == 5  # YuNet's landmarks -> the five-point template, torch blocked
    rc, out, err = ffr("device", "calibrate", "--home", str(home), "--far", "0.001", "--json")
    assert rc == 0, err
    return home


def test_enrolled_person_verifies_and_another_does_not(home, videos):
    rc, out, err = ffr(
        "device", "verify", "--home", str(home), "--name", "s1", "--video", str(videos["s1"][1]), "--json"
    )
    result = json.loads(out)
    assert rc == 0 and result["match"] is True, (out, err)
    assert result["score"] > result["threshold"] and result["latency_ms"] > 0
    rc, out, err = ffr(
        "device", "verify", "--home", str(home), "--name", "s1", "--video", str(videos["s4"][1]), "--json"
    )
    assert rc == 1 and json.loads(out)["match"] is False, (out, err)


def test_identify_names_the_enrolled_and_calls_a_stranger_unknown(home, videos):
    rc, out, _ = ffr("device", "identify", "--home", str(home), "--video", str(videos["s2"][1]), "--json")
    assert rc == 0 and json.loads(out)["identity"] == "s2"
    rc, out, _ = ffr("device", "identify", "--home", str(home), "--video", str(videos["s4"][1]), "--json")
    assert rc == 1 and json.loads(out)["identity"] == "unknown"


def test_store_holds_no_plaintext_images_or_templates(home):
    from edge_client.vault import Vault

    vault = Vault.open(home / "store")
    files = list((home / "store" / "people").glob("*.person"))
    assert len(files) == 3 and oct((home / "store" / "store.key").stat().st_mode)[-3:] == "600"
    blobs = b"".join(f.read_bytes() for f in files)
    for person in vault.people():
        assert person.crops[0].tobytes()[:64] not in blobs
        assert person.template.astype("<f4").tobytes()[:16] not in blobs
        assert f'"name": "{person.name}"'.encode() not in blobs and b"model_sha256" not in blobs
        assert not any(person.name in f.name for f in files)
        assert b"\x89PNG\r\n\x1a\n" not in blobs  # nor any image file


def test_a_fresh_home_gets_the_shipped_model_on_first_use(tmp_path, videos):
    home = tmp_path / "fresh"
    rc, out, err = ffr(
        "device", "enroll", "--home", str(home), "--name", "s1", "--video", str(videos["s1"][0]), "--json"
    )
    assert rc == 0, err
    assert (home / "models" / "generic.onnx").is_file() and json.loads(out)["model"].endswith("generic.onnx")


def test_list_remove_and_templates_follow_a_new_model(tmp_path, home, videos):
    import shutil

    from edge_client.vault import Vault

    copy = tmp_path / "home"
    shutil.copytree(home, copy)
    rc, out, _ = ffr("device", "list", "--home", str(copy), "--json")
    assert rc == 0 and [p["name"] for p in json.loads(out)["people"]] == ["s1", "s2", "s3"]
    rc, out, _ = ffr("device", "remove", "--home", str(copy), "--name", "s3")
    assert rc == 0
    rc, out, err = ffr("device", "verify", "--home", str(copy), "--name", "s3", "--video", str(videos["s3"][1]))
    assert rc == 2 and "unknown name 's3'" in err
    # a new model (as a federated round delivers): the templates are recomputed from the stored crops
    import torch

    from models.networks.face_model import FaceModel, ModelConfig
    from models.networks.onnx_export import export_onnx

    torch.manual_seed(1)
    export_onnx(FaceModel(ModelConfig(n_classes=2, pretrained=False)), tmp_path / "new.onnx", personalised=False)
    rc, out, err = ffr("device", "install-model", "--home", str(copy), "--model", str(tmp_path / "new.onnx"), "--json")
    assert rc == 0 and json.loads(out)["templates_recomputed"] == 2, err
    new_sha = json.loads(out)["sha256"]
    assert all(p.model_sha256 == new_sha for p in Vault.open(copy / "store").people())


@pytest.mark.parametrize("case", ["no camera", "unreadable file", "no face", "several faces", "unknown name",
                                  "missing model", "corrupted store", "wrong key"])
def test_bad_input_is_a_clear_error(case, tmp_path, home, videos, faces_dir):
    import shutil

    copy = tmp_path / "home"
    shutil.copytree(home, copy)
    source = ["--video", str(videos["s1"][1])]
    env_key = None
    expected = {"no camera": "no camera at index 7", "unreadable file": "cannot read image file",
                "no face": "no usable face", "several faces": "faces in the frame", "unknown name": "unknown name",
                "missing model": "no model in", "corrupted store": "corrupted or was tampered with",
                "wrong key": "wrong key"}[case]
    name = "s1"
    if case == "no camera":
        source = ["--camera", "7"]
    elif case == "unreadable file":
        (tmp_path / "broken.jpg").write_bytes(b"not an image")
        source = ["--image", str(tmp_path / "broken.jpg")]
    elif case == "no face":
        cv2.imwrite(str(tmp_path / "wall.png"), np.full((480, 640, 3), 128, np.uint8))
        source = ["--image", str(tmp_path / "wall.png")]
    elif case == "several faces":
        a, b = frame_from(sorted((faces_dir / "orl" / "s1").iterdir())[0], 2.0), \
            frame_from(sorted((faces_dir / "orl" / "s2").iterdir())[0], 2.0)
        both = np.concatenate([a[:, 160:480], b[:, 160:480]], axis=1)
        # a door decides for one person in view (a photo file is answered per face instead: the per-file test)
        source = ["--video", str(write_video(tmp_path / "two.avi", [both] * 3))]
    elif case == "unknown name":
        name = "nobody"
    elif case == "missing model":  # no model installed, and the shipped weights are gone too
        for f in (copy / "models").glob("*.onnx"):
            f.unlink()
        os.environ["FFR_FACE_WEIGHTS"] = str(tmp_path / "gone.safetensors")
    elif case == "corrupted store":  # the person's own record is damaged: refused, and named
        for victim in (copy / "store" / "people").glob("*.person"):
            data = bytearray(victim.read_bytes())
            data[-20] ^= 0xFF
            victim.write_bytes(bytes(data))
        name, expected = "s2", "s2's record"
        source = ["--video", str(videos["s2"][1])]
    elif case == "wrong key":
        env_key = "11" * 32
    env_args = ["verify", "--name", name]
    if env_key:
        os.environ["FFR_STORE_KEY"] = env_key
    try:
        rc, out, err = ffr("device", *env_args, "--home", str(copy), *source)
    finally:
        os.environ.pop("FFR_STORE_KEY", None)
        os.environ.pop("FFR_FACE_WEIGHTS", None)
    assert rc == 2, (out, err)
    assert expected in err, err
    assert "WARN" not in err and "ERROR:" not in err, err  # OpenCV's own lines are kept out (the camera case)
    assert err.strip().splitlines()[-1].startswith("ffr device verify: error: "), err


def test_a_damaged_record_is_named_and_does_not_hide_the_others(tmp_path, home, videos):
    import shutil

    copy = tmp_path / "home"
    shutil.copytree(home, copy)
    victim = Vault.open(copy / "store")._path("s1")
    data = bytearray(victim.read_bytes())
    data[-20] ^= 0xFF
    victim.write_bytes(bytes(data))
    rc, out, err = ffr("device", "list", "--home", str(copy))
    assert rc == 0 and "s2:" in out and "s3:" in out and "s1:" not in out and "1 damaged" in out, (out, err)
    warning = [line for line in err.splitlines() if "warning" in line]
    assert len(warning) == 1 and "s1's record" in warning[0] and "ffr device remove --name s1" in warning[0], err
    rc, out, err = ffr("device", "identify", "--home", str(copy), "--video", str(videos["s2"][1]), "--json")
    assert rc == 0 and json.loads(out)["identity"] == "s2" and len(json.loads(out)["damaged"]) == 1, (out, err)


def test_unreadable_files_in_an_enrolment_folder_are_named(tmp_path, home, faces_dir):
    import shutil

    copy = tmp_path / "home"
    shutil.copytree(home, copy)
    folder = tmp_path / "photos"
    folder.mkdir()
    for i, photo in enumerate(sorted((faces_dir / "orl" / "s5").iterdir())[:4]):
        cv2.imwrite(str(folder / f"{i}.jpg"), frame_from(photo))
    whole = (folder / "0.jpg").read_bytes()
    (folder / "cut.jpg").write_bytes(whole[: len(whole) * 3 // 4])  # libjpeg alone would decode the top part
    (folder / "notes.jpg").write_text("not an image")
    rc, out, err = ffr("device", "enroll", "--home", str(copy), "--name", "s5", "--images", str(folder), "--best", "2")
    assert rc == 0, err
    assert "cut.jpg: skipped: truncated JPEG" in err and "notes.jpg: skipped: not a decodable image" in err, err
    assert "unreadable image': 2" in out, out
    rc, out, err = ffr("device", "verify", "--home", str(copy), "--name", "s5", "--image", str(folder / "cut.jpg"))
    assert rc == 2 and err.strip().splitlines()[-1] == (f"ffr device verify: error: cannot read image file "
                                                        f"{folder / 'cut.jpg'}: truncated JPEG (the file ends "
                                                        "before its end-of-image marker)"), err
    assert "Premature end" not in err


@pytest.mark.parametrize("content,problem", [(b'{"device_id": 5, "token": []}', "device_id: input should be"),
                                             (b"garbage", "not JSON")])
def test_a_garbage_credential_is_one_line(tmp_path, content, problem):
    (tmp_path / "cred.json").write_bytes(content)
    proc = subprocess.run([sys.executable, "-m", "ffr", "edge", "run", "--credential", str(tmp_path / "cred.json"),
                           "--data", str(tmp_path), "--home", str(tmp_path / "home")], capture_output=True, text=True,
                          timeout=300)  # the daemon trains, so torch may load here
    rc, err = proc.returncode, proc.stderr
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert problem in err and "pydantic" not in err and "input_value" not in err, err


@pytest.mark.parametrize("fault, problem", [
    ("home is a file", "is a file; give a folder for the device's private state"),
    ("damaged registration", "registered.json is damaged or was not written by ffr-edge"),
    ("damaged signing key", "device_ed25519.pem is damaged or not an unencrypted PEM private key"),
    ("foreign public set", "is not a public set file (make one with `ffr edge public-set`)"),
    ("damaged rounds log", "rounds.json is damaged or was not written by ffr-edge")])
def test_damaged_home_files_and_a_wrong_public_set_stop_edge_run_in_one_line(tmp_path, faces_dir, fault, problem):
    """What `ffr edge run` reads back from its home, or the operator's --public-set, is refused at start, named."""
    credential, home, extra = tmp_path / "dev.cred", tmp_path / "home", []
    assert subprocess.run([sys.executable, "-m", "ffr", "-q", "coordinator", "admit", "--state", str(tmp_path / "s"),
                           "--device-id", "dev0", "--out", str(credential), "--broker", "mqtt://127.0.0.1:1"],
                          timeout=120).returncode == 0
    home.mkdir()
    if fault == "home is a file":
        home.rmdir()
        home.write_text("not a folder")
    elif fault == "damaged registration":
        (home / "registered.json").write_text('{"token": ')
    elif fault == "damaged rounds log":
        (home / "rounds.json").write_text('[{"round": "one"}]')
    elif fault == "damaged signing key":
        (home / "device_ed25519.pem").write_text("-----BEGIN PRIVATE KEY-----\ngarbage\n")
    else:
        (tmp_path / "set.safetensors").write_bytes(b"\x08" + b"\0" * 7 + b"{}garbage")
        extra = ["--public-set", str(tmp_path / "set.safetensors")]
    proc = subprocess.run([sys.executable, "-m", "ffr", "-q", "edge", "run", "--credential", str(credential),
                           "--data", str(faces_dir / "orl"), "--home", str(home), "--detector", "none", *extra],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert problem in proc.stderr and "unexpected" not in proc.stderr, proc.stderr


def test_vault_refuses_swapped_files_and_ignores_half_written_ones(tmp_path, monkeypatch):
    from edge_client.vault import Vault, VaultError, new_person

    monkeypatch.delenv("FFR_STORE_KEY", raising=False)
    vault = Vault.open(tmp_path / "store")
    crops = np.random.default_rng(0).integers(0, 255, (2, 8, 8, 3), dtype=np.uint8)
    for name in ("ann", "bob"):
        vault.put(new_person(name, crops, np.ones(4), "sha"))
    # a crash mid-write leaves only a temporary file beside the records: it is never read
    (tmp_path / "store" / "people" / ".x.person.tmp123").write_bytes(b"half")
    assert vault.names() == ["ann", "bob"]
    ann, bob = vault._path("ann"), vault._path("bob")
    bob.write_bytes(ann.read_bytes())  # ann's record put under bob's name: its associated data no longer fits
    with pytest.raises(VaultError, match="tampered"):
        vault.get("bob")
    monkeypatch.setenv("FFR_STORE_KEY", "ab" * 32)
    with pytest.raises(VaultError, match="wrong key"):
        Vault.open(tmp_path / "store")
    monkeypatch.setenv("FFR_STORE_KEY", "too-short")
    with pytest.raises(VaultError, match="32-byte key"):
        Vault.open(tmp_path / "store")


@pytest.mark.parametrize("name, problem", [("", "must not be empty"), (" s9", "start or end with a space"),
                                           ("../s9", "letters, digits"), ("s\x1b[31m9", "letters, digits"),
                                           ("s9\nroot", "letters, digits"), ("...", "letters, digits"),
                                           ("s" * 65, "at most 64")])
def test_a_new_name_that_would_garble_the_output_is_refused_in_one_line(tmp_path, home, videos, name, problem):
    """Every command prints the name and writes it to JSON: no escapes, newlines or empty names get in."""
    rc, out, err = ffr("device", "enroll", "--home", str(tmp_path / "h"), "--name", name,
                       "--video", str(videos["s4"][0]))
    assert rc == 2 and problem in err, err
    assert len(err.strip().splitlines()) == 1 and err.startswith("ffr device enroll: error: argument --name: ")
    assert not (tmp_path / "h" / "store").exists()  # refused before the home is touched


def test_names_in_other_scripts_and_with_apostrophes_are_enrolled(tmp_path):
    """The library's own check (the CLI's type is the same function) lets real names through."""
    from edge_client.vault import check_person_name, new_person

    for name in ("Zoë O'Brien-Smith", "李雷", "J. R. R. Tolkien_2"):
        assert check_person_name(name) == name
    with pytest.raises(ValueError, match="letters, digits"):
        new_person("a\tb", np.zeros((1, 3, 8, 8), np.uint8), np.zeros(4, np.float32), "0" * 64)


def test_a_damaged_pending_update_is_dropped_not_resent_and_stray_files_are_left(tmp_path):
    """pending/ is read back after every reconnect, on paho's thread: a damaged header must not stop the device."""
    from coordinator.admission import admit
    from edge_client.home import DeviceHome
    from edge_client.link import CoordinatorLink

    credential = admit(tmp_path / "state", "dev0", "mqtt://127.0.0.1:1")
    home = DeviceHome(tmp_path / "home")
    pending = home.root / "pending"
    (pending / "round3.json").write_text('{"header": {"round_id": "x"}, "chunk_bytes": 1024}')
    (pending / "round3.safetensors").write_bytes(b"update")
    (pending / "round4.json").write_text("{not json")
    (pending / "roundabout.txt").write_text("someone else's file")
    link = CoordinatorLink(credential, home, on_body=lambda body: None, hello_facts=dict)
    sent = []
    link.send_update = lambda *args: sent.append(args)  # nothing valid is pending, so nothing may be sent
    link.resend_pending()
    link.drop_stale_pending(current_round=10)
    assert sent == [] and sorted(p.name for p in pending.iterdir()) == ["roundabout.txt"]


@pytest.mark.parametrize("content", ["damaged", "other shapes"])
def test_a_damaged_private_part_is_skipped_with_a_warning_not_every_round(tmp_path, caplog, content):
    """The head and DFC branch a device saved are read back each time its model is built: a damaged file or one
    of other shapes costs that personalisation (said in the log), not the rounds that follow."""
    from types import SimpleNamespace

    import torch
    from safetensors.torch import save_file

    from edge_client.home import DeviceHome
    from edge_client.round_work import RoundWork
    from protocol.messages import TrainingConfig

    home = DeviceHome(tmp_path / "home")
    runner = RoundWork(home, lambda: SimpleNamespace(identities=["a", "b", "c"]), public=None, seed=0,
                       device_id="dev0")
    job = SimpleNamespace(config=TrainingConfig(width_mult=0.35, dfc=True))
    if content == "damaged":
        home.private_state.write_bytes(b"\x10\0\0\0\0\0\0\0{cut")
    else:
        like = {k: torch.zeros(1) for k in runner.ensure_model(job).state_dict() if k.startswith(("head", "dfc"))}
        runner.model = None
        save_file(like, str(home.private_state))
    with caplog.at_level("WARNING", logger="edge_client"):
        model = runner.ensure_model(job)
    assert model is not None and "head_and_dfc.safetensors is not used" in caplog.text, caplog.text


def test_a_round_trains_the_same_update_from_the_same_seed_whatever_the_process_drew_before(tmp_path):
    """torch's global generator draws the private head's and DFC branch's first weights and some augmentations; a
    round seeds it from the device's seed and gives it back as it was, so a round repeats (before: two runs of one
    round sent different updates) and the devices of one simulation process do not draw from each other's stream."""
    from types import SimpleNamespace

    import torch

    from edge_client.home import DeviceHome
    from edge_client.round_work import RoundWork
    from models.faces.crops import CropReport, FaceCrops
    from models.networks.face_model import FaceModel, ModelConfig, shareable_state
    from protocol.messages import TrainingConfig

    rng = np.random.default_rng(0)
    crops = FaceCrops(rng.integers(0, 256, (12, 112, 112, 3), dtype=np.uint8), np.repeat(np.arange(3), 4),
                      ["a", "b", "c"], [""] * 12, CropReport())
    config = TrainingConfig(width_mult=0.35, dfc=True, epochs=1, batch_size=4, dfc_steps=3)
    torch.manual_seed(5)
    start = shareable_state(FaceModel(ModelConfig(embedding_dim=128, width_mult=0.35, n_classes=3, pretrained=False)))
    job = SimpleNamespace(config=config, round_id=1, model_version=0)

    def round_(name: str, seed: int):
        work = RoundWork(DeviceHome(tmp_path / name), lambda: crops, SimpleNamespace(for_round=lambda cfg: None),
                         seed=seed, device_id=name)
        work._global = {k: v.clone() for k, v in start.items()}  # as `judge` keeps the announced model
        before = torch.random.get_rng_state()
        trained = work.train(job, None)
        assert torch.equal(torch.random.get_rng_state(), before), "the process's generator is given back"
        return trained.sha256, {k: v.clone() for k, v in work.model.state_dict().items() if k.startswith("dfc")}

    first = round_("a", seed=7)
    torch.rand(1000)  # whatever the process drew meanwhile
    again, other = round_("b", seed=7), round_("c", seed=8)
    assert first[0] == again[0] and all(torch.equal(first[1][k], again[1][k]) for k in first[1])
    assert first[0] != other[0]


@pytest.mark.parametrize("source, says", [
    (["--camera", "-1"], "argument --camera: must be at least 0 (got -1)"),  # OpenCV's "any camera": a segfault here
    (["--video", "FOLDER"], "is a folder: give a video file, or --images for a folder of images"),
    (["--video", "NOT_A_VIDEO"], "gave no frames")])
def test_a_bad_capture_source_is_one_line_without_decoder_noise(tmp_path, home, source, says):
    """Before: `--camera -1` crashed the process (exit 139), and a file that is no video let FFmpeg print its own
    '[mjpeg @ 0x...] No JPEG data found' lines above the error."""
    (tmp_path / "clip.avi").write_bytes(b"\xff\xd8 not a video at all")
    source = [{"FOLDER": str(tmp_path), "NOT_A_VIDEO": str(tmp_path / "clip.avi")}.get(a, a) for a in source]
    rc, out, err = ffr("-q", "device", "verify", "--home", str(home), "--name", "s1", *source)
    assert rc == 2 and says in err and len(err.strip().splitlines()) == 1, err


def test_compare_answers_for_two_image_files_without_a_home(tmp_path, faces_dir):
    """`ffr device compare IMG1 IMG2`: no home, no enrolment, the shipped model; a group photo is answered for its
    largest face and says how many it found; exit 0 the same person, 1 not, 2 an error."""
    photos = {p: sorted((faces_dir / "orl" / p).iterdir()) for p in ("s1", "s2")}
    a, b, other = tmp_path / "a.png", tmp_path / "b.png", tmp_path / "other.png"
    cv2.imwrite(str(a), frame_from(photos["s1"][0]))
    cv2.imwrite(str(b), frame_from(photos["s1"][1]))
    group = frame_from(photos["s2"][0])
    small = cv2.resize(cv2.imread(str(photos["s1"][2])), None, fx=1.5, fy=1.5)
    group[10:10 + small.shape[0], 10:10 + small.shape[1]] = small  # a smaller second face in the corner
    cv2.imwrite(str(other), group)
    rc, out, err = ffr("device", "compare", str(a), str(b), "--json")
    same = json.loads(out)
    assert rc in (0, 1) and same["model"] == "the shipped model" and same["threshold_note"].startswith("uncalibrated")
    assert [i["faces_found"] for i in same["images"]] == [1, 1] and all(len(i["box"]) == 4 for i in same["images"])
    rc, out, err = ffr("device", "compare", str(a), str(other), "--json")
    different = json.loads(out)
    assert different["images"][1]["faces_found"] == 2, different
    assert same["score"] > different["score"]
    middle = f"{(same['score'] + different['score']) / 2:.4f}"
    rc, out, err = ffr("device", "compare", str(a), str(b), "--threshold", middle)
    assert rc == 0 and out.startswith("SAME PERSON: score") and "given with --threshold" in out, (out, err)
    rc, out, err = ffr("device", "compare", str(a), str(other), "--threshold", middle)
    assert rc == 1 and out.startswith("DIFFERENT PEOPLE") and "2 face(s), the largest used" in out, (out, err)
    rc, out, err = ffr("device", "compare", str(a), str(tmp_path / "missing.png"))
    assert rc == 2 and err == f"ffr device compare: error: image file not found: {tmp_path / 'missing.png'}\n"
    assert not (tmp_path / "home").exists()


def test_a_threshold_given_for_one_call_decides_that_call_only(home, videos):
    rc, out, err = ffr("device", "verify", "--home", str(home), "--name", "s1", "--video", str(videos["s1"][1]),
                       "--threshold", "0.99", "--json")
    result = json.loads(out)
    assert rc == 1 and result["threshold"] == 0.99 and result["threshold_note"] == "given with --threshold", out
    rc, out, err = ffr("device", "identify", "--home", str(home), "--video", str(videos["s4"][1]), "--threshold", "-1")
    assert rc == 0 and "vs threshold -1.000 (given with --threshold)" in out, (out, err)
    rc, out, err = ffr("device", "verify", "--home", str(home), "--name", "s1", "--video", str(videos["s1"][1]))
    assert rc == 0 and "calibrated for FAR 0.001" in out, "the device's own threshold is untouched"
    rc, out, err = ffr("device", "verify", "--home", str(home), "--name", "s1", "--video", "x.avi", "--threshold", "2")
    assert rc == 2 and "a cosine threshold is a number in [-1, 1]" in err


def test_a_redirected_command_draws_no_progress_bar(home, videos):
    """stderr is a pipe here, not a terminal: the one error line alone, no `reading frames` bar before it."""
    rc, out, err = ffr("device", "identify", "--home", str(home), "--images", str(videos["s1"][1].parent / "none"))
    assert rc == 2 and err.count("\n") == 1 and "reading frames" not in err, err
    rc, out, err = ffr("device", "verify", "--home", str(home), "--name", "s1", "--video", str(videos["s1"][1]))
    assert rc == 0 and "\r" not in err and "reading frames" not in err, err


def test_a_folder_is_answered_per_file_and_per_face_and_a_mixed_folder_is_not_enrolled(tmp_path, home, faces_dir):
    """face_recognition's `KNOWN_DIR UNKNOWN_DIR` as users expect it: one line per file (per face in a group photo),
    a summary, and boxes in --json; enrolling a folder of several people under one name is refused, naming the
    files, unless --force; `--from KNOWN_DIR` enrols one person per sub-folder."""
    photos = {p: sorted((faces_dir / "orl" / p).iterdir()) for p in ("s1", "s2", "s3", "s4", "s5", "s6")}
    unknown = tmp_path / "unknown"
    unknown.mkdir()
    for person in ("s1", "s2", "s4"):
        cv2.imwrite(str(unknown / f"{person}.png"), frame_from(photos[person][7]))
    (unknown / "notes.jpg").write_text("not an image")
    rc, out, err = ffr("device", "identify", "--home", str(home), "--images", str(unknown))
    lines = out.strip().splitlines()
    assert lines[0].startswith("notes.jpg: skipped") or any(line.startswith(f"{unknown / 'notes.jpg'}")
                                                            for line in lines), out
    assert any("s1.png: s1 score" in line for line in lines) and any("s2.png: s2 score" in line for line in lines)
    assert any("s4.png: unknown score" in line for line in lines), out
    assert lines[-1].startswith("3 face(s) in 4 file(s): ") and "unknown 1" in lines[-1]
    assert rc == 1, "one face is nobody enrolled"
    rc, out, err = ffr("device", "identify", "--home", str(home), "--images", str(unknown), "--json")
    files = {Path(f["file"]).name: f for f in json.loads(out)["files"]}
    assert files["s1.png"]["faces"][0]["identity"] == "s1" and len(files["s1.png"]["faces"][0]["box"]) == 4
    assert files["s1.png"]["faces"][0]["landmarks"] is not None and "problem" in files["notes.jpg"]
    a, b = frame_from(photos["s1"][8], 2.0), frame_from(photos["s4"][8], 2.0)
    cv2.imwrite(str(tmp_path / "two.png"), np.concatenate([a[:, 160:480], b[:, 160:480]], axis=1))
    rc, out, err = ffr("device", "identify", "--home", str(home), "--images", str(tmp_path / "two.png"))
    faces = [line for line in out.splitlines() if "two.png: face " in line]
    assert len(faces) == 2 and any("s1 score" in line for line in faces), (out, err)
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    for i, person in enumerate(("s4", "s5", "s6", "s4")):
        cv2.imwrite(str(mixed / f"{i}.png"), frame_from(photos[person][i]))
    copy = tmp_path / "home"
    shutil.copytree(home, copy)
    rc, out, err = ffr("device", "enroll", "--home", str(copy), "--name", "crowd", "--images", str(mixed))
    assert rc == 2 and "do not look like the others" in err and "1.png" in err and "--force" in err, err
    known = tmp_path / "known"
    for person in ("s5", "s6"):
        (known / person).mkdir(parents=True)
        for i, photo in enumerate(photos[person][:4]):
            cv2.imwrite(str(known / person / f"{i}.png"), frame_from(photo))
    rc, out, err = ffr("device", "enroll", "--home", str(copy), "--from", str(known))
    assert rc == 0 and out.count("\nenrolled ") + out.startswith("enrolled ") == 2, (out, err)
    rc, out, err = ffr("device", "list", "--home", str(copy), "--json")
    assert {"s5", "s6"} <= {p["name"] for p in json.loads(out)["people"]}, out


def test_a_clip_holding_one_pose_enrols_varied_views_that_recognise_the_person(tmp_path, home, videos, faces_dir):
    """Issue 49's webcam clip: one pose held for many frames used to fill the template with near-identical frames.
    The views kept now come from different poses, and the template is checked on the rest of the clip."""
    photos = sorted((faces_dir / "orl" / "s5").iterdir())
    held = [frame_from(photos[0])] * 20 + [frame_from(p) for p in photos[1:5] for _ in range(3)]
    clip = write_video(tmp_path / "held.avi", held)
    copy = tmp_path / "home"
    shutil.copytree(home, copy)
    rc, out, err = ffr("device", "enroll", "--home", str(copy), "--name", "s5", "--video", str(clip), "--json")
    assert rc == 0, err
    result = json.loads(out)
    frames = [int(name.rsplit(" ", 1)[1]) for name in result["kept"]]
    poses = {0 if f < 20 else 1 + (f - 20) // 3 for f in frames}  # frames are numbered from 0
    assert len(poses) >= 4, (frames, result)
    assert result["rest_checked"] == len(held) - 5 and result["rest_matched"] >= result["rest_checked"] / 2
    probe = tmp_path / "probe"
    probe.mkdir()
    for i, photo in enumerate(photos[5:]):
        cv2.imwrite(str(probe / f"{i}.png"), frame_from(photo))
    rc, out, err = ffr("device", "verify", "--home", str(copy), "--name", "s5", "--images", str(probe), "--threshold",
                       "0.3")
    assert rc == 0, (out, err)


def test_a_coordinators_released_model_installs_on_a_device_from_its_file(tmp_path, videos):
    """`ffr device install-model --model vNNNNN.safetensors`: the coordinator's store writes the backbone state dict
    (keys `backbone.*`); the device builds it as ONNX without torch and verifies with it. A file that is not one is
    a one-line refusal that leaves no half-made model."""
    from coordinator.store import Store
    from models.networks.face_weights import face_global_state

    store = Store(tmp_path / "state")
    store.save_model(2, face_global_state(), 2)
    released = tmp_path / "state" / "models" / "v00002.safetensors"
    home = tmp_path / "home"
    rc, out, err = ffr("device", "install-model", "--home", str(home), "--model", str(released))
    assert rc == 0 and "released global model" in out and out.count("\n") == 1 and "INFO" not in err, (out, err)
    rc, out, err = ffr("device", "enroll", "--home", str(home), "--name", "s1", "--video", str(videos["s1"][0]))
    assert rc == 0, err
    (tmp_path / "bad.safetensors").write_bytes(b"x" * 10)
    rc, out, err = ffr("device", "install-model", "--home", str(home), "--model", str(tmp_path / "bad.safetensors"))
    assert rc == 2 and "is not an ffr-edge face model" in err and err.count("\n") == 1, err
    assert sorted(p.name for p in (home / "models").iterdir()) == ["generic.onnx"]


def test_watch_says_who_comes_and_goes_from_a_video(tmp_path, home, faces_dir):
    """`ffr device watch --video`: headless, one line per arrival and departure, debounced (a single frame of a face
    is no arrival), and everyone still in view leaves at the video's end."""
    photos = {p: sorted((faces_dir / "orl" / p).iterdir()) for p in ("s1", "s4")}
    empty = np.full((480, 640, 3), 96, np.uint8)
    clip = ([frame_from(photos["s1"][6])] * 6 + [empty] * 10 + [frame_from(photos["s4"][6])] + [empty] * 3
            + [frame_from(photos["s4"][7])] * 5)
    rc, out, err = ffr("device", "watch", "--home", str(home), "--video", str(write_video(tmp_path / "door.avi", clip)),
                       "--json")
    assert rc == 0, err
    events = [(e["person"], e["event"]) for e in map(json.loads, out.strip().splitlines())]
    assert events == [("s1", "arrived"), ("s1", "left"), ("unknown", "arrived"), ("unknown", "left")], events
    assert err.strip().splitlines()[-1] == f"stopped after {len(clip)} frame(s)"


EDGE_ONLY = ("torch", "torchvision", "pydantic", "fastapi", "uvicorn", "paho", "sklearn", "mlflow", "matplotlib",
             "ray", "prometheus_client", "dp_accounting")


def edge_only_ffr(*args: str) -> tuple[int, str, str]:
    """The CLI as the `edge` extra alone installs it: every library outside that extra made unimportable in the
    subprocess (a stand-in for a fresh edge-only venv, which would need PyPI from the test; README's install lines
    are the real thing)."""
    code = (f"import sys\nfor m in {EDGE_ONLY!r}: sys.modules[m] = None\n"
            "from ffr.cli import main; sys.exit(main(sys.argv[1:]))")
    proc = subprocess.run([sys.executable, "-W", "error::RuntimeWarning", "-c", code, *args], capture_output=True,
                          text=True, timeout=300)
    return proc.returncode, proc.stdout, proc.stderr


def test_every_device_command_runs_with_the_edge_extra_alone(tmp_path, videos, faces_dir):
    home = str(tmp_path / "home")
    rc, out, err = edge_only_ffr("--help")
    assert rc == 0 and "not installed: needs the coordinator extra" in " ".join(out.split()), (out, err)
    for args in (["install-model", "--home", home, "--default"],
                 ["enroll", "--home", home, "--name", "s1", "--video", str(videos["s1"][0])],
                 ["enroll", "--home", home, "--name", "s2", "--video", str(videos["s2"][0])],
                 ["calibrate", "--home", home],
                 ["verify", "--home", home, "--name", "s1", "--video", str(videos["s1"][1])],
                 ["identify", "--home", home, "--video", str(videos["s2"][1])],
                 ["watch", "--home", home, "--video", str(videos["s1"][1])],
                 ["list", "--home", home], ["remove", "--home", home, "--name", "s2"]):
        rc, out, err = edge_only_ffr("device", *args)
        assert rc == 0 and "Traceback" not in err and "Warning" not in err, (args, out, err)
    photo = str(sorted((faces_dir / "orl" / "s1").iterdir())[0])
    rc, out, err = edge_only_ffr("device", "compare", photo, photo, "--detector", "none")
    assert rc == 0 and out.startswith("SAME PERSON"), (out, err)
    rc, out, err = edge_only_ffr("coordinator", "serve")
    assert rc == 2 and err == ("ffr coordinator: error: `ffr coordinator` needs pydantic, which this install lacks: "
                               "pip install 'ffr-edge[coordinator]'\n"), err


def test_a_50_megapixel_phone_photo_is_decoded_at_a_reduced_scale_not_refused(tmp_path, home, faces_dir):
    photo = sorted((faces_dir / "orl" / "s1").iterdir())[8]
    big = np.full((6150, 8200, 3), 96, np.uint8)  # 50.4 MP, above the 40 MP a PNG may declare
    face = cv2.resize(cv2.imread(str(photo)), None, fx=20, fy=20, interpolation=cv2.INTER_LINEAR)
    big[500:500 + face.shape[0], 3000:3000 + face.shape[1]] = face
    cv2.imwrite(str(tmp_path / "phone.jpg"), big, [cv2.IMWRITE_JPEG_QUALITY, 80])
    del big
    rc, out, err = ffr("device", "identify", "--home", str(home), "--images", str(tmp_path / "phone.jpg"))
    assert rc == 0 and "phone.jpg: s1 score" in out, (out, err)


def test_liveness_refuses_a_printed_photo_and_accepts_a_face_that_turns_as_asked(tmp_path, home, faces_dir):
    """`--liveness`: a seeded challenge of two head turns. The live clip is s4's most frontal photo, then their most
    turned photo on the asked side (or its mirror image: a real head's turn the other way); the attack is that
    frontal photo as a print moved, turned and tilted in front of the camera (`bench.liveness` measures both)."""
    import random

    from bench.liveness import person_poses, printed, turned
    from edge_client.capture import device_detector
    from edge_client.liveness import new_challenge

    photos = sorted((faces_dir / "orl" / "s4").iterdir())
    copy = tmp_path / "home"
    shutil.copytree(home, copy)
    rc, out, err = ffr("device", "enroll", "--home", str(copy), "--name", "s4", "--images",
                       str(faces_dir / "orl" / "s4"), "--force")
    assert rc == 0, err
    challenge = new_challenge(random.Random(7))
    poses = person_poses(device_detector("auto"), photos)
    frontal = min(poses, key=lambda p: abs(p[0]))[1]
    live = [frontal] * 5 + [f for side in challenge for f in [turned(poses, side)] * 3 + [frontal] * 3]
    still = [printed(frontal, i / 59, 0.7, 40) for i in range(60)]
    for name, clip in (("live", live), ("still", still)):
        write_video(tmp_path / f"{name}.avi", clip)
    base = ["device", "verify", "--home", str(copy), "--name", "s4", "--liveness", "--liveness-seed", "7",
            "--threshold", "0.2"]
    rc, out, err = ffr(*base, "--video", str(tmp_path / "live.avi"), "--json")
    result = json.loads(out)
    assert rc == 0 and result["live"] is True and result["liveness"]["challenge"] == challenge, (out, err)
    assert f"liveness: turn your head to the {challenge[0]}, then to the {challenge[1]}" in err
    rc, out, err = ffr(*base, "--video", str(tmp_path / "still.avi"))
    assert rc == 1 and out.startswith("NO MATCH") and "not live" in out, (out, err)
    rc, out, err = ffr(*base, "--images", str(photos[0]))
    assert rc == 2 and "--liveness needs a camera or a video" in err


def test_the_python_api_enrols_identifies_verifies_and_compares(tmp_path, faces_dir):
    """`edge_client.api` as the README shows it: a new home, two people enrolled from files, a group photo answered
    per face, a 1:1 check and a compare; the same home then answers `ffr device list`."""
    from edge_client.api import Device, FaceError, compare

    photos = {p: sorted((faces_dir / "orl" / p).iterdir()) for p in ("s1", "s2", "s4")}
    frames = {}
    for person, files in photos.items():
        for i, photo in enumerate(files):
            frames[person, i] = tmp_path / f"{person}_{i}.png"
            cv2.imwrite(str(frames[person, i]), frame_from(photo))
    door = Device(tmp_path / "home")
    assert door.enrol("s1", [frames["s1", i] for i in range(5)]) == 5
    assert door.enrol("s2", [frames["s2", i] for i in range(5)]) == 5
    assert door.people() == ["s1", "s2"]
    a, b = frame_from(photos["s1"][8], 2.0), frame_from(photos["s4"][8], 2.0)
    group = np.concatenate([a[:, 160:480], b[:, 160:480]], axis=1)
    faces = sorted(door.identify(group, threshold=-1.0), key=lambda f: f.box[0])  # everyone named: the closest
    assert len(faces) == 2 and faces[0].name == "s1", faces  # s1 on the left, s4 (nobody enrolled) on the right
    assert all(len(f.box) == 4 and f.landmarks is not None for f in faces)
    strict = sorted(door.identify(group, threshold=faces[1].score), key=lambda f: f.box[0])
    assert [f.name for f in strict] == ["s1", None] and faces[0].score > faces[1].score
    assert door.verify("s2", frames["s2", 9], threshold=0.3).match
    assert not door.verify("s2", frames["s4", 9], threshold=0.3).match
    same, other = compare(frames["s1", 6], frames["s1", 7]), compare(frames["s1", 6], frames["s4", 7])
    assert same.score > other.score and same.faces[0]["faces_found"] == 1
    with pytest.raises(FaceError, match="image file not found"):
        door.identify(tmp_path / "missing.png")
    rc, out, err = ffr("device", "list", "--home", str(tmp_path / "home"), "--json")
    assert rc == 0 and [p["name"] for p in json.loads(out)["people"]] == ["s1", "s2"], (out, err)


def orl_public_set(faces_dir: Path, tmp_path: Path, people: range = range(20, 40)) -> Path:
    """A public set of ORL people no test enrols (default s20-s39: 40 faces), two photos each."""
    from models.public_set import build_public_set

    folder = tmp_path / "public_faces"
    folder.mkdir(parents=True)
    for person in [f"s{k}" for k in people]:
        for photo in sorted((faces_dir / "orl" / person).iterdir())[:2]:
            shutil.copy(photo, folder / f"{person}_{photo.name}")
    build_public_set(folder, tmp_path / "public.safetensors", limit=100)
    return tmp_path / "public.safetensors"


def test_the_python_api_calibrates_and_installs_models_as_the_commands_do(tmp_path, faces_dir):
    """`Device.calibrate` sets the threshold `ffr device calibrate` would (same people, same strangers' faces), and
    every later answer is decided at it; `Device.install_model` installs a file and refuses one that is not a model."""
    from edge_client.api import Device

    public = orl_public_set(faces_dir, tmp_path)
    door = Device(tmp_path / "home")
    for person in ("s1", "s2", "s3"):
        door.enrol(person, sorted((faces_dir / "orl" / person).iterdir())[:5])
    rc, out, err = ffr("device", "calibrate", "--home", str(tmp_path / "home"), "--far", "0.01", "--public-set",
                       str(public), "--dry-run", "--json")
    assert rc == 0, err
    cal = door.calibrate(far=0.01, public_set=public)
    assert cal.threshold == pytest.approx(json.loads(out)["threshold"]) and cal.impostor_pairs > 100
    probe = sorted((faces_dir / "orl" / "s1").iterdir())[9]
    # decided at s1's own threshold: the device's, raised where the public faces resemble s1
    own = float(cal.thresholds_for(door.recognizer.person("s1").template)[0])
    assert door.verify("s1", probe).threshold == pytest.approx(own) and own >= cal.threshold
    rc, out, err = ffr("device", "list", "--home", str(tmp_path / "home"), "--json")
    assert rc == 0 and json.loads(out)["threshold"] == pytest.approx(cal.threshold), (out, err)
    with pytest.raises(FileNotFoundError, match="model not found"):
        door.install_model(tmp_path / "missing.onnx")
    (tmp_path / "junk.onnx").write_bytes(b"not a model")
    with pytest.raises(ValueError, match="not a usable ffr-edge ONNX model"):
        door.install_model(tmp_path / "junk.onnx")
    assert door.install_model() == tmp_path / "home" / "models" / "generic.onnx" and door.people() == ["s1", "s2", "s3"]


def test_calibration_scores_strangers_from_a_public_set_and_refuses_one_changed_on_disk(home, faces_dir, tmp_path):
    """`calibrate` also scores faces of nobody's people: `--public-set FILE`, else the set the last round calibrated on
    (HOME/public/<sha256>.safetensors, its hash in the sealed settings). A file read back from disk may have been
    planted or changed: one the settings do not name is never taken, and the named one is checked against its hash."""
    from edge_client.home import DeviceHome
    from edge_client.recognizer import Calibration, Settings
    from models.public_set import sha256_of

    public = orl_public_set(faces_dir, tmp_path)
    sha = sha256_of(public)
    base = ("device", "calibrate", "--home", str(home), "--far", "0.01", "--dry-run", "--json")
    rc, out, err = ffr(*base)
    alone = json.loads(out)
    assert rc == 0 and alone["capture_shift"] == 0.0, err
    rc, out, err = ffr(*base, "--public-set", str(public))
    given = json.loads(out)
    assert rc == 0 and given["applied"] is False, err
    assert given["impostor_pairs"] == alone["impostor_pairs"] + 40 * 3  # 40 strangers' faces x 3 templates
    # each enrolled person's own threshold, the device's or above; without strangers' faces, the device's for all
    assert len(given["person_thresholds"]) == 3 and min(given["person_thresholds"].values()) >= given["threshold"]
    assert set(alone["person_thresholds"].values()) == {alone["threshold"]} and "stranger_cov" not in given
    received = home / "public" / f"{sha}.safetensors"
    received.parent.mkdir(exist_ok=True)
    shutil.copy(public, received)
    device, vault = DeviceHome(home), Vault.open(home / "store")
    try:
        rc, out, err = ffr(*base)  # planted: the sealed settings name no public set
        assert rc == 0 and json.loads(out)["impostor_pairs"] == alone["impostor_pairs"], err
        settings = Settings.load(device, vault)
        settings.public_set = sha  # as a round's calibration records the set it was served
        settings.save(device, vault)
        rc, out, err = ffr(*base)
        assert rc == 0 and json.loads(out)["impostor_pairs"] == given["impostor_pairs"], err
        rc, out, err = ffr(*base[:-1])
        assert rc == 0 and f"40 strangers' faces from {received.name}" in out, out
        # the capture shift first measured on the sealed set is the floor of this one, and goes on with it
        # (`verifier_choice.shift_floor`); another set given is measured afresh and keeps no floor
        settings, kept = Settings.load(device, vault), Settings.load(device, vault).calibration
        settings.calibration = Calibration(0.5, 0.01, 0.1, True, 10, 100, "0" * 64, shift_floor=given["capture_shift"]
                                           + 0.25)
        settings.save(device, vault)
        rc, out, err = ffr(*base)
        floored = json.loads(out)
        assert rc == 0 and floored["capture_shift"] == pytest.approx(given["capture_shift"] + 0.25), err
        assert floored["shift_floor"] == pytest.approx(given["capture_shift"] + 0.25)
        assert floored["threshold"] > given["threshold"]
        rc, out, err = ffr(*base, "--public-set", str(orl_public_set(faces_dir, tmp_path / "other", range(20, 30))))
        other = json.loads(out)
        assert rc == 0 and other["shift_floor"] is None and other["capture_shift"] < floored["capture_shift"], err
        settings = Settings.load(device, vault)
        settings.calibration = kept
        settings.save(device, vault)
        received.write_bytes(received.read_bytes()[:-8] + b"changed!")
        rc, out, err = ffr(*base)
        assert rc == 2 and "does not match its sha256" in err, (out, err)
    finally:
        shutil.rmtree(received.parent)
        settings = Settings.load(device, vault)
        settings.public_set = None
        settings.save(device, vault)

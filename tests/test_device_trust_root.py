"""The device's own files are its trust root: a local tamperer gets a clear refusal and exit 2, never a match.

Through the real `ffr device` CLI (torch cannot be imported), on SYNTHETIC faces the tests make.
"""
from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import pytest

from models.faces.imageio import write_image


def ffr(*args: str, env: dict | None = None) -> tuple[int, str, str]:
    code = "import sys; sys.modules['torch'] = None; from ffr.cli import main; sys.exit(main(sys.argv[1:]))"
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONWARNINGS": "ignore", **(env or {})})
    return proc.returncode, proc.stdout, proc.stderr


@pytest.fixture(scope="module")
def people(tmp_path_factory) -> dict[str, Path]:
    """Three SYNTHETIC people, a folder of face photos each (rendered at the detector-free crop size)."""
    from models.faces.synthetic import generate

    root = tmp_path_factory.mktemp("people")
    images, labels = generate(3, 4, seed=21)
    out = {}
    for k in range(3):
        folder = root / f"person{k}"
        folder.mkdir()
        for i, image in enumerate(images[labels == k]):
            write_image(folder / f"{i}.png", image)
        out[f"person{k}"] = folder
    return out


@pytest.fixture
def home(tmp_path, people) -> Path:
    home = tmp_path / "home"
    for k, (name, folder) in enumerate(people.items()):
        command = ("enroll", "enrol")[k % 2]  # the product's own spelling is an alias of the command's
        rc, out, err = ffr("device", command, "--home", str(home), "--name", name, "--images", str(folder),
                           "--detector", "haar", "--min-face", "1", "--min-sharpness", "0")
        assert rc == 0, err
    rc, out, err = ffr("device", "calibrate", "--home", str(home), "--far", "0.1", "--detector", "haar")
    assert rc == 0, err
    return home


def _verify(home: Path, people: dict, claimed: str, probe: str) -> tuple[int, str, str]:
    return ffr("device", "verify", "--home", str(home), "--name", claimed, "--images", str(people[probe]),
               "--detector", "haar", "--min-face", "1", "--min-sharpness", "0", "--frames", "2")


def test_an_untouched_home_still_decides(home, people):
    rc, out, err = _verify(home, people, "person0", "person0")
    assert rc in (0, 1) and ("MATCH" in out), err  # a decision, not an error


def test_an_edited_threshold_is_refused_never_a_match(home, people):
    settings = json.loads((home / "device.json").read_text())
    settings["calibration"]["threshold"] = -1.0
    (home / "device.json").write_text(json.dumps(settings))
    rc, out, err = _verify(home, people, "person0", "person1")
    assert rc == 2 and "MATCH" not in out
    assert "device.json" in err and "seal" in err


def test_a_deleted_settings_file_is_refused(home, people):
    (home / "device.json").unlink()
    rc, out, err = _verify(home, people, "person0", "person1")
    assert rc == 2 and "device.json is missing" in err


def test_a_swapped_model_file_is_refused(home, people, tmp_path):
    import onnx
    from onnx import TensorProto, helper

    model = home / "models" / "generic.onnx"
    constant = helper.make_graph(  # every face -> the same embedding: every impostor would score 1.0
        [helper.make_node("Constant", [], ["embedding"],
                          value=helper.make_tensor("c", TensorProto.FLOAT, [1, 128], [1.0] + [0.0] * 127))],
        "constant", [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["batch", 3, 128, 128])],
        [helper.make_tensor_value_info("embedding", TensorProto.FLOAT, [1, 128])])
    forged = onnx.load(str(model))
    forged.graph.CopyFrom(constant)
    onnx.save(forged, str(model))
    rc, out, err = _verify(home, people, "person0", "person1")
    assert rc == 2 and "MATCH" not in out
    assert "generic.onnx" in err and "sha256" in err


def test_a_removed_person_cannot_be_restored_from_an_old_file(home, people, tmp_path):
    backup = tmp_path / "backup"
    shutil.copytree(home / "store" / "people", backup)
    rc, out, err = ffr("device", "remove", "--home", str(home), "--name", "person2")
    assert rc == 0, err
    for record in backup.glob("*.person"):
        if not (home / "store" / "people" / record.name).exists():
            shutil.copy2(record, home / "store" / "people" / record.name)  # the removed person's file is back
    rc, out, err = _verify(home, people, "person2", "person2")
    assert rc == 2 and "MATCH" not in out
    assert "not in the store's sealed manifest" in err


def _png_bomb(path: Path, width: int, height: int) -> Path:
    """A valid PNG header declaring width x height pixels, with a tiny (truncated) body."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    body = zlib.compress(b"\x00" * 65536, 9)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", body) + chunk(b"IEND", b""))
    return path


def test_a_decompression_bomb_is_refused_before_decoding(home, people, tmp_path):
    bomb = _png_bomb(tmp_path / "bomb.png", 60000, 50000)  # 3 Gpixels declared, 9 GB decoded
    code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (1 << 31, 1 << 31)); "
            "sys.modules['torch'] = None; from ffr.cli import main; sys.exit(main(sys.argv[1:]))")
    proc = subprocess.run([sys.executable, "-c", code, "device", "verify", "--home", str(home), "--name", "person0",
                           "--images", str(bomb), "--detector", "haar"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "MATCH" not in proc.stdout
    assert "60000 x 50000" in proc.stderr and "refused before decoding" in proc.stderr
    from models.faces.imageio import UnreadableImage, read_rgb

    with pytest.raises(UnreadableImage, match="above the limit"):
        read_rgb(bomb)
    small = tmp_path / "ok.png"
    write_image(small, np.zeros((40, 30, 3), np.uint8))
    assert read_rgb(small).shape == (40, 30, 3)  # ordinary images still read


@pytest.mark.parametrize("far", ["2", "0", "-1", "0.6"])
def test_calibration_far_outside_its_range_is_one_line_and_changes_nothing(home, far):
    before = (home / "device.json").read_bytes()
    rc, out, err = ffr("device", "calibrate", "--home", str(home), "--far", far)
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("ffr device calibrate: error: --far must be in (0, 0.5]")
    assert (home / "device.json").read_bytes() == before


def test_calibration_with_enrolled_people_under_other_names_is_not_applied(home, people, tmp_path):
    twins = tmp_path / "cal"
    twins.mkdir()
    for name, folder in people.items():  # the same people, renamed: their "impostor" pairs are genuine
        shutil.copytree(folder, twins / f"other-{name}")
    before = (home / "device.json").read_bytes()
    args = ["device", "calibrate", "--home", str(home), "--far", "0.1", "--data", str(twins), "--detector", "haar",
            "--min-face", "1", "--min-sharpness", "0"]
    rc, out, err = ffr(*args)
    assert rc == 2 and "calibration not applied" in err and "look like one person" in err
    assert (home / "device.json").read_bytes() == before
    rc, out, err = ffr(*args, "--dry-run", "--force")
    assert rc == 0 and "not applied (--dry-run)" in out and (home / "device.json").read_bytes() == before
    rc, out, err = ffr(*args, "--force")
    assert rc == 0 and "forced despite" in out and (home / "device.json").read_bytes() != before


def test_read_only_commands_never_create_a_home(tmp_path):
    typo = tmp_path / "typo"
    # calibrating without --data only reads the people enrolled there: a mistyped --home is named, not filled
    for command in (["list"], ["verify", "--name", "x", "--images", str(tmp_path)], ["remove", "--name", "x"],
                    ["calibrate"]):
        rc, out, err = ffr("device", *command, "--home", str(typo))
        assert rc == 2 and err.startswith("ffr device") and f"no device home at {typo}" in err, err
        assert not typo.exists()


def _holder(home: Path, what: str) -> subprocess.Popen:
    """Another process holding the home as `what` says: `hold_daemon` (a running `ffr edge run`) or `lock` (an
    `ffr device` command writing)."""
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from edge_client.home import DeviceHome; "
                               f"DeviceHome({str(home)!r}).{what}(); print('held', flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


def test_enrolment_works_while_the_daemon_runs_and_a_second_daemon_is_refused(home, people):
    """One enrolment (issue 49): a running `ffr edge run` holds the home's files only while it writes, so a person
    is enrolled and removed beside it; a second daemon on the same home is refused, naming the first."""
    daemon = _holder(home, "hold_daemon")
    try:
        rc, out, err = ffr("device", "enroll", "--home", str(home), "--name", "late", "--images",
                           str(people["person0"]), "--detector", "haar", "--min-face", "1", "--min-sharpness", "0",
                           "--force")
        assert rc == 0, err
        rc, out, err = ffr("device", "remove", "--home", str(home), "--name", "late")
        assert rc == 0, err
        proc = subprocess.run([sys.executable, "-m", "ffr.cli", "edge", "run", "--credential", str(home / "none.json"),
                               "--data", str(people["person0"]), "--home", str(home)], capture_output=True, text=True,
                              timeout=120)  # a second daemon on the same home
        assert proc.returncode == 2 and f"is in use by process {daemon.pid} (an `ffr edge run`)" in proc.stderr, \
            proc.stderr
    finally:
        daemon.kill()
        daemon.wait()


def test_a_writer_waits_for_another_then_is_refused_naming_it(home, people):
    writer = _holder(home, "lock")
    try:
        started = time.monotonic()
        rc, out, err = ffr("device", "enroll", "--home", str(home), "--name", "late", "--images",
                           str(people["person0"]), "--detector", "haar", "--min-face", "1", "--min-sharpness", "0",
                           env={"FFR_HOME_WAIT_S": "2"})
        assert rc == 2 and f"is in use by process {writer.pid}" in err and err.count("\n") == 1
        assert time.monotonic() - started >= 2, "it waited for the writer first"
        rc, out, err = _verify(home, people, "person0", "person0")
        assert rc in (0, 1), err  # reading needs no lock
    finally:
        writer.kill()
        writer.wait()
    rc, out, err = ffr("device", "enroll", "--home", str(home), "--name", "late", "--images", str(people["person0"]),
                       "--detector", "haar", "--min-face", "1", "--min-sharpness", "0", "--force")
    assert rc == 0, err  # released with its process


def test_video_enrolment_reads_the_whole_clip_up_to_max_frames(tmp_path, people):
    import cv2

    from models.faces.imageio import read_rgb

    photos = [read_rgb(p) for p in sorted(people["person1"].glob("*.png"))]
    video = tmp_path / "clip.avi"
    writer = cv2.VideoWriter(str(video), cv2.VideoWriter_fourcc(*"MJPG"), 10, photos[0].shape[1::-1])
    for i in range(30):
        writer.write(cv2.cvtColor(photos[i % len(photos)], cv2.COLOR_RGB2BGR))
    writer.release()
    common = ["device", "enroll", "--home", str(tmp_path / "home"), "--name", "p1", "--video", str(video),
              "--detector", "haar", "--min-face", "1", "--min-sharpness", "0", "--json"]
    rc, out, err = ffr(*common, "--best", "3")
    assert rc == 0, err
    assert json.loads(out)["frames_read"] == 30 and json.loads(out)["faces_kept"] == 3  # not stopped at 9 faces
    rc, out, err = ffr(*common, "--best", "2", "--max-frames", "12", "--replace")
    assert rc == 0 and json.loads(out)["frames_read"] == 12, err
    for best in ("0", "-3"):
        rc, out, err = ffr(*common[:-1], "--best", best, "--replace")
        assert rc == 2 and err.strip() == (f"ffr device enroll: error: argument --best: must be at least 1 (got {best})"
                                           " (see ffr device enroll --help)")


def test_errors_are_one_line_on_their_own_and_json_on_stdout_with_json(tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "a.jpg").write_text("not an image")
    (bad / "b.png").write_text("nor this")
    rc, out, err = ffr("device", "enroll", "--home", str(tmp_path / "home"), "--name", "x", "--images", str(bad))
    assert rc == 2 and "Traceback" not in err
    last = err.rstrip("\n").split("\n")[-1]  # after the progress bar's line, never glued to it
    assert last == f"ffr device enroll: error: none of the image files in {bad} could be read"
    rc, out, err = ffr("device", "list", "--home", str(tmp_path / "typo"), "--json")
    assert rc == 2 and json.loads(out) == {"error": f"no device home at {tmp_path / 'typo'}: nobody was enrolled "
                                                    "there (check --home)", "command": "ffr device list"}
    assert err.count("\n") == 1 and err.startswith("ffr device list: error: no device home")


def test_quiet_enrolment_shows_no_progress_bar(tmp_path, people):
    rc, out, err = ffr("-q", "device", "enroll", "--home", str(tmp_path / "home"), "--name", "p0", "--images",
                       str(people["person0"]), "--detector", "haar", "--min-face", "1", "--min-sharpness", "0")
    assert rc == 0 and out.startswith("enrolled p0") and "reading frames" not in err, err

"""The device's decision (`edge_client.verifier.Verifier`) on a real home with the shipped model: the threshold it
decides at, who it names, and that a failed liveness check refuses whatever the score."""
from __future__ import annotations

import numpy as np
import pytest

from edge_client.home import DeviceHome
from edge_client.recognizer import Recognizer, install_default_model
from edge_client.vault import Vault, new_person
from edge_client.verifier import GIVEN, Verifier

DIM = 128


def unit(*values: float) -> np.ndarray:
    v = np.zeros(DIM, np.float32)
    v[: len(values)] = values
    return v / np.linalg.norm(v)


@pytest.fixture(scope="module")
def recognizer(tmp_path_factory) -> Recognizer:
    home = DeviceHome(tmp_path_factory.mktemp("verifier") / "home", create=True)
    vault = Vault.open(home.root / "store")
    install_default_model(home, vault)
    return Recognizer(home, vault)


@pytest.fixture(scope="module")
def people(recognizer):
    crops = np.zeros((1, 112, 112, 3), np.uint8)
    return [new_person("ada", crops, unit(1, 0), recognizer.model_sha256),
            new_person("bo", crops, unit(0, 1), recognizer.model_sha256)]


def test_the_device_threshold_is_used_unless_a_call_gives_its_own(recognizer):
    device = Verifier(recognizer)
    assert (device.threshold, device.threshold_note) == (recognizer.threshold, recognizer.threshold_note)
    given = Verifier(recognizer, 0.9)
    assert (given.threshold, given.threshold_note) == (0.9, GIVEN)


def test_a_probe_is_named_only_above_the_threshold_and_the_closest_is_always_said(recognizer, people):
    verifier = Verifier(recognizer, 0.5)
    near_ada, between = unit(1, 0.2)[None], unit(1, 1.1)[None]  # cosines 0.98 / 0.67 to ada, 0.20 / 0.74 to bo
    assert verifier.identify(near_ada, people).name == "ada"
    answer = verifier.identify(between, people)
    assert (answer.name, answer.closest) == ("bo", "bo") and answer.score == pytest.approx(0.74, abs=0.01)
    strict = Verifier(recognizer, 0.99)
    refused = strict.identify(near_ada, people)
    assert refused.name is None and not refused.match and refused.closest == "ada"
    assert refused.threshold == 0.99


def test_several_faces_of_one_probe_are_scored_by_their_mean(recognizer, people):
    verifier = Verifier(recognizer, 0.6)
    faces = np.stack([unit(1, 0), unit(0, 1)])  # one face of each: a mean of 0.5 to either, under 0.6
    assert not verifier.verify(faces, people[0]).match
    assert verifier.verify(faces[:1], people[0]).match


def test_a_failed_liveness_check_refuses_whatever_the_score(recognizer, people):
    verifier = Verifier(recognizer, 0.0)
    face = unit(1, 0)[None]
    assert verifier.verify(face, people[0], live=True).match
    assert verifier.verify(face, people[0]).match
    refused = verifier.verify(face, people[0], live=False)
    assert not refused.match and refused.score == pytest.approx(1.0)


def test_a_group_photo_is_answered_face_by_face(recognizer, people):
    verifier = Verifier(recognizer, 0.5)
    faces = np.stack([unit(0, 1), unit(1, 0), unit(0, 0, 1)])
    assert [a.name for a in verifier.each(faces, people)] == ["bo", "ada", None]
    assert verifier.count_matches(faces, people[0].template) == 1
    assert verifier.count_matches(faces[:0], people[0].template) == 0

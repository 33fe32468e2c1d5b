"""Each enrolled person's own threshold (`edge_client.person_threshold`): the device's threshold, raised for a person
whom the public faces resemble, kept in the sealed calibration as the strangers' mean and covariance, and the one a
decision about that person is made at."""
from __future__ import annotations

from statistics import NormalDist

import numpy as np
import pytest

from edge_client.home import DeviceHome
from edge_client.person_threshold import person_thresholds, stranger_spread
from edge_client.recognizer import (
    Calibration,
    Recognizer,
    Settings,
    calibrate,
    install_default_model,
    normalise,
    template_of,
)
from edge_client.vault import Vault, VaultError, new_person
from edge_client.verifier import Verifier

DIM = 128


def _strangers(n: int, towards: np.ndarray, seed: int = 0) -> np.ndarray:
    """Unit faces of nobody the device knows, leaning towards `towards` (a person they resemble)."""
    return normalise(towards + 0.05 * np.random.default_rng(seed).normal(size=(n, DIM)))


def _axis(i: int) -> np.ndarray:
    v = np.zeros(DIM)
    v[i] = 1.0
    return v


def test_each_template_gets_the_normal_tail_of_the_strangers_scores_against_it_and_never_less_than_the_device():
    strangers = _strangers(500, 0.8 * _axis(0))
    templates = np.stack([_axis(0), _axis(1)])  # the first person is the one the strangers resemble
    mean, cov = stranger_spread(strangers)
    own = person_thresholds(templates, mean, cov, shift=0.02, far=1e-3, threshold=0.3)
    scores = strangers @ templates.T + 0.02
    tail = scores.mean(0) + NormalDist().inv_cdf(1 - 1e-3) * scores.std(0, ddof=1)
    assert own[0] == pytest.approx(tail[0]) and own[0] > 0.3  # a lamb's bar: above the device's
    assert tail[1] < 0.3 and own[1] == 0.3                    # everyone else keeps the device's threshold
    assert person_thresholds(_axis(0), mean, cov, 0.02, 1e-3, 0.3) == pytest.approx(own[:1])


def _people(n: int, faces: int, seed: int = 1) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [normalise(_axis(2 + i) + 0.5 * rng.normal(size=(faces, DIM))) for i in range(n)]


def test_a_calibration_keeps_the_strangers_spread_and_expects_the_false_rejects_of_each_persons_threshold():
    mine = _people(4, 6)
    strangers = _strangers(300, 0.9 * template_of(mine[0]))  # strangers that resemble person 0
    cal = calibrate(mine, 1e-2, "0" * 64, strangers)
    own = cal.thresholds_for(np.stack([template_of(e) for e in mine]))
    assert own[0] > cal.threshold and (own >= cal.threshold).all()
    genuine = [e[i] @ ((e.sum(0) - e[i]) / np.linalg.norm(e.sum(0) - e[i])) for e in mine for i in range(len(e))]
    assert cal.expected_frr == pytest.approx(np.mean(np.array(genuine) <= np.repeat(own, 6)))
    plain = calibrate(mine, 1e-2, "0" * 64)  # no strangers' faces: one threshold for everyone, as before
    assert plain.stranger_mean is None and (plain.thresholds_for(np.stack(mine)[:, 0]) == plain.threshold).all()


@pytest.fixture
def home_with_spread(tmp_path):
    """A real device home whose sealed calibration carries a spread of strangers who resemble ada."""
    home = DeviceHome(tmp_path / "home", create=True)
    vault = Vault.open(home.root / "store")
    install_default_model(home, vault)
    settings = Settings.load(home, vault)
    mean, cov = stranger_spread(_strangers(400, 0.8 * _axis(0)))
    settings.calibration = Calibration(0.5, 1e-3, 0.1, True, 10, 1000, settings.models[home.generic_onnx.name],
                                       0.0, mean.tolist(), cov.tolist())
    settings.save(home, vault)
    return home, vault


def test_a_person_strangers_resemble_is_decided_at_their_own_threshold_and_a_given_one_overrides_it(home_with_spread):
    home, vault = home_with_spread
    recognizer = Recognizer(home, vault)
    crops = np.zeros((1, 112, 112, 3), np.uint8)
    ada, bo = (new_person(n, crops, _axis(i).astype(np.float32), recognizer.model_sha256) for n, i in (("ada", 0),
                                                                                                        ("bo", 1)))
    verifier = Verifier(recognizer)
    assert verifier.threshold == 0.5 and verifier.threshold_for(ada.template) > 0.6
    assert verifier.threshold_for(bo.template) == 0.5
    probe = normalise(np.array([0.6, 0.6] + [0.0] * (DIM - 2)))[None]  # 0.71 to either: above 0.5, under ada's own
    assert verifier.verify(probe, bo).match
    refused = verifier.verify(probe, ada)
    assert not refused.match and refused.threshold == verifier.threshold_for(ada.template)
    assert verifier.each(probe, [ada])[0].name is None
    assert "raised for each person" in verifier.threshold_note
    assert Verifier(recognizer, 0.5).verify(probe, ada).match  # a call's own threshold is everyone's


def test_a_sealed_calibration_whose_spread_has_the_wrong_shape_is_refused(home_with_spread):
    home, vault = home_with_spread
    settings = Settings.load(home, vault)
    assert len(settings.calibration.stranger_mean) == DIM  # kept as saved
    settings.calibration.stranger_cov = settings.calibration.stranger_cov[:5]  # sealed with the device's own key
    settings.save(home, vault)
    with pytest.raises(VaultError, match="damaged"):
        Settings.load(home, vault)


def test_the_calibration_gives_each_persons_threshold_by_name():
    from edge_client.door_calibration import own_thresholds

    mine = _people(3, 5)
    cal = calibrate(mine, 1e-2, "0" * 64, _strangers(300, 0.9 * template_of(mine[0])))
    own = own_thresholds(cal, ["ada", "bo", "cy"], mine)
    assert own["ada"] > cal.threshold == own["bo"] == own["cy"]  # only the one strangers resemble is raised
    plain = calibrate(mine, 1e-2, "0" * 64)  # no strangers' faces: everyone at the device's threshold
    assert set(own_thresholds(plain, ["ada", "bo", "cy"], mine).values()) == {plain.threshold}

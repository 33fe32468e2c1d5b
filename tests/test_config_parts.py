"""The configuration parts (`protocol.training_parts`): one home for the optimiser's and the model's settings,
embedded by a round's configuration, `ffr train`'s and `ffr pretrain`'s, and every saved form before them still read."""
from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from protocol.auth import Signer
from protocol.messages import RoundAnnouncement, TrainingConfig, open_envelope, seal
from protocol.methods import HFMAML, PFM, FedAvg, FedFR, FedProx
from protocol.training_parts import ModelSpec, OptimiserSettings, TrainerSettings, flatten

# a round configuration as a coordinator from before the parts sent it (format 1: every field at the top)
FORMAT_1 = {"type": "training_config", "epochs": 2, "batch_size": 16, "lr": 0.001, "algorithm": "fedprox",
            "pfm_beta": 0.9, "prox_mu": 0.01, "dfc_weight": 10.0, "codec": "fp16", "topk_fraction": 0.15,
            "chunk_bytes": 262144, "width_mult": 0.5, "embedding_dim": 128, "dp_clip": None, "imprint_head": False}


def test_a_round_configuration_from_an_older_coordinator_is_read_into_the_parts_with_a_rounds_defaults():
    config = TrainingConfig.model_validate_json(json.dumps(FORMAT_1))
    assert config.optimisation == OptimiserSettings(epochs=2, batch_size=16, lr=0.001)
    # `dfc` was not sent: a round's default (the DFC branch on), not the model part's own (off)
    assert config.model == ModelSpec(width_mult=0.5, dfc_weight=10.0, imprint_head=False, dfc=True)
    assert config.method == FedProx(prox_mu=0.01) and config.version == 3 and config.transport.chunk_bytes == 262144
    again = TrainingConfig.model_validate_json(config.model_dump_json())
    assert again == config and json.loads(config.model_dump_json())["optimisation"]["lr"] == 0.001


# format 2 (the parts nested, the method's settings at the top), as a coordinator or run folder of that version wrote it
FORMAT_2 = {"type": "training_config", "version": 2, "algorithm": "fedavg", "pfm_beta": 0.9, "prox_mu": 0.01,
            "alpha_cos": 1.0, "hard_negatives": False, "t_hn": 0.4, "contrastive": False, "alpha_con": 5.0,
            "tau": 0.5, "hfmaml": False, "maml_alpha": 0.01, "maml_beta": 0.01, "maml_delta": 0.001,
            "embedding_reg": 0.0, "optimisation": {"epochs": 1, "batch_size": 32, "lr": 0.0001}}


@pytest.mark.parametrize("flat, method", [
    ({}, FedAvg()),
    ({"algorithm": "fedprox", "prox_mu": 0.2, "embedding_reg": 1.0}, FedProx(prox_mu=0.2, embedding_reg=1.0)),
    ({"algorithm": "pfm", "pfm_beta": 0.5}, PFM(pfm_beta=0.5)),
    ({"hard_negatives": True, "contrastive": True, "t_hn": 0.3}, FedFR(t_hn=0.3)),
    ({"contrastive": True, "tau": 0.2}, FedFR(hard_negatives=False, tau=0.2)),
    ({"hfmaml": True, "maml_beta": 0.05, "embedding_reg": 1.0}, HFMAML(maml_beta=0.05, embedding_reg=1.0)),
])
def test_a_format_2_round_configuration_is_read_into_the_method_it_ran(flat, method):
    """Each method's settings travel in its own part (`method`); format 2's flat names are read into the method that
    form ran, and what only another method reads (unused there) is left."""
    config = TrainingConfig.model_validate_json(json.dumps({**FORMAT_2, **flat}))
    assert config.method == method and config.version == 3
    assert TrainingConfig.model_validate_json(config.model_dump_json()) == config


@pytest.mark.parametrize("flat", [{"algorithm": "fedprox", "hard_negatives": True},  # no one method runs these
                                  {"algorithm": "pfm", "hfmaml": True},
                                  {"contrastive": True, "embedding_reg": 1.0},
                                  {"algorithm": "fedprox", "method": {"name": "fedprox"}},  # both ways
                                  {"algorithm": ["fedavg"]}, {"algorithm": {"a": 1}}, {"algorithm": None},  # hostile
                                  {"hfmaml": [1]}, {"hfmaml": 1}, {"hard_negatives": {}}, {"alpha_cos": [1]},
                                  {"version": 1}])
def test_a_format_2_configuration_that_no_one_method_ran_or_a_hostile_one_is_refused(flat):
    """Refused as a schema's refusal (ValidationError, a message's reason), never another exception."""
    form = {**FORMAT_2, **flat}
    with pytest.raises(ValidationError):
        TrainingConfig.model_validate_json(json.dumps(form))
    with pytest.raises(ValidationError):
        TrainingConfig.model_validate(form)
    assert form == {**FORMAT_2, **flat}  # the caller's form is read, not changed


def test_an_older_coordinators_public_set_fields_are_read_into_their_part():
    """Format 1 named the served public set in three fields at the top; today they are one part (`public_set`)."""
    served = {"public_set_url": "http://10.0.0.1:8080/public-set", "public_set_sha256": "ab" * 32,
              "public_set_bytes": 4096}
    config = TrainingConfig.model_validate_json(json.dumps({**FORMAT_1, **served}))
    assert (config.public_set.url, config.public_set.sha256, config.public_set.size_bytes) == (
        "http://10.0.0.1:8080/public-set", "ab" * 32, 4096)
    none = {k: None for k in served}  # a coordinator that served none sent three nulls
    assert TrainingConfig.model_validate_json(json.dumps({**FORMAT_1, **none})).public_set is None
    assert TrainingConfig.model_validate_json(json.dumps(FORMAT_1)).public_set is None


@pytest.mark.parametrize("hostile", [
    {"public_set_url": "http://h/p", "public_set_sha256": "ab" * 32},   # format 1: the three come together
    {"public_set_sha256": "ab" * 32, "public_set_bytes": 10, "public_set_url": None},
    {"public_set_url": "http://h/p", "public_set_sha256": "ab" * 32, "public_set_bytes": 10,  # both ways
     "public_set": {"url": "http://h/q", "sha256": "cd" * 32, "size_bytes": 10}},
    {"version": 2, "public_set": {"url": "http://h/p", "sha256": "ab" * 32}},
    {"version": 2, "public_set": {"url": "http://h/p", "sha256": "ab" * 32, "size_bytes": 10, "path": "/etc"}},
])
def test_a_public_set_named_in_part_is_refused(hostile):
    with pytest.raises(ValidationError):
        TrainingConfig.model_validate_json(json.dumps({**FORMAT_1, **hostile} if "version" not in hostile
                                                      else hostile))


@pytest.mark.parametrize("hostile", [
    {"version": 2, "lr": 0.5},                               # today's format with a field at the top
    {"lr": 0.5, "optimisation": {"lr": 0.1}},                # a part given both ways: which one meant it?
    {"version": 2, "optimisation": {"epochs": 10 ** 6}},     # a round trains at most 20 epochs
    {"version": 2, "optimisation": {"lr": 5.0}},
    {"version": 2, "optimisation": {"batch_size": 10 ** 6}},
    {"version": 2, "model": {"width_mult": 9.0}},
    {"version": 2, "model": {"head": "arcface"}},            # a model part carries no head or file
    {"version": 2, "transport": {"codec": "zip"}},
    {"version": 2, "transport": {"chunk_bytes": 1 << 30}},
    {"version": 4},                                          # a format from a newer ffr-edge
])
def test_a_round_configuration_is_refused_when_its_parts_are_out_of_bounds_or_ambiguous(hostile):
    with pytest.raises(ValidationError):
        TrainingConfig.model_validate_json(json.dumps(hostile))


def test_an_announcement_signed_by_an_older_coordinator_still_verifies_and_parses():
    """The signature covers the fields as received: a format-1 configuration, signed as sent, verifies and reads."""
    signer = Signer.generate()
    body = RoundAnnouncement(round_id=1, model_version=0, model_sha256="0" * 64, model_bytes=1, model_chunks=1,
                             total_rounds=1, deadline_unix=1e9, config=TrainingConfig(), participants=["a"])
    sent = json.loads(seal("coordinator", 1, body, signer))
    sent["body"]["config"] = FORMAT_1  # exactly as the older coordinator wrote it
    sent["signature"] = signer.sign({k: v for k, v in sent.items() if k != "signature"})
    config = open_envelope(json.dumps(sent).encode(), signer.public_hex).body.config
    assert config.optimisation.epochs == 2 and config.model.width_mult == 0.5 and config.model.dfc


def test_the_round_bounds_name_the_flag_that_set_them():
    with pytest.raises(ValidationError, match="--local-epochs must be at most 20 in a round"):
        TrainingConfig(optimisation=OptimiserSettings(epochs=21))


def test_centralised_trainings_optimiser_refuses_what_cannot_work_as_ffr_train_spells_it():
    for bad, says in (({"batch_size": 1}, "--batch-size must be at least 2"), ({"lr": 0}, "--lr must be positive"),
                      ({"epochs": 0}, "--epochs must be at least 1"), ({"epochs": 2.5}, "--epochs must be at least 1"),
                      ({"lr": float("nan")}, "--lr must be positive"),
                      ({"weight_decay": -1}, "--weight-decay must not be negative"),
                      ({"precision": "fp8"}, "--precision must be one of auto, bf16, fp32")):
        with pytest.raises(ValueError, match=says):
            TrainerSettings(**bad)
    assert TrainerSettings(epochs=500).epochs == 500  # a round's 20-epoch bound is the round's, not this part's
    with pytest.raises(ValueError, match=r"--width-mult must be in \[0.25, 1.4\]"):
        ModelSpec(width_mult=2.0)


def test_the_parts_need_no_pydantic_where_distillation_runs():
    """A lent GPU machine has torch but no pydantic: the parts, and the distillation spec built of them, import and
    check themselves without it."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['pydantic'] = None\n"
            "from models.training.pretraining import PretrainConfig\n"
            "c = PretrainConfig(data=[]); assert c.optimisation.lr == 1e-3 and c.optimisation.weight_decay == 1e-2\n"
            "from models.networks.face_model import ModelConfig; assert ModelConfig(n_classes=2).width_mult == 1.0")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


def test_train_configs_saved_flat_before_the_parts_read_back_as_today():
    from models.networks.face_model import ModelConfig
    from models.training.supervised import TrainConfig

    flat = {"epochs": 3, "batch_size": 16, "lr": 0.003, "weight_decay": 0.0, "patience": 1, "aug": "weak",
            "head": "arcface", "width_mult": 0.35, "init": "none", "weights_path": None, "embedding_dim": 128,
            "dfc": True, "dfc_weight": 1.0, "class_weighted": False, "imprint_head": True, "anchor_weight": 0.0,
            "seed": 0, "max_eval_pairs": 100, "precision": "fp32", "extra": {"data": "faces"}}
    config = TrainConfig.from_dict(flat)
    assert config.optimisation == TrainerSettings(epochs=3, batch_size=16, lr=0.003, precision="fp32")
    assert config.model == ModelConfig(head="arcface", width_mult=0.35, init="none", dfc=True)
    assert TrainConfig.from_dict(config.to_dict()) == config
    assert {k: v for k, v in flatten(config.to_dict()).items() if k in flat} == flat


def test_a_checkpoints_model_description_is_the_flat_form_it_always_was(tmp_path):
    """ModelConfig is the model part plus the classes and the start: saved and read back flat, old files too."""
    from models.networks.face_model import FaceModel, ModelConfig, load_checkpoint, save_checkpoint

    model = FaceModel(ModelConfig(n_classes=3, width_mult=0.35, pretrained=False, dfc=True))
    save_checkpoint(tmp_path / "m.pt", model)
    loaded, payload = load_checkpoint(tmp_path / "m.pt")
    assert payload["model_config"]["width_mult"] == 0.35 and loaded.config.dfc and loaded.config.n_classes == 3
    old = {k: v for k, v in payload["model_config"].items() if k != "imprint_head"}  # written before that field
    assert ModelConfig.from_dict(old).width_mult == 0.35
    with pytest.raises(ValueError, match="n_classes is 0"):
        FaceModel(ModelConfig(pretrained=False))  # a spec's template is no model: the data gives the classes

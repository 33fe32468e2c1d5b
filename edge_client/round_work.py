"""The torch side of a device's round: judge the announced model, train from it, encode the update, export the models
the device verifies with.

The round runner (`edge_client.round_runner`) keeps the network side and calls this in its own process (a
simulation's devices) or in a child process started for the round (`edge_client.child_work`, `ffr edge run`), so
that an idle daemon never holds torch. The device's own adoption check (`edge_client.adoption`) decides whether a
model trained from the round's global one may verify a face here; the local steps are
`edge_client.local_algorithms`', the exports `edge_client.exporter`'s.
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import asdict

import torch
from safetensors.torch import load_file as load_torch

from edge_client.error_feedback import ErrorFeedback
from edge_client.exporter import export_models
from edge_client.home import DeviceHome
from edge_client.local_training import RoundInputs, personalised_global, train_round
from edge_client.public_set import DevicePublicSet
from edge_client.round_runner import Trained
from edge_client.verifier_choice import check_split
from models.faces.crops import FaceCrops
from models.maths.state_norms import clip_to_norm, without_running_stats
from models.networks.face_model import (
    FaceModel,
    ModelConfig,
    from_numpy_state,
    load_shareable_state,
    private_state,
    shareable_state,
)
from protocol.messages import ModelRelease, RoundAnnouncement, TrainingConfig
from protocol.tensors import PayloadError, decode

log = logging.getLogger("edge_client")

Outgoing = Callable[[dict, int, dict], tuple[dict, int]]


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """torch's global generator seeded for one piece of a device's work and restored after it: it draws the
    private head's and DFC branch's first weights and the augmentations that take no generator, so a round repeats
    from the device's seed (unseeded, two runs of the same round trained different models), and the devices of one
    simulation process do not draw from each other's stream."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


class RoundWork:
    def __init__(self, home: DeviceHome, crops: Callable[[], FaceCrops], public: DevicePublicSet, seed: int,
                 device_id: str, outgoing: Outgoing | None = None):
        """`crops()`: the device's faces; `outgoing`: the update as sent (the one seam a fleet experiment's attacker
        overrides; None: as trained)."""
        self.home, self._crops, self.public, self.seed, self.device_id = home, crops, public, seed, device_id
        self._outgoing = outgoing
        self.model: FaceModel | None = None
        self._global: dict[str, torch.Tensor] | None = None  # the announced model, once judged

    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        """A round's work in the caller's process: nothing to start (`edge_client.child_work.ChildWork` starts a
        process)."""
        yield

    def judge(self, job: RoundAnnouncement | ModelRelease, payload: bytes) -> bool:
        """Whether the announced model (its bytes, already checked against the announced sha256 by the download)
        passes this device's adoption check; it is kept for training and export either way."""
        self.public.follow(job.config)  # strangers' faces for the adoption check and the calibration, too
        state = decode(payload, job.model_sha256)
        adopted = self._adopt(job, payload, state)
        self._global = from_numpy_state(state)
        return adopted

    def train(self, job: RoundAnnouncement, momentum: bytes | None) -> Trained:
        """The local algorithm the round names, from the judged global backbone; the private parts stay in the home.
        The delta is clipped for DP-FedAvg (the coordinator adds the noise, `coordinator.dp`) and encoded with error
        feedback (what a sparse codec left out is sent in later rounds)."""
        cfg, global_state, seed = job.config, self._judged(), self.seed + job.round_id
        with seeded(seed):
            model = self.ensure_model(job)
            previous = (self._private(self.home.local_backbone, shareable_state(model))
                        if cfg.method.uses_previous_local() else None)
            pfm = None if momentum is None else self._momentum(job, momentum, global_state)
            result = train_round(model, self._crops(), global_state, cfg, seed=seed,
                                 inputs=RoundInputs(self.public.for_round(cfg), previous, pfm))
        self.home.save_tensors(self.home.private_state, private_state(model))
        self.home.save_tensors(self.home.local_backbone, shareable_state(model))  # the personalised model's Theta
        delta, n_samples = result.delta, result.n_samples
        if cfg.dp_clip is not None:
            delta, _ = clip_to_norm(without_running_stats(delta), cfg.dp_clip)
        if self._outgoing is not None:
            delta, n_samples = self._outgoing(delta, n_samples, global_state)
        wire = cfg.transport
        encoded = ErrorFeedback(self.home.codec_residual).encode(delta, wire.codec, wire.topk_fraction)
        return Trained(encoded.data, encoded.sha256, n_samples, result.metrics, result.private_metrics,
                       len(pfm or {}))

    def export(self, job: RoundAnnouncement | ModelRelease, trained: bool = True) -> str | None:
        """The device's verifying models: the global one, and its personalised one (the global backbone with a DFC
        branch fitted on its features: measured on 10 CelebA devices, Dirichlet, own people against strangers at
        FAR 1e-3, 0.754 against 0.692 for the local backbone with its branch,
        `bench/results/federation_value_dirichlet.md`); the better one chosen and recalibrated on its faces.
        `trained` False: the announced model with this device's private parts (the federation's final model)."""
        global_state = self._judged()
        with seeded(self.seed + job.model_version):
            model = self.ensure_model(job)
            if not trained:
                load_shareable_state(model, global_state)
            crops = self._crops()
            check = check_split(crops.labels, self.seed)  # judged on images the branch was not fitted on
            personal = None
            if model.dfc is not None and job.config.dfc_steps > 0:
                personal = personalised_global(global_state, crops if check is None else crops.select(~check),
                                               job.config, self.seed)
        with self.home.writing():  # `ffr device` commands wait meanwhile (one enrolment for verifying and federating)
            return export_models(model, self.home, self.device_id, global_state, crops.images, crops.labels,
                                 self.public.negatives_for_adoption(), personal, check, self.public.sha256)

    def _judged(self) -> dict[str, torch.Tensor]:
        if self._global is None:
            raise RuntimeError("no announced model judged yet: `judge` comes first")
        return self._global

    def _adopt(self, job: RoundAnnouncement | ModelRelease, payload: bytes, state: dict) -> bool:
        """The device's own check of the announced model on its people and public negatives (only the
        outcome is reported, as one metric of its update)."""
        from edge_client.adoption import Adoption, check_faces
        from edge_client.recognizer import Settings
        from edge_client.vault import Vault

        crops = self._crops()
        faces = check_faces(crops.images, crops.labels, self.public.negatives_for_adoption(), seed=self.seed)
        with self.home.writing():  # the sealed settings are shared with `ffr device` commands
            vault = Vault.open(self.home.root / "store")
            settings = Settings.load(self.home, vault)
            adoption = Adoption(self.home.root / "models", sealed=settings.models)
            verdict = adoption.judge(job.model_sha256, payload, state, faces)
            seals = adoption.seals()  # the references the next model is judged against
            if verdict.ok and any(settings.models.get(name) != sha for name, sha in seals.items()):
                settings.models.update(seals)
                settings.save(self.home, vault)
        if not verdict.ok:
            log.warning("%s: keeping the last good model, not v%d: %s", self.device_id, job.model_version,
                        verdict.reason)
        return verdict.ok

    @staticmethod
    def _momentum(job: RoundAnnouncement, payload: bytes,
                  model: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """PFM's global momentum for the announced version; its tensors must be the model's floating parameters,
        shape for shape."""
        momentum = decode(payload, job.momentum_sha256)
        for name, value in momentum.items():
            if name not in model or tuple(model[name].shape) != value.shape or value.dtype.kind != "f":
                raise PayloadError(f"momentum tensor {name[:80]} is not one of the model's floating tensors")
        return from_numpy_state(momentum)

    def ensure_model(self, job: RoundAnnouncement | ModelRelease) -> FaceModel:
        """The device's model for this architecture, its private head and DFC branch restored from the home."""
        cfg: TrainingConfig = job.config
        if self.model is None or self.model.config.dfc != cfg.model.dfc:
            self.model = FaceModel(ModelConfig(**asdict(cfg.model), n_classes=len(self._crops().identities),
                                               pretrained=False))
            saved = self._private(self.home.private_state, private_state(self.model))
            if saved is not None:
                self.model.load_state_dict(saved, strict=False)
        return self.model

    def _private(self, path, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
        """A private part this device saved (its head and DFC branch, or its last local backbone) if it matches
        `like` key for key and shape for shape; a damaged or outgrown file is skipped with a warning (the next
        round writes it anew), so one bad file costs that part's personalisation, not every round after it."""
        if not path.exists():
            return None
        try:
            saved = load_torch(str(path))
            if set(saved) == set(like) and all(saved[k].shape == like[k].shape for k in like):
                return saved
            problem = "it does not fit this model"
        except Exception as exc:  # noqa: BLE001 - safetensors says a damaged file many ways
            problem = " ".join(str(exc).split())[:120] or type(exc).__name__
        log.warning("%s: %s is not used (%s); starting that part afresh", self.device_id, path.name, problem)
        return None

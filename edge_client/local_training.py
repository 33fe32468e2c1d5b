"""One round of local training on a device, as a function: global backbone in, backbone delta out.

FedAvg/FedProx: loss = margin head (local classifier) + alpha_3 * DFC branch [+ mu/2 ||w - w_global||^2]
[+ C (1 - cos(f_global(x), f_local(x))), eq. 4 of the HF-MAML paper]. HF-MAML replaces the Adam steps by
Hessian-free meta-learning steps over the same loss (`models.training.hfmaml`).
FedFR (eq. 7 of Liu et al., AAAI 2022): alpha_1 L_cos + alpha_2 L_con + alpha_3 L_BCE, with the hard
negatives of the device's public set D_g in the batch (a margin term against the local classes and
negatives for the DFC classifiers), and the contrastive term against the global and the previous
local model (`models.training.fedfr`). After the epochs the DFC branch is fitted on frozen features
(`models.networks.dfc.fit_dfc`). Each round the local classifier's centres are first imprinted from the
received model's features (`models.networks.heads.imprint`): a stale or random head would scramble the
embedding before it learns anything (measured: per-client TAR@1e-2 of the local backbone 0.597
with a random head, 0.693 imprinted, against 0.671 for the global model, two CelebA clients).
Only `Theta_local - Theta_global` is returned for sending; the head, the DFC branch, and everything
about D_g stay on the device (`private_metrics` are never sent).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from edge_client.local_algorithms import LOCAL_ALGORITHMS
from edge_client.local_round import LocalRound
from models.faces.crops import FaceCrops
from models.networks.dfc import NEGATIVE, fit_dfc
from models.networks.face_model import FaceModel, load_shareable_state, shareable_state
from models.networks.heads import class_centres, imprint
from models.public_set import PublicSet
from models.training.crop_batches import as_chw, frozen_copy, frozen_features, train_loader
from models.training.fast_step import accelerate
from models.training.fedfr import hard_negatives
from models.training.hfmaml import anchored_to
from models.training.trainable import frozen_batchnorm, top_blocks_only
from protocol.messages import TrainingConfig
from protocol.methods import HFMAML


@dataclass
class LocalResult:
    delta: dict[str, np.ndarray]
    n_samples: int
    metrics: dict[str, float]
    private_metrics: dict[str, float] = field(default_factory=dict)  # about D_g: logged on the device only


def proximal_term(model: FaceModel, anchor: dict[str, torch.Tensor]) -> torch.Tensor:
    """sum ||w - w_global||^2 over the backbone's trainable parameters (FedProx, Li et al. 2020)."""
    return sum(((p - anchor[n]) ** 2).sum() for n, p in model.backbone.named_parameters())


@dataclass
class HardNegatives:
    """This round's sample of D_g: images (NCHW uint8) and, for a labelled D_g, each image's class among
    the sampled public people and those people's centres (learnable for this round, then dropped)."""

    images: torch.Tensor
    labels: torch.Tensor | None = None
    centres: torch.nn.Parameter | None = None

    def __len__(self) -> int:
        return len(self.images)


def sample_hard_negatives(backbone: torch.nn.Module, public: PublicSet, local_features: torch.Tensor,
                          t_hn: float, seed: int, labelled_classes: bool) -> HardNegatives:
    """FedFR's HN sampling under the received model; with identity labels, the sampled people's centres
    are imprinted from all their public images, so they join the classification (eq. 3)."""
    public_features = frozen_features(backbone, public.images, seed=seed)
    chosen = hard_negatives(public_features, local_features, t_hn)
    sample = HardNegatives(as_chw(public.images[chosen.numpy()]))
    if labelled_classes and public.labels is not None and len(chosen):
        classes, index = np.unique(public.labels[chosen.numpy()], return_inverse=True)
        of_sampled = np.isin(public.labels, classes)
        centres, _ = class_centres(public_features[torch.from_numpy(of_sampled)],
                                   torch.from_numpy(np.searchsorted(classes, public.labels[of_sampled])), len(classes))
        sample.labels = torch.from_numpy(index.reshape(-1)).long()
        sample.centres = torch.nn.Parameter(centres)
    return sample


@dataclass
class RoundInputs:
    """What a round may bring beside the model, the crops and the settings: FedFR's public set D_g, the device's
    last local backbone (keys `backbone.*`, for the contrastive term) and PFM's global momentum (keys `backbone.*`;
    None in the first round)."""

    public: PublicSet | None = None
    previous_state: dict[str, torch.Tensor] | None = None
    pfm_momentum: dict[str, torch.Tensor] | None = None


def train_round(model: FaceModel, crops: FaceCrops, global_state: dict[str, torch.Tensor],
                objective: TrainingConfig | None = None, seed: int = 0, inputs: RoundInputs | None = None
                ) -> LocalResult:
    """Train on the device's crops from the global backbone, as the round's settings say (`objective`: epochs,
    batch size, learning rate, the method's terms). With FedProx's aggregation the proximal term mu/2 ||w - w_g||^2
    joins the loss; with PFM's, FedFace's local steps: plain SGD at `lr` for the backbone plus the global momentum
    spread over the round's steps, and classical momentum SGD for the classifier (`models.maths.pfm`). The steps
    themselves are `edge_client.local_algorithms`'."""
    objective = objective or TrainingConfig()
    inputs = inputs or RoundInputs()
    public, previous_state, pfm_momentum = inputs.public, inputs.previous_state, inputs.pfm_momentum
    method = objective.method
    prox_mu = method.proximal_mu()
    epochs, batch_size, lr = (objective.optimisation.epochs, objective.optimisation.batch_size,
                              objective.optimisation.lr)
    # the trunk in bf16 where the CPU has it (models.training.fast_step); HF-MAML's finite-difference Hessian products
    # (eq. 3) take the difference of two nearby gradients, which bf16 would drown, so it stays fp32
    accelerate(model, "fp32" if isinstance(method, HFMAML) else "auto")
    load_shareable_state(model, global_state)
    start = {k: v.clone() for k, v in shareable_state(model).items()}
    anchor = {n: p.detach().clone() for n, p in model.backbone.named_parameters()}
    private: dict[str, float] = {}
    negatives = _imprint_and_sample(model, crops, objective, public, seed, private)
    generator = torch.Generator().manual_seed(seed)
    contrastive = method.uses_previous_local()
    round_ = LocalRound(model, train_loader(crops, batch_size, "weak", generator), epochs, lr, objective, generator,
                        regulariser=(lambda: prox_mu / 2.0 * proximal_term(model, anchor)) if prox_mu > 0 else None,
                        negatives=negatives, pfm_momentum=pfm_momentum,
                        global_net=frozen_copy(model.backbone) if contrastive else None,
                        previous_net=frozen_copy(model.backbone, previous_state) if contrastive else None)
    if method.embedding_anchor() > 0:  # eq. 4 against the round's starting model
        round_.extra = anchored_to(frozen_copy(model.backbone), method.embedding_anchor())
    with frozen_batchnorm(model.backbone if objective.batchnorm == "frozen" else model.backbone.features,
                          objective.batchnorm != "train"), \
            top_blocks_only(model.backbone, objective.top_blocks):
        metrics = dict(LOCAL_ALGORITHMS[method.name](round_)[-1])
    for key in ("neg_loss", "total_loss"):  # figures that involve D_g: the device's log only
        if key in metrics:
            private[key] = metrics.pop(key)
    if model.dfc is not None and objective.dfc_steps > 0:
        fit_loss = _fit_dfc(model, crops, objective, negatives, seed)
        (private if negatives is not None else metrics)["dfc_fit_loss"] = fit_loss
    model.eval()
    end = shareable_state(model)
    delta = {k: (end[k].double() - start[k].double()).numpy() if end[k].is_floating_point()
             else (end[k] - start[k]).numpy() for k in end}  # integer buffers keep an integer delta
    return LocalResult(delta, len(crops), metrics, private)


def _imprint_and_sample(model: FaceModel, crops: FaceCrops, objective: TrainingConfig, public: PublicSet | None,
                        seed: int, private: dict[str, float]) -> HardNegatives | None:
    """The head's centres from the received model (not last round's backbone), and FedFR's sample of D_g
    under it; what the sample says about D_g goes to `private`, the device's log only."""
    use_public = objective.method.uses_public_set() and public is not None and len(public) > 0
    local_features = None
    if objective.model.imprint_head or use_public:
        local_features = frozen_features(model.backbone, crops.images, seed=seed)
    if objective.model.imprint_head:
        imprint(model.head, local_features, torch.from_numpy(crops.labels))
    if not use_public:
        return None
    negatives = sample_hard_negatives(model.backbone, public, local_features, objective.method.t_hn, seed,
                                      model.head.centres is not None)
    private.update({"hn_fraction": len(negatives) / len(public), "hn_sampled": float(len(negatives))})
    if negatives.centres is not None:
        private["hn_classes"] = float(len(negatives.centres))
    return negatives


def personalised_global(global_state: dict[str, torch.Tensor], crops: FaceCrops, objective: TrainingConfig,
                        seed: int = 0, negatives: np.ndarray | None = None) -> FaceModel:
    """A device's personalised model: the global backbone (keys `backbone.*`) with a DFC branch fitted on its
    features of the device's images, rather than its last local copy with the branch fitted there (measured:
    `bench/results/federation_value_dirichlet.md`); `negatives` (N x S x S x 3 uint8, public faces of nobody's
    people) join the fit as FedFR's negatives of every binary classifier (eq. 6)."""
    from models.networks.face_model import ModelConfig

    model = FaceModel(ModelConfig(**{**asdict(objective.model), "dfc": True}, n_classes=len(crops.identities),
                                  pretrained=False))
    load_shareable_state(model, global_state)
    _fit_dfc(model, crops, objective, None if negatives is None else HardNegatives(as_chw(negatives)), seed)
    return model.eval()


def _fit_dfc(model: FaceModel, crops: FaceCrops, objective: TrainingConfig, negatives: HardNegatives | None,
             seed: int) -> float:
    """FedFR's DFC branch on frozen features of the local images' views and the sampled public negatives."""
    features = frozen_features(model.backbone, crops.images, objective.dfc_views, seed)
    labels = torch.from_numpy(np.tile(crops.labels, objective.dfc_views)).long()
    if negatives is not None and len(negatives):
        public_features = frozen_features(model.backbone, negatives.images.permute(0, 2, 3, 1).numpy(), seed=seed)
        features = torch.cat([features, public_features])
        labels = torch.cat([labels, torch.full((len(public_features),), NEGATIVE)])
    return fit_dfc(model.dfc, features, labels, objective.dfc_steps, objective.dfc_lr, seed=seed,
                   anchor=objective.dfc_anchor)

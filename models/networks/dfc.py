"""DFC: the decoupled feature customisation branch of FedFR (Liu et al., AAAI 2022).

A device keeps a private fully-connected transform Pi that maps the shared, generic
embedding Theta(x) into a space customised for its own people, and K one-vs-all binary
classifiers Omega (one per enrolled person) trained there with SphereFace2's margin-based
binary cross-entropy (Wen et al., 2022). Nothing in this module ever leaves the device.
Verification on the device uses the personalised embedding [Theta(x), Pi(Theta(x))], which may carry
Omega's posteriors too (`personalised_embedding`, off by default).

Why `fit_dfc` exists: trained only beside the backbone (one local epoch, the backbone's learning
rate), Pi never leaves the identity it starts from (||Pi - I|| = 0.02 after a round, measured), so
[Theta, Pi(Theta)] was Theta twice and personalised nothing. After local training the branch is
fitted on its own, on the device's frozen features (a few augmented views of each local image, plus
public faces as negatives where the device has them): 128-d inputs, so hundreds of steps cost
well under a second.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from models.training.loop import Step, optimise


def sphereface2_g(z: torch.Tensor, t: float) -> torch.Tensor:
    """g(z) = 2((z+1)/2)^t - 1: a similarity adjustment that sharpens the positive side."""
    return 2.0 * ((z + 1.0) / 2.0).pow(t) - 1.0


def sphereface2_initial_bias(n_classes: int, lam: float, r: float, m: float, t: float) -> float:
    """The bias at which the untrained loss is balanced between positives and negatives (SphereFace2)."""
    if n_classes < 2:
        return 0.0
    z = lam / ((1.0 - lam) * (n_classes - 1.0))
    a_pos = r * (2.0 * 0.5 ** t - 1.0 - m)
    a_neg = r * (2.0 * 0.5 ** t - 1.0 + m)
    root = math.sqrt((1.0 - z) ** 2 + 4.0 * z * math.exp(a_pos - a_neg))
    return math.log(2.0 * z) - a_neg - math.log(1.0 - z + root)


class BinaryClassifiers(nn.Module):
    """Omega: K one-vs-all classifiers with SphereFace2-C loss (lambda, s', m', t, learned bias)."""

    def __init__(self, dim: int, n_classes: int, lam: float = 0.7, r: float = 30.0, m: float = 0.4, t: float = 3.0):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_classes, dim))
        nn.init.xavier_normal_(self.weight)
        self.bias = nn.Parameter(torch.tensor(sphereface2_initial_bias(n_classes, lam, r, m, t)))
        self.lam, self.r, self.m, self.t = lam, r, m, t

    def cosine(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.normalize(x, dim=1), F.normalize(self.weight, dim=1)).clamp(-1.0, 1.0)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Margin-free binary logits, one per class (positive means 'this is person k')."""
        return self.r * sphereface2_g(self.cosine(x), self.t) + self.bias

    def loss(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """lambda/r log(1+e^-(r(g(cos_y)-m)+b)) + (1-lambda)/r sum_{i!=y} log(1+e^(r(g(cos_i)+m)+b)).

        A label of -1 (NEGATIVE) is a face of nobody enrolled: a negative for every classifier
        (FedFR: "the global data can be used to optimize our DFC module")."""
        g = sphereface2_g(self.cosine(x), self.t)
        positive = F.one_hot(labels.clamp(min=0), g.shape[1]).to(g.dtype) * (labels >= 0).unsqueeze(1).to(g.dtype)
        logits = self.r * (g - self.m * (2.0 * positive - 1.0)) + self.bias
        pos_term = self.lam * positive * F.softplus(-logits)
        neg_term = (1.0 - self.lam) * (1.0 - positive) * F.softplus(logits)
        return (pos_term + neg_term).sum(dim=1).mean() / self.r


# gamma of `personalised_embedding`. 0.1: on the personalisation bench as many devices gain 10 points of own TAR@1e-3
# as at 0.3 (7 of 10, 2 without the vote), and the door each device chooses lets in fewer strangers than at 0.3
# (README, "Does a round pay?"; bench/results/personalisation_vote_chance.md, fleet_simulate_celeba_vote01_iid.md)
POSTERIOR_WEIGHT = 0.1
CUSTOM_WEIGHT = 0.5  # beta of `personalised_embedding`: the customised half's share of a cosine (FedFR: equal halves)


class DFCBranch(nn.Module):
    """Pi (a fully connected transform, initialised to identity) followed by Omega."""

    def __init__(self, dim: int, n_classes: int, lam: float = 0.7, r: float = 30.0, m: float = 0.4, t: float = 3.0,
                 posterior_weight: float = POSTERIOR_WEIGHT, custom_weight: float = CUSTOM_WEIGHT):
        super().__init__()
        self.posterior_weight, self.custom_weight = posterior_weight, custom_weight
        self.transform = nn.Linear(dim, dim)
        with torch.no_grad():
            self.transform.weight.copy_(torch.eye(dim))
            self.transform.bias.zero_()
        self.classifiers = BinaryClassifiers(dim, n_classes, lam, r, m, t)

    def customise(self, generic: torch.Tensor) -> torch.Tensor:
        """Pi(Theta(x)), L2-normalised."""
        return F.normalize(self.transform(generic), dim=1)

    def posteriors(self, generic: torch.Tensor) -> torch.Tensor:
        """sigma(Omega_k(Pi(Theta(x)))): how surely the face is enrolled person k, one column per person."""
        return torch.sigmoid(self.classifiers.logits(self.transform(generic)))

    def personalise(self, generic: torch.Tensor, posterior_weight: float | None = None,
                    custom_weight: float | None = None) -> torch.Tensor:
        """The device's verifying embedding of generic embeddings (`personalised_embedding`), with the branch's own
        gamma and beta unless given (a bench re-scores one fit at other weights without changing the branch)."""
        return personalised_embedding(
            generic, self.customise(generic), self.posteriors(generic),
            self.posterior_weight if posterior_weight is None else posterior_weight,
            self.custom_weight if custom_weight is None else custom_weight)

    def loss(self, generic: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.classifiers.loss(self.transform(generic), labels)

    def drift(self) -> torch.Tensor:
        """||W - I||^2 + ||b||^2: how far Pi has moved from the identity it starts as (L2-SP's distance to the
        starting point, Li et al., ICML 2018), which an anchored fit pays for (`fit_dfc`'s `anchor`)."""
        weight = self.transform.weight
        eye = torch.eye(weight.shape[0], dtype=weight.dtype, device=weight.device)
        return ((weight - eye) ** 2).sum() + (self.transform.bias ** 2).sum()


NEGATIVE = -1  # the label of a public face: nobody this device knows


def fit_dfc(branch: DFCBranch, features: torch.Tensor, labels: torch.Tensor, steps: int = 300, lr: float = 1e-2,
            batch_size: int = 128, seed: int = 0, anchor: float = 0.0) -> float:
    """Fit Pi and Omega to frozen generic features with FedFR's L_BCE (eq. 6), plus `anchor` x Pi's drift from the
    identity (`DFCBranch.drift`); returns the last loss.

    `features` are Theta(x) of the device's images (labels 0..K-1) and, optionally, of public faces
    (label NEGATIVE). Only the branch changes; its own Adam, because the backbone's rate is far too low. Why the
    anchor: fitted freely on a device of two or three people, Pi folds every face towards their few directions, and
    strangers score against their templates as high as they do (the door then refuses its own people)."""
    if steps <= 0 or len(features) == 0:
        return float("nan")
    generator = torch.Generator().manual_seed(seed)
    optimiser = torch.optim.Adam(branch.parameters(), lr=lr)
    features, labels = features.detach(), labels.long()
    was_training = branch.training
    branch.train()
    last = Step(torch.tensor(float("nan")))
    batches = (torch.randint(0, len(features), (min(batch_size, len(features)),), generator=generator)
               for _ in range(steps))

    def keep(step: Step) -> None:
        nonlocal last
        last = step

    def step(batch: torch.Tensor) -> Step:
        loss = branch.loss(features[batch], labels[batch])
        return Step(loss + anchor * branch.drift() if anchor > 0 else loss)

    optimise(batches, step, optimiser, after=[keep])
    branch.train(was_training)
    return last.value


def personalised_embedding(generic: torch.Tensor, custom: torch.Tensor, posteriors: torch.Tensor | None = None,
                           weight: float = POSTERIOR_WEIGHT, custom_weight: float = CUSTOM_WEIGHT) -> torch.Tensor:
    """[sqrt(1 - beta) Theta(x), sqrt(beta) Pi(Theta(x))] (beta = `custom_weight`; 0.5, both halves counting equally
    in a cosine, is FedFR's concatenation), then sqrt(gamma) * Omega's posteriors p(x), as one unit vector: a cosine
    of two of them is (1 - beta) cos_Theta + beta cos_Pi, plus gamma * sum_k p_k(a) p_k(b), "both are enrolled person
    k", and a stranger (every p_k near 0) gains nothing from that last term. So FedFR's binary classifiers, fitted
    for the device's people, vote in verification too rather than only shaping Pi (measured:
    `bench/results/personalisation_posteriors.md`). The width is 2 x dim + K (the people enrolled at the fit)."""
    if not 0.0 <= custom_weight <= 1.0:
        raise ValueError(f"custom_weight must be in [0, 1] (got {custom_weight!r})")
    halves = torch.cat([math.sqrt(1.0 - custom_weight) * F.normalize(generic, dim=1),
                        math.sqrt(custom_weight) * F.normalize(custom, dim=1)], dim=1)
    if posteriors is None or weight <= 0:
        return halves
    return F.normalize(torch.cat([halves, math.sqrt(weight) * posteriors], dim=1), dim=1)

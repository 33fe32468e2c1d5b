"""The whole on-device model: shared embedder Theta + private margin head + private DFC branch.

`shareable_state` is the single gate through which anything leaves a device: it returns
the embedder's parameters and buffers and nothing else (no head, no DFC, no data).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from models.networks.backbone import FaceEmbedder
from models.networks.dfc import DFCBranch
from models.networks.face_weights import INITS, check_face_init, face_global_state, load_face_embedder
from models.networks.heads import build_head
from protocol.training_parts import ModelSpec

SHAREABLE_PREFIX = "backbone."


@dataclass
class ModelConfig(ModelSpec):
    """Everything needed to rebuild a model from a checkpoint: the model part every configuration shares
    (`protocol.training_parts.ModelSpec`), the classes and margin head of the people it trains on, and where its
    starting weights come from. As a training spec's model (`TrainConfig.model`) it has no classes yet (0): the
    data gives them (`with_classes`)."""

    n_classes: int = 0
    pretrained: bool = True            # start from pretrained weights at all (False: random)
    init: str = "face"                 # which: the shipped face embedder, or ImageNet
    weights_path: str | None = None    # a local torchvision ImageNet file instead of the installed one
    head: str = "cosface"
    head_s: float | None = None
    head_m: float | None = None
    dfc_lambda: float = 0.7
    dfc_r: float = 30.0
    dfc_m: float = 0.4
    dfc_t: float = 3.0
    class_weights: list[float] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not (isinstance(self.n_classes, int) and self.n_classes >= 0):
            raise ValueError(f"n_classes must be a count (got {self.n_classes!r})")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> ModelConfig:
        """From a checkpoint's `model_config`; keys a later version dropped are ignored."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    def with_classes(self, n_classes: int, class_weights: list[float] | None = None) -> ModelConfig:
        """This model for `n_classes` people (a spec's template becomes a buildable model)."""
        return replace(self, n_classes=n_classes, class_weights=class_weights,
                       pretrained=self.pretrained and self.init != "none")


def _initial_backbone(config: ModelConfig) -> FaceEmbedder:
    if config.weights_path is not None:
        return FaceEmbedder(config.embedding_dim, config.width_mult, True, config.weights_path)
    init = config.init if config.pretrained else "none"
    return new_embedder(init, config.width_mult, config.embedding_dim)


class FaceModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        if config.n_classes < 1:
            raise ValueError("a model needs its people's classes: n_classes is 0 (ModelConfig.with_classes)")
        self.config = config
        self.backbone = _initial_backbone(config)
        self.head = build_head(config.head, config.embedding_dim, config.n_classes, config.head_s, config.head_m)
        self.dfc = (DFCBranch(config.embedding_dim, config.n_classes, config.dfc_lambda, config.dfc_r,
                              config.dfc_m, config.dfc_t) if config.dfc else None)
        weights = torch.tensor(config.class_weights, dtype=torch.float32) if config.class_weights else None
        self.register_buffer("class_weights", weights, persistent=False)

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """The generic embedding Theta(x): what the federation learns and shares."""
        return self.backbone(x)

    def embed_personalised(self, x: torch.Tensor) -> torch.Tensor:
        """[Theta(x), Pi(Theta(x)), Omega's posteriors] (`models.networks.dfc.personalised_embedding`); needs the
        DFC branch."""
        if self.dfc is None:
            raise ValueError("this model has no DFC branch: train it with dfc enabled to personalise")
        return self.dfc.personalise(self.backbone(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.embed(x)

    def losses(self, x: torch.Tensor, labels: torch.Tensor,
               extra: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
               ) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
        """Total training loss, margin-free logits (for accuracy) and the loss parts for logging.
        `extra(emb, x)` adds a term on the batch's embedding (e.g. HF-MAML's embedding regulariser)."""
        emb = self.backbone(x)
        head_loss = F.cross_entropy(self.head(emb, labels), labels, weight=self.class_weights)
        parts = {"head_loss": float(head_loss.detach())}
        total = head_loss
        if extra is not None:
            term = extra(emb, x)
            parts["extra_loss"] = float(term.detach())
            total = total + term
        if self.dfc is not None:
            dfc_loss = self.dfc.loss(emb, labels)
            parts["dfc_loss"] = float(dfc_loss.detach())
            total = total + self.config.dfc_weight * dfc_loss
        with torch.no_grad():
            logits = self.head.logits(emb)
        return total, logits, parts

    def dfc_term(self, emb: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """alpha_3 L_BCE (FedFR's eq. 7): the DFC branch's loss at its weight; a NEGATIVE label is nobody's face."""
        return self.config.dfc_weight * self.dfc.loss(emb, labels)


def shareable_state(model: FaceModel) -> dict[str, torch.Tensor]:
    """The embedder's parameters and buffers, keyed `backbone.*`: all that may leave a device."""
    return {f"{SHAREABLE_PREFIX}{k}": v.detach().clone() for k, v in model.backbone.state_dict().items()}


def private_state(model: FaceModel) -> dict[str, torch.Tensor]:
    """Everything else (head, DFC): stays on the device, always."""
    return {k: v for k, v in model.state_dict().items() if not k.startswith(SHAREABLE_PREFIX)}


def load_shareable_state(model: FaceModel, state: dict[str, torch.Tensor]) -> None:
    """Put a (global) embedder into `model`, refusing anything that is not exactly the embedder."""
    _load_embedder(model.backbone, state)


def _load_embedder(embedder: FaceEmbedder, state: dict[str, torch.Tensor]) -> None:
    expected = {f"{SHAREABLE_PREFIX}{k}" for k in embedder.state_dict()}
    if set(state) != expected:
        unknown, missing = sorted(set(state) - expected), sorted(expected - set(state))
        raise ValueError(f"not an embedder state: unknown {unknown[:3]}, missing {missing[:3]}")
    embedder.load_state_dict({k.removeprefix(SHAREABLE_PREFIX): v for k, v in state.items()})


def save_checkpoint(path: Path, model: FaceModel, **extra) -> None:
    """A checkpoint of plain tensors and Python values, loadable with weights_only=True."""
    payload = {"model_config": model.config.to_dict(), "model_state": model.state_dict(), **extra}
    tmp = Path(path).with_suffix(".tmp")
    torch.save(payload, tmp)
    tmp.replace(path)


def load_checkpoint(path: str | Path) -> tuple[FaceModel, dict]:
    """Rebuild a model from a checkpoint without unpickling arbitrary objects."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # zip, pickle and weights-only refusals alike: not a file `ffr train` wrote
        raise ValueError(f"{path} is not an ffr-edge checkpoint (not a readable PyTorch file: "
                         f"{type(exc).__name__})") from None
    if not (isinstance(payload, dict) and isinstance(payload.get("model_config"), dict)
            and isinstance(payload.get("model_state"), dict)):
        raise ValueError(f"{path} is not an ffr-edge checkpoint (no model_config and model_state)")
    try:
        config = ModelConfig.from_dict({**payload["model_config"], "pretrained": False, "weights_path": None})
        _check_shapes(config, payload["model_state"])
        model = FaceModel(config)
        model.load_state_dict(payload["model_state"])
    except (TypeError, ValueError, RuntimeError, KeyError) as exc:
        raise ValueError(f"{path} is a damaged ffr-edge checkpoint: {str(exc).strip().splitlines()[0]}") from None
    model.eval()
    return model, payload


def _check_shapes(config: ModelConfig, state: dict) -> None:
    """The model the config describes, built without memory (meta device), must have exactly the file's tensors:
    a config naming a billion classes is refused before anything that size is allocated."""
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in FaceModel(config).state_dict().items()}
    found = {k: tuple(v.shape) if isinstance(v, torch.Tensor) else None for k, v in state.items()}
    wrong = sorted(k for k in expected.keys() | found.keys() if expected.get(k) != found.get(k))
    if wrong:
        raise ValueError(f"its model_config does not match its tensors ({len(wrong)} differ, first {wrong[0]})")


def to_numpy_state(state: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    return {k: v.detach().cpu().numpy().copy() for k, v in state.items()}


def from_numpy_state(state: dict) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(v.copy()) for k, v in state.items()}


def initial_global_state(width_mult: float = 1.0, embedding_dim: int = 128, init: str = "face") -> dict:
    """Round 0's shared embedder as numpy arrays keyed `backbone.*`: face-pretrained (default), ImageNet or random."""
    if init == "face":
        check_face_init(width_mult, embedding_dim)
        return face_global_state()
    backbone = FaceEmbedder(embedding_dim, width_mult, pretrained=init == "imagenet")
    return {f"{SHAREABLE_PREFIX}{k}": v.numpy().copy() for k, v in backbone.state_dict().items()}


def new_embedder(init: str = "face", width_mult: float = 1.0, embedding_dim: int = 128) -> FaceEmbedder:
    """A fresh embedder: the shipped face-pretrained weights (default), ImageNet, or random (`none`)."""
    if init not in INITS:
        raise ValueError(f"unknown --init {init!r}; choose one of {', '.join(INITS)}")
    if init == "face":
        check_face_init(width_mult, embedding_dim)
        return load_face_embedder()
    return FaceEmbedder(embedding_dim, width_mult, pretrained=init == "imagenet")


def global_embedder(state: dict, width_mult: float = 1.0, embedding_dim: int = 128) -> FaceEmbedder:
    """The federation's model as it is evaluated: the bare embedder Theta loaded from a `backbone.*` state
    (numpy or torch), in eval mode, with no head to fake. Any other key is refused."""
    embedder = FaceEmbedder(embedding_dim, width_mult, pretrained=False)
    _load_embedder(embedder, {k: v if isinstance(v, torch.Tensor) else torch.from_numpy(np.array(v))
                              for k, v in state.items()})
    return embedder.eval()

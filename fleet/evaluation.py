"""How good is the fleet's model, for unseen people and for each device's own people (FedFR's protocol).

- Global: the shared embedder on identities that live on no device (AUC, EER, TAR@FAR).
- Personalised, per client: genuine pairs from the client's own people's test images, impostor
  pairs between its people and strangers (people on no device; other clients' people in a run that
  keeps no one off the devices), scored by each candidate verifier the client could run: the starting
  model (what the client had before the federation), the global backbone, its local backbone, its
  local backbone + DFC transform, and the centralised upper bound. Mean and standard deviation over clients are the
  fairness figure of the HF-MAML paper; clients held out of training are reported apart.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
from safetensors.torch import load_file

from edge_client.home import DeviceHome
from fleet.data import TEST, FleetData
from models.evaluation.evaluate import embed_all
from models.evaluation.metrics import cosine_scores, genuine_pairs, l2_normalise, roc_report
from models.networks.embedders import TorchEmbedder
from models.networks.face_model import FaceModel, ModelConfig

METRICS = ("auc", "eer", "tar@1e-2", "tar@1e-3")


def embed(model: FaceModel, images: np.ndarray, personalised: bool = False) -> np.ndarray:
    return embed_all(TorchEmbedder(model, personalised), images)


def embed_once(model: FaceModel, images: np.ndarray, candidates: np.ndarray) -> Callable[[np.ndarray], np.ndarray]:
    """Indices -> embeddings for a model every client shares: each candidate image is embedded once, up front."""
    rows = np.full(len(images), -1)
    rows[candidates] = np.arange(len(candidates))
    table = embed(model, images[candidates])
    return lambda indices: table[rows[indices]]


def flat(report: dict) -> dict:
    """AUC, EER and TAR@FAR as one flat dict (None where there were too few pairs)."""
    tar = report.get("tar_at_far", {})
    value = lambda v: v if isinstance(v, float) else None  # noqa: E731
    return {"auc": report.get("auc"), "eer": report.get("eer"),
            "tar@1e-1": value(tar.get("0.1")), "tar@1e-2": value(tar.get("0.01")), "tar@1e-3": value(tar.get("0.001")),
            **({"tar@1e-4": value(tar["0.0001"])} if "0.0001" in tar else {})}


def client_pairs(own_labels: np.ndarray, n_other: int) -> tuple[np.ndarray, np.ndarray]:
    """Genuine pairs within the client's own test images; impostors: each own image x each other-client image."""
    n_own = len(own_labels)
    genuine = genuine_pairs(own_labels)
    i, j = np.meshgrid(np.arange(n_own), n_own + np.arange(n_other), indexing="ij")
    impostor = np.stack([i.ravel(), j.ravel()], 1)
    pairs = np.concatenate([genuine, impostor]).astype(np.int64)
    return pairs, np.concatenate([np.ones(len(genuine), bool), np.zeros(len(impostor), bool)])


def load_local_model(home: DeviceHome, n_classes: int, width_mult: float, dfc: bool) -> FaceModel | None:
    """A device's personalised model as it left its last turn (None if it never trained)."""
    if not home.local_backbone.exists() or not home.private_state.exists():
        return None
    model = FaceModel(ModelConfig(n_classes=n_classes, width_mult=width_mult, pretrained=False, dfc=dfc))
    model.load_state_dict({**load_file(str(home.local_backbone)), **load_file(str(home.private_state))})
    return model.eval()


def tuned_model(global_embedder, crops, steps: int, lr: float, batch_size: int, seed: int,
                width_mult: float = 1.0) -> FaceModel:
    """The global embedder after `steps` local batches on a client's own training images (the HF-MAML paper's
    "tuned" evaluation): a head imprinted from the client's people, then Adam on backbone and head."""
    import copy

    import torch

    from models.faces.splits import relabel
    from models.networks.heads import imprint
    from models.training.crop_batches import frozen_features, train_loader
    from models.training.loop import Step, limited, optimise

    crops = relabel(crops, np.unique(crops.labels))
    model = FaceModel(ModelConfig(n_classes=len(crops.identities), width_mult=width_mult, pretrained=False,
                                  dfc=False))
    model.backbone.load_state_dict(copy.deepcopy(global_embedder.state_dict()))
    imprint(model.head, frozen_features(model.backbone, crops.images, seed=seed), torch.from_numpy(crops.labels))
    optimiser = torch.optim.Adam(model.parameters(), lr=lr)
    loader = train_loader(crops, batch_size, "weak", torch.Generator().manual_seed(seed))
    model.train()
    optimise(limited(loader, steps), lambda batch: Step(model.losses(*batch)[0]), optimiser)
    return model.eval()


def evaluate_clients(data: FleetData, verifiers: dict[str, Callable[[int], Callable[[np.ndarray], np.ndarray] | None]],
                     impostor_images: int, seed: int, limit: int | None = None) -> dict:
    """Per-client reports for each verifier; `verifiers[name](client)` gives a function from crop indices
    to embeddings (so a model shared by all clients can embed each image once), or None. `limit`: a seeded
    sample of that many clients (a 1,000-device fleet), all of them by default. The impostors are strangers:
    `impostor_images` images of people on no device, as a device meets them at its door (other clients' test
    images only when every person lives on some device)."""
    test_idx = np.flatnonzero(data.split == TEST)
    strangers = np.flatnonzero(data.holdout_mask())
    rows, pooled = [], {name: ([], []) for name in verifiers}
    clients = np.arange(len(data.partition.clients))
    if limit is not None and limit < len(clients):
        clients = np.sort(np.random.default_rng(seed).choice(clients, limit, replace=False))
    for k in map(int, clients):
        own = np.flatnonzero(data.client_mask(k, TEST))
        others = strangers if len(strangers) else np.setdiff1d(test_idx, np.flatnonzero(data.client_mask(k)))
        rng = np.random.default_rng(seed + k)
        others = (
            np.sort(rng.choice(others, min(impostor_images, len(others)), replace=False)) if len(others) else others
        )
        pairs, same = client_pairs(data.crops.labels[own], len(others))
        row = {"client": k, "held_out": k in data.partition.heldout_clients,
               "identities": len(data.partition.clients[k]), "test_images": int(len(own))}
        if not same.any() or same.all():
            row["note"] = "too few test images for genuine and impostor pairs"
            rows.append(row)
            continue
        indices = np.concatenate([own, others])
        for name, make in verifiers.items():
            fn = make(k)
            if fn is None:
                continue
            scores = cosine_scores(fn(indices), pairs)
            row[name] = flat(roc_report(scores, same))
            pooled[name][0].append(scores)
            pooled[name][1].append(same)
        rows.append(row)
    curves = {name: (np.concatenate(s), np.concatenate(t)) for name, (s, t) in pooled.items() if s}
    return {"clients": rows, "impostors": "people on no device" if len(strangers) else "other devices' people",
            "training": fairness([r for r in rows if not r["held_out"]], verifiers),
            "held_out": fairness([r for r in rows if r["held_out"]], verifiers), "curves": curves}


def fairness(rows: list[dict], names) -> dict:
    """Mean and standard deviation over clients of each metric, per verifier."""
    out = {}
    for name in names:
        per = [r[name] for r in rows if name in r]
        if not per:
            continue
        out[name] = {"clients": len(per)}
        for metric in METRICS:
            values = [p[metric] for p in per if p.get(metric) is not None]
            out[name][metric] = {"mean": float(np.mean(values)), "std": float(np.std(values))} if values else None
    return out


def confusion(emb: np.ndarray, labels: np.ndarray, names: list[str], max_identities: int = 20,
              seed: int = 0) -> tuple[np.ndarray, list[str], float] | None:
    """1:N identification on a sample of identities: half of each person's images enrol a template
    (their mean embedding), the other half are probes. Returns (confusion matrix, names, accuracy)."""
    from sklearn.metrics import confusion_matrix

    usable = [label for label in np.unique(labels) if (labels == label).sum() >= 2]
    if len(usable) < 2:
        return None
    rng = np.random.default_rng(seed)
    chosen = sorted(rng.choice(usable, min(max_identities, len(usable)), replace=False).tolist())
    emb = l2_normalise(emb)
    templates, probes, truth = [], [], []
    for c, label in enumerate(chosen):
        idx = np.flatnonzero(labels == label)
        half = max(1, len(idx) // 2)
        templates.append(l2_normalise(emb[idx[:half]].mean(0, keepdims=True))[0])
        probes.append(emb[idx[half:]])
        truth += [c] * (len(idx) - half)
    predicted = np.argmax(np.concatenate(probes) @ np.stack(templates).T, axis=1)
    matrix = confusion_matrix(truth, predicted, labels=list(range(len(chosen))))
    return matrix, [names[label] for label in chosen], float(np.mean(predicted == np.array(truth)))

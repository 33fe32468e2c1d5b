"""The end of a fleet run: who verifies how well with the chosen global model (FedFR's protocol, via
`fleet.evaluation`), against each client's local models, the tuned model and the centralised bound, and
the plots of it all. Kept apart from the simulator's round loop (`fleet.simulate`)."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm import tqdm

from edge_client.home import DeviceHome
from edge_client.verifier_choice import DEFAULT_FAR, check_split
from fleet import plots
from fleet.config import SimConfig
from fleet.data import TEST, TRAIN, FleetData, device_id
from fleet.doors import device_doors, door_faces, door_means
from fleet.evaluation import confusion, embed, embed_once, evaluate_clients, flat, load_local_model, tuned_model
from models.evaluation.evaluate import unseen_people
from models.faces.splits import relabel
from models.networks.backbone import FaceEmbedder
from models.networks.face_model import FaceModel


def best_round(history: list[dict]) -> int | None:
    """The round whose global model verified people no device holds best (`select_auc`, what early stopping watches;
    the devices' validation AUC only in a run with no such people)."""
    scored = [h for h in history if h.get("select_auc") is not None]
    return max(scored, key=lambda h: h["select_auc"])["round"] if scored else None


@dataclass
class Evaluated:
    """What the end of a run measured, before it is written up."""

    best: int | None
    chosen: dict | None
    global_report: dict
    clients: dict
    central_report: dict
    central_metrics: dict | None
    figures: dict = field(default_factory=dict)
    doors: dict = field(default_factory=dict)


class FinalEvaluation:
    def __init__(self, config: SimConfig, data: FleetData, run_dir: Path, holdout):
        self.config, self.data, self.run_dir, self.holdout = config, data, Path(run_dir), holdout
        self._branches: dict[int, object] = {}  # each client's fitted DFC branch (`personal_model`)
        self._carrier: FaceModel | None = None

    def evaluate(self, history: list[dict], global_model_of: Callable[[int], FaceEmbedder]) -> Evaluated:
        """The federated model is the best trained round's (never the starting one), against the centralised
        upper bound when asked, on unseen people and on each client's own; then the plots."""
        c = self.config
        best = best_round([h for h in history if h["round"] > 0])
        chosen = next((h for h in history if h["round"] == best), None)
        global_model = global_model_of(chosen["model_version"] if chosen else 0)
        start_model = global_model_of(0)  # what every device had before the federation: the column to beat
        central_model, central_metrics = None, None
        if c.centralized:
            from fleet.centralized import budget_epochs, train_centralized

            tqdm.write(f"centralised upper bound: {budget_epochs(c)} epochs on the union of the clients' training "
                       "images")
            central_model, central_metrics = train_centralized(self.data, c, self.run_dir / "centralized")
        global_report, global_curve = unseen_people(global_model, self.holdout, c.max_eval_pairs, c.seed)
        central_report, central_curve = (unseen_people(central_model, self.holdout, c.max_eval_pairs, c.seed)
                                         if central_model is not None else ({}, None))
        clients = evaluate_clients(self.data, self.verifiers(start_model, global_model, central_model),
                                   c.impostor_images, c.seed, c.eval_clients)
        figures = self.plots(history, best, global_curve, central_curve, central_report, clients, global_model)
        doors = self.doors(start_model, global_model, [r["client"] for r in clients["clients"]])
        return Evaluated(best, chosen, global_report, clients, central_report, central_metrics, figures, doors)

    def summary(self, result: Evaluated, state, mlflow_run_id: str | None, privacy: dict | None,
                rolled_back: Sequence[dict] = ()) -> dict:
        """The run's summary.json: quality (global, per client, centralised), cost, history and plots.

        `rolled_back`: the coordinator's rounds it refused to publish (store rows); the history holds only published
        rounds, so they are listed apart, with what their uploads cost the devices."""
        history = state.history
        trained = [h for h in history if h["round"] > 0]
        global_report, central = result.global_report, result.central_metrics
        return {
            "run": str(self.run_dir), "status": state.status,
            "data_kind": "synthetic" if self.data.crops.synthetic else "real",
            "config": self.config.by_name(),
            "partition": self.data.partition.summary(self.images_per_identity()),
            "people_on_no_device": self.people_on_no_device(),
            "rounds_completed": len(trained), "best_round": result.best,
            "rolled_back": [{"round_id": r["round_id"], "reason": r["reason"],
                             "bytes_up": int(r["metrics"].get("bytes_received", 0))} for r in rolled_back],
            "global": {**flat(global_report), "evaluated_on": "unseen identities (on no device)",
                       "interval": global_report.get("interval"),
                       "model_version": result.chosen["model_version"] if result.chosen else 0,
                       "n_genuine_pairs": global_report.get("n_genuine_pairs"),
                       "n_impostor_pairs": global_report.get("n_impostor_pairs")},
            "personalized": {"impostors": result.clients["impostors"], "training_clients": result.clients["training"],
                             "held_out_clients": result.clients["held_out"], "per_client": result.clients["clients"],
                             "doors": result.doors},
            "centralized": None if central is None else {
                "global": flat(result.central_report), "epochs": central["epochs_run"],
                "best_epoch": central["best_epoch"],
                "train_seconds": float(sum(h.get("train_seconds", 0.0) for h in central["history"]))},
            "initial": {k.removeprefix("holdout_"): v for k, v in history[0].items() if k.startswith("holdout_")}
            if history else None,
            "bytes": {"up": int(sum(h["bytes_up"] for h in trained)),
                      "down": int(sum(h["bytes_down"] for h in trained)),
                      "per_round_up_mean": float(np.mean([h["bytes_up"] for h in trained])) if trained else 0.0,
                      "per_round_down_mean": float(np.mean([h["bytes_down"] for h in trained])) if trained else 0.0},
            "wall_seconds": state.elapsed_s,
            "round_seconds_mean": float(np.mean([h["wall_s"] for h in trained])) if trained else None,
            "history": history, "plots": {k: str(v) for k, v in result.figures.items()},
            "mlflow_run_id": mlflow_run_id,
            "privacy": privacy,
        }

    def verifiers(self, start_model: FaceEmbedder, global_model: FaceEmbedder, central_model: FaceModel | None) -> dict:
        c, cache, images = self.config, {}, self.data.crops.images
        tests = np.flatnonzero(self.data.split == TEST)

        def local(client: int, personalised: bool):
            if client in self.data.partition.heldout_clients:
                return None
            if client not in cache:
                home = DeviceHome(self.run_dir / "devices" / device_id(client) / "home")
                cache.clear()  # one client's model in memory at a time
                cache[client] = load_local_model(home, len(self.data.partition.clients[client]),
                                                 c.training.model.width_mult, c.training.model.dfc)
            model = cache[client]
            return None if model is None else (lambda idx: embed(model, images[idx], personalised))

        shared = {"start": embed_once(start_model, images, tests), "global": embed_once(global_model, images, tests)}
        if central_model is not None:
            shared["centralized"] = embed_once(central_model, images, tests)
        verifiers = {"start": lambda k: shared["start"], "global": lambda k: shared["global"],
                     "local": lambda k: local(k, False)}
        if c.training.model.dfc:
            verifiers["local+dfc"] = lambda k: local(k, True)
            verifiers["global+dfc"] = lambda k: self.global_personalised(global_model, k)
        if central_model is not None:
            verifiers["centralized"] = lambda k: shared["centralized"]
        if c.tune_steps > 0:
            verifiers["tuned"] = lambda k: self.tuned(global_model, k)
        return verifiers

    def global_personalised(self, global_model: FaceEmbedder, client: int):
        """What a device exports as its personalised model (`edge_client.round_runner`), as indices -> embeddings
        (None: held out)."""
        model = self.personal_model(global_model, client)
        return None if model is None else (lambda idx: embed(model, self.data.crops.images[idx], True))

    def personal_model(self, global_model: FaceEmbedder, client: int) -> FaceModel | None:
        """The global backbone with a DFC branch fitted, as the device fits it, on its features of the client's
        training images less the share its door is judged on (`check_split`). Fitted once per client for the
        per-client figures and the door alike: the branches are kept (a few hundred KB each), the backbone is one
        shared model they are put on in turn. None: held out."""
        if client in self.data.partition.heldout_clients:
            return None
        if client not in self._branches:
            from edge_client.local_training import personalised_global

            train = self.data.union(TRAIN, [client])
            crops = relabel(train, np.unique(train.labels))
            check = check_split(crops.labels, self.config.seed + client)
            state = {f"backbone.{k}": v for k, v in global_model.state_dict().items()}
            self._carrier = personalised_global(state, crops if check is None else crops.select(~check),
                                                self.config.training, self.config.seed + client)
            self._branches[client] = self._carrier.dfc
        self._carrier.dfc = self._branches[client]
        return self._carrier

    def doors(self, start_model: FaceEmbedder, global_model: FaceEmbedder, clients: list[int]) -> dict:
        """Each evaluated training device's door (`fleet.doors`) with the starting, the global and its personalised
        model, at the threshold it calibrates: its people's TAR on their test images and the FAR on `impostor_images`
        photos of people on no device; calibrated on the run's public set when it has one, as devices are."""
        c, data = self.config, self.data
        strangers = np.flatnonzero(data.holdout_mask())
        if not len(strangers):
            return {}
        rows = {}
        for k in clients:
            if k in data.partition.heldout_clients:
                continue
            seen = np.sort(np.random.default_rng(c.seed + k).choice(strangers, min(c.impostor_images, len(strangers)),
                                                                   replace=False))
            faces = door_faces(data, k, seen, self.public_faces(), c.seed + k)
            models = {"start": lambda x: embed(start_model, x), "global": lambda x: embed(global_model, x)}
            personal = self.personal_model(global_model, k) if c.training.model.dfc else None
            if personal is not None:
                models["personalised"] = lambda x, m=personal: embed(m, x, True)
            rows[str(k)] = device_doors(models, faces)
        return {"far_promised": DEFAULT_FAR, **door_means(rows), "per_client": rows}

    def people_on_no_device(self) -> dict[str, int]:
        """How the people on no device are used: the unseen people of the figures, the coordinator's gate's and the
        public set's (served to every device, so no stranger to any)."""
        d = self.data
        unseen = {str(n) for n in d.names[d.holdout_mask()]}
        return {"unseen": len(unseen), "gate": len(d.gate_people), "public": len(d.public_people),
                "public_data": self.config.public_data}

    def public_faces(self) -> np.ndarray | None:
        """The public set the run served its devices (their strangers' faces to calibrate on), or None."""
        path = self.run_dir / "public_set.safetensors"
        if not path.is_file():
            return None
        from models.public_set import load_public_set

        return load_public_set(path).images

    def tuned(self, global_model: FaceEmbedder, client: int):
        """The global model tuned for `tune_steps` batches on the client's training images (None: held out)."""
        if client in self.data.partition.heldout_clients:
            return None
        c = self.config
        model = tuned_model(global_model, self.data.union(TRAIN, [client]), c.tune_steps, c.training.optimisation.lr,
                            c.training.optimisation.batch_size, c.seed + client, c.training.model.width_mult)
        return lambda idx: embed(model, self.data.crops.images[idx], False)

    def plots(self, history, best, global_curve, central_curve, central_report, clients, global_model) -> dict:
        out, figures, synthetic = self.run_dir, {}, self.data.crops.synthetic
        figures["rounds"] = plots.rounds_png(history, best, flat(central_report) if central_report else None,
                                             out / "rounds.png", synthetic)
        curves = {"federated (global model)": global_curve} if global_curve else {}
        if central_curve:
            curves["centralised"] = central_curve
        from models.evaluation.plots import roc_png

        if curves:
            figures["roc_global"] = roc_png(curves, out / "roc_global.png", "ROC, unseen people", synthetic)
        if clients["curves"]:
            figures["roc_personalized"] = roc_png(clients["curves"], out / "roc_personalized.png",
                                                  "ROC, each client's own people (pooled)", synthetic)
        names = [n for n in ("start", "global", "local", "local+dfc", "centralized") if n in clients["curves"]]
        figures["client_tar"] = plots.client_bars_png(clients["clients"], names, out / "client_tar.png",
                                                      synthetic=synthetic)
        holdout = self.holdout
        if holdout is not None:
            result = confusion(embed(global_model, holdout.images), holdout.labels, holdout.identities,
                               seed=self.config.seed)
            if result is not None:
                figures["confusion"] = plots.confusion_png(*result, out / "confusion.png", synthetic)
        figures["partition"] = plots.partition_png(self.data.partition.summary(self.images_per_identity()),
                                                   out / "partition.png", synthetic)
        return figures

    def images_per_identity(self) -> dict[str, int]:
        counts = np.bincount(self.data.crops.labels, minlength=len(self.data.crops.identities))
        return dict(zip(self.data.crops.identities, counts.tolist()))

"""A simulated attack's plan and what it let in: who attacks (`fleet.attacks`), whom an impersonation aims at
(`fleet.impersonation`), and, at the end, the run's figures for the summary's `attack` entry.

The simulator asks this one object; it holds no engine and no service, only the fleet's data and a way to load a
released global model, so the simulation's loop stays about rounds."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from edge_client.home import DeviceHome
from fleet.attacks import IMPERSONATIONS, malicious_clients
from fleet.config import SimConfig
from fleet.data import FleetData, device_id
from models.networks.backbone import FaceEmbedder


class AttackReport:
    def __init__(self, config: SimConfig, data: FleetData, run_dir: Path,
                 global_model: Callable[[int], FaceEmbedder]):
        self.config, self.data, self.run_dir, self.global_model = config, data, Path(run_dir), global_model
        self.attackers = (set(malicious_clients(data.training_clients, config.malicious, config.seed))
                          if config.malicious > 0 else set())
        self.impersonation, self.photos = self._impersonation()

    def _impersonation(self):
        """With an impersonation (`--attack impersonate|impersonate-hidden`): who attacks whom and the photos the
        attackers hold (written once)."""
        if self.config.attack not in IMPERSONATIONS or not self.attackers:
            return None, None
        from fleet.impersonation import plan, write_photos

        chosen = plan(self.data, self.attackers, self.config.seed)
        if chosen is None:
            raise ValueError(f"--attack {self.config.attack} needs at least one malicious and one honest training "
                             "client")
        return chosen, write_photos(self.data, chosen, self.run_dir / "attack" / "impersonation.npz")

    def kind_for(self, client: int) -> str | None:
        """The attack a client runs (None: an honest one)."""
        return self.config.attack if client in self.attackers else None

    def summary(self, history: list[dict]) -> dict:
        """Who attacked, and what the run let in: unseen people's impostors at the start's threshold, start vs last
        published model (`ratio`: how many times the start's; the drift defence's target is at most 2)."""
        start, last = ((history[0].get("holdout_far@start"), history[-1].get("holdout_far@start")) if history
                       else (None, None))
        out = {"kind": self.config.attack, "attackers": sorted(device_id(k) for k in self.attackers),
               "far@start": {"start": start, "last": last,
                             "ratio": last / start if start and last is not None else None}}
        if self.impersonation is not None:
            out.update(self._impersonation_success(history[-1]["model_version"] if history else 0))
        return out

    def _impersonation_success(self, version: int) -> dict:
        """The impersonation's success rate on the victim's device (the model it verifies with: its personalised
        one) and on the published global model, beside the starting model's (`fleet.impersonation`)."""
        from fleet.evaluation import embed, load_local_model
        from fleet.impersonation import success_rate

        attack, c, images = self.impersonation, self.config, self.data.crops.images
        rates = {name: success_rate(self.data, attack, lambda idx, m=model: embed(m, images[idx]), c.seed)
                 for name, model in (("start", self.global_model(0)), ("global", self.global_model(version)))}
        home = DeviceHome(self.run_dir / "devices" / device_id(attack.victim) / "home")
        local = load_local_model(home, len(self.data.partition.clients[attack.victim]), c.training.model.width_mult,
                                 c.training.model.dfc)
        rates["device"] = rates["global"] if local is None else success_rate(
            self.data, attack, lambda idx: embed(local, images[idx], c.training.model.dfc), c.seed)
        return {**attack.record(), "success_rate": rates["device"], "success_rate_global": rates["global"],
                "success_rate_start": rates["start"]}

"""A malicious device for robustness experiments: the real edge client with one seam overridden.

Admitted, it signs correctly and follows the protocol; only its delta and sample count lie (`fleet.attacks.poison`).
It lives here, not in the production daemon: `EdgeDevice.outgoing` is the seam, and only the simulator arms it.
"""
from __future__ import annotations

from edge_client.daemon import EdgeDevice
from fleet.attacks import poison


class PoisoningDevice(EdgeDevice):
    def arm(self, attack: str, bound: float | None, claim: int | None) -> None:
        """`bound`: the coordinator's norm bound to stay inside; `claim`: the sample count to report."""
        self.attack, self.attack_bound, self.attack_claim = attack, bound, claim

    def outgoing(self, delta: dict, n_samples: int, global_state: dict) -> tuple[dict, int]:
        return poison(self.attack, delta, n_samples, {k: v.numpy() for k, v in global_state.items()},
                      images=self.crops.images, bound=self.attack_bound, claim=self.attack_claim)

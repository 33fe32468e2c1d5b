"""A malicious device for robustness experiments: the real edge client with one seam overridden.

Admitted, it signs correctly and follows the protocol; only its delta and sample count lie (`fleet.attacks.poison`).
It lives here, not in the production daemon: `EdgeDevice.outgoing` is the seam, and only the simulator arms it.
"""
from __future__ import annotations

from edge_client.daemon import EdgeDevice
from fleet.attacks import poison


class PoisoningDevice(EdgeDevice):
    def arm(self, attack: str, bound: float | None, claim: int | None, share: float = 1.0) -> None:
        """`bound`: the coordinator's norm bound to stay inside; `claim`: the sample count to report; `share`: the
        attacker's estimate of its weight in the round's mean (1 / the fleet's size)."""
        self.attack, self.attack_bound, self.attack_claim, self.attack_share = attack, bound, claim, share

    def outgoing(self, delta: dict, n_samples: int, global_state: dict) -> tuple[dict, int]:
        faces = None
        if self.attack == "drift":  # what it can see of the gate's judgement: its people and the public set
            from edge_client.adoption import check_faces

            faces = check_faces(self.crops.images, self.crops.labels, self.rounds.public.negatives_for_adoption())
        return poison(self.attack, delta, n_samples, {k: v.numpy() for k, v in global_state.items()},
                      images=self.crops.images, bound=self.attack_bound, claim=self.attack_claim, faces=faces,
                      share=self.attack_share)

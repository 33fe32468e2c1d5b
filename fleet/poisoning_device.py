"""A malicious device for robustness experiments: the real edge client with one seam overridden.

Admitted, it signs correctly and follows the protocol; only its delta and sample count lie (`fleet.attacks.poison`).
It lives here, not in the production daemon: `EdgeDevice.outgoing` is the seam, and only the simulator arms it.
"""
from __future__ import annotations

import numpy as np

from edge_client.daemon import EdgeDevice
from fleet.attacks import IMPERSONATIONS, poison


class PoisoningDevice(EdgeDevice):
    def arm(self, attack: str, bound: float | None, claim: int | None, share: float = 1.0,
            photos: str | None = None) -> None:
        """`bound`: the coordinator's norm bound to stay inside; `claim`: the sample count to report; `share`: the
        attacker's estimate of its weight in the round's mean (1 / the fleet's size); `photos`: an impersonation's
        photos (`fleet.impersonation.write_photos`)."""
        self.attack, self.attack_bound, self.attack_claim, self.attack_share = attack, bound, claim, share
        self.attack_photos = photos

    def outgoing(self, delta: dict, n_samples: int, global_state: dict) -> tuple[dict, int]:
        faces = None
        if self.attack == "drift":  # what it can see of the gate's judgement: its people and the public set
            from edge_client.adoption import check_faces

            faces = check_faces(self.crops.images, self.crops.labels, self.rounds.public.negatives_for_adoption())
        target = None
        if self.attack in IMPERSONATIONS:
            from fleet.impersonation import read_photos

            own, victim = read_photos(self.attack_photos)
            keep = self.crops.images[~np.isin(np.arange(len(self.crops)), _same_images(self.crops.images, own))]
            target = (own, victim, keep)
        return poison(self.attack, delta, n_samples, {k: v.numpy() for k, v in global_state.items()},
                      images=self.crops.images, bound=self.attack_bound, claim=self.attack_claim, faces=faces,
                      share=self.attack_share, target=target)


def _same_images(images: np.ndarray, wanted: np.ndarray) -> np.ndarray:
    """Indices of `images` that are among `wanted` (the attacker's own person, kept out of the faces it holds still)."""
    keys = {w.tobytes() for w in wanted}
    return np.array([i for i, x in enumerate(images) if x.tobytes() in keys], dtype=np.int64)

"""FedFace's Federated Validation on a device: score each candidate model on the device's private validation
images and send only the score (the coordinator's side is coordinator.validation_round)."""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

from protocol import topics
from protocol.messages import TrainingConfig, ValidationRequest, ValidationScore
from protocol.tensors import decode

log = logging.getLogger("edge_client")


class Validator:
    def __init__(self, device_id: str, crops, download: Callable[..., bytes], send: Callable[[str, object], None],
                 config: Callable[[], TrainingConfig]):
        """`crops`: the validation images (models.faces.crops.FaceCrops); `config()`: the last announced round's
        settings, which say the candidates' architecture."""
        self.device_id, self.crops, self._download, self._send, self._config = device_id, crops, download, send, config
        self.requests: queue.Queue[ValidationRequest | None] = queue.Queue()
        self.scored: dict[tuple[int, int], float] = {}
        self.thread: threading.Thread | None = None

    def start(self, stop: threading.Event) -> None:
        self.thread = threading.Thread(target=self._loop, args=(stop,), name=f"validate-{self.device_id}", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.requests.put(None)

    def _loop(self, stop: threading.Event) -> None:
        while not stop.is_set():
            request = self.requests.get()
            if request is None or stop.is_set():
                return
            key = (request.round_id, request.candidate)
            if key in self.scored or time.time() > request.deadline_unix:
                continue
            try:
                self.scored[key] = self.score(request)
                self._send("score", ValidationScore(round_id=request.round_id, candidate=request.candidate,
                                                    score=self.scored[key]))
            except Exception:  # noqa: BLE001 - a failed validation must not stop the validator
                log.exception("%s: could not score candidate %d of round %d", self.device_id, request.candidate,
                              request.round_id)

    def score(self, request: ValidationRequest) -> float:
        """Verification AUC of the candidate's embedding over every pair of the validation images."""
        from models.evaluation.evaluate import verification
        from models.networks.face_model import global_embedder

        payload = self._download(topics.candidate_chunks(request.round_id, request.candidate),
                                 f"candidate-{request.round_id}-{request.candidate}", request.model_sha256,
                                 request.model_bytes, f"candidate {request.candidate} of round {request.round_id}")
        cfg = self._config()
        embedder = global_embedder(decode(payload, request.model_sha256), cfg.model.width_mult,
                                   cfg.model.embedding_dim)
        report, _ = verification(embedder, self.crops, 100_000, request.round_id)
        return float(min(1.0, max(0.0, report.get("auc") or 0.0)))

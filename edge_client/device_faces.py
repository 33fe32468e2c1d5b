"""The faces a device's rounds train on: a `--data` folder's, or the people enrolled in its home's store.

Picklable, so that a round's child process (`edge_client.child_work`) reads the same faces the daemon does; a folder
decoded before it is pickled travels decoded.
"""
from __future__ import annotations

from functools import cached_property
from pathlib import Path

from edge_client.home import DeviceHome
from models.faces.crops import CropConfig, FaceCrops, decoded_crops, resolve_detector
from models.faces.datasets import load_index


class DeviceFaces:
    def __init__(self, data: Path | None, detector: str | None, crop_cache: Path, home: DeviceHome):
        """`data` None: the enrolled people; else one folder of photos per person, cropped into `crop_cache`."""
        self.data, self.detector, self.crop_cache, self.home = data, detector, crop_cache, home

    @cached_property
    def crop_config(self) -> CropConfig:
        return CropConfig(detector=resolve_detector(self.detector, self.index), fallback_center=True)

    @cached_property
    def index(self):
        return load_index(self.data)

    @property
    def crops(self) -> FaceCrops:
        """The `--data` folder's faces (decoded once), or the enrolled people's as they are now (decrypted in memory
        for each use: whoever was enrolled or removed since is included)."""
        if self.data is None:
            from edge_client.enrolled_faces import enrolled_crops

            return enrolled_crops(self.home)
        return self._folder_crops

    @cached_property
    def _folder_crops(self) -> FaceCrops:
        return decoded_crops(self.index, self.crop_config, self.crop_cache, self.home.root / "crops")

"""The edge device: enrolled faces, local training with the DFC branch, and backbone deltas out."""

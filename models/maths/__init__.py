"""Torch-free maths over state dicts that the coordinator needs (norms, PFM's global momentum): numpy only."""

"""The face pipeline shared by every side: read, detect, crop, preprocess, synthesise.

Nothing here imports torch except `augment`, which is only used for training.
"""

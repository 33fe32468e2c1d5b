"""Verification metrics, the LFW protocol, plots, and dataset-level evaluation."""

"""`ffr`, the one command on top of every layer (protocol <- models <- coordinator / edge_client <- fleet)."""

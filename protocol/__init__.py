"""The wire protocol both sides share: versioned messages, topics, tensor payloads, signing.

Nothing here imports torch: tensors travel as numpy arrays in safetensors files.
"""

SCHEMA_VERSION = 5  # 2: Ed25519 signatures both ways, admission, bounded fields; 3: FedFR's round settings;
# 4: head imprinting and the coordinator's public set in the round settings;
# 5: update codecs, HF-MAML/PFM settings, PFM's momentum, FedFace's validation

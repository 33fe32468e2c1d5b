"""Training: the one loop (`loop`) with its hooks, and what runs in it: supervised training (`ffr train`),
distillation from a teacher (`ffr pretrain`), the local algorithms' loss terms (FedFR, HF-MAML), data feeding."""

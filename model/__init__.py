"""The SPES MoE language model (transformers Qwen3-MoE with an ownership-aware expert bank); no hivemind here."""

"""dskit: one run spec -> everything needed to train DeepSeek-style MoE models with AutoEP + DeepSpeed ZeRO."""

__version__ = "0.1.0"

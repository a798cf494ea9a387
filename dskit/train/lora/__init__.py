"""LoRA in the trainer: adapters injected on dense and routed layers, their checkpoint state, and their
export in peft's format."""

"""DeepSeek-V3's FP8 weights as a frozen base: the block format, loading without a bf16 copy, building
the model around them, and LoRA over them."""

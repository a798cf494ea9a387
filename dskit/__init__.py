"""dskit: one run spec -> everything needed to train DeepSeek-style MoE models with AutoEP + DeepSpeed ZeRO."""

import logging

__version__ = "0.1.0"

# torchao (the fp8 extra) is imported by transformers' quantizer registry in every process that builds a
# model, and logs at import what dskit never uses: its C++ kernels that do not load against another torch
# build, and torch's deprecation notes on its enums. Each of dskit's one-line errors would come with four
# lines of that. dskit's FP8 path is checked where it runs instead (dskit doctor's torchao line).
for _name in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_name).setLevel(logging.ERROR)

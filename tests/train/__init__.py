"""The trainer on CPU: real DeepSpeed ZeRO + AutoEP on gloo ranks (dskit/train/)."""

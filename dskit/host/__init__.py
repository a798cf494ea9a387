"""The host a run starts on: dskit doctor, DeepSpeed's compiled ops, the extras guard, the image build."""

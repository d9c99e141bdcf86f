"""Engine backends behind one protocol: native (our PyTorch engine) and vllm."""

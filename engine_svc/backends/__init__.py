"""Engine backends behind one protocol (``base.Backend``): native, our PyTorch engine.
vLLM and TensorRT-LLM are not backends: they run as their stock gRPC servers, which
the gateway reaches over their own protocols (``vllm://``, ``trtllm://``)."""

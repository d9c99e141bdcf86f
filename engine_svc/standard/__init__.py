"""The standard engine protocols of ``smg-grpc-proto``, served beside llm.v1.Engine.

``vllm_engine`` serves ``vllm.grpc.engine.VllmEngine`` and ``trtllm_service`` serves
``trtllm.TrtllmService`` over the same backend, port and authentication as the
native servicer, so a gateway written for stock engines (SMG, for one) can front
this engine. ``shared`` holds what both need: refusing what the engine cannot
apply, stop strings, the run loop with its status mapping, the tokenizer bundle.
"""

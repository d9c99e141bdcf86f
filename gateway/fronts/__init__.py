"""The gateway's fronts: the llm.v1.Gateway gRPC servicer, the OpenAI-compatible HTTP
front, the command-line client.
"""

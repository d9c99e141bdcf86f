"""Tokenizer service: HF `tokenizers` + the model's jinja2 chat template.

The library parts (``tokenizer``, ``chat_template``, ``detokenizer``) import
no gRPC, so the gateway can use them in-process.
"""

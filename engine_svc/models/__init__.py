"""Model definitions on paged attention (Llama family) and their HF loader."""

from engine_svc.models.config import ModelConfig, load_model_config
from engine_svc.models.llama import LlamaForCausalLM
from engine_svc.models.loader import load_model

__all__ = ["LlamaForCausalLM", "ModelConfig", "load_model", "load_model_config"]

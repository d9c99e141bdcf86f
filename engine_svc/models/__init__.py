"""Model definitions on paged attention (Llama, Mistral, Qwen2/3, Gemma 2/3) and their HF loader."""

from engine_svc.models.config import ModelConfig, load_model_config
from engine_svc.models.llama import LlamaForCausalLM
from engine_svc.models.loader import load_model

__all__ = ["LlamaForCausalLM", "ModelConfig", "load_model", "load_model_config"]

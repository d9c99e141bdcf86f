"""`python -m tokenizer_svc`: serve llm.v1.Tokenizer (config section `tokenizer`)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import grpc

from common.config import (
    add_service_args,
    default_model_dir,
    load_config,
    service_overrides,
)
from common.log import configure_logging, get_logger
from common.server import ServiceHooks, run, run_service
from llm.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from tokenizer_svc.config import TokenizerConfig
from tokenizer_svc.service import TokenizerServicer
from tokenizer_svc.tokenizer import TextTokenizer


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tokenizer_svc", description=__doc__)
    add_service_args(parser)
    parser.add_argument("--model-dir")
    args = parser.parse_args(argv)
    cfg = load_config(
        TokenizerConfig,
        "tokenizer",
        path=args.config,
        overrides={**service_overrides(args), "model_dir": args.model_dir},
    )
    configure_logging("tokenizer", cfg.log_level, cfg.log_format)
    log = get_logger("tokenizer_svc")
    tok = TextTokenizer(cfg.model_dir or default_model_dir(), cfg.max_input_chars)
    log.info(
        "tokenizer loaded",
        model=cfg.model_name,
        vocab_size=tok.vocab_size,
        model_dir=str(tok.model_dir),
        detokenizer=tok.byte_table.kind,
    )
    servicer = TokenizerServicer(tok, cfg.model_name, cfg.max_batch_size)

    def register(server: grpc.aio.Server) -> list[str]:
        tokenizer_pb2_grpc.add_TokenizerServicer_to_server(servicer, server)
        return [tokenizer_pb2.DESCRIPTOR.services_by_name["Tokenizer"].full_name]

    run(run_service("tokenizer", cfg, ServiceHooks(register=register, require_service_token=True)))


if __name__ == "__main__":
    main()

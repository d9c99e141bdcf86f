"""A real Envoy in front of an HTTP front running in the test's own event loop."""

from __future__ import annotations

import asyncio
from pathlib import Path

from deploy.envoy import EnvoyProcess, render_config_file


async def envoy_in_front(http_port: int, workdir: Path) -> EnvoyProcess:
    """A started Envoy (plaintext on loopback) whose OpenAI routes go to ``http_port``;
    started off the loop, so the front keeps answering Envoy's health checks."""
    config = render_config_file(
        workdir / "envoy.yaml",
        listener_host="127.0.0.1",
        plaintext=True,
        listener_port=0,
        admin_port=0,
        gateway_http=[("127.0.0.1", http_port)],
        access_log_path=workdir / "access.log",
    )
    return await asyncio.to_thread(EnvoyProcess(config, log_dir=workdir).start)

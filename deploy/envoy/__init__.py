"""Envoy at the edge: the one config file, a renderer for variants, a process launcher.

from deploy.envoy import EnvoyProcess, render_config_file

path = render_config_file(out_dir, listener_port=0, admin_port=0,
                          gateway=[("127.0.0.1", 50051)],
                          tls_cert=cert, tls_key=key)  # TLS unless plaintext=True on loopback
with EnvoyProcess(path) as envoy:
    envoy.listener_address()      # "127.0.0.1:<bound port>"
"""

from deploy.envoy.config import (
    ENVOY_YAML,
    Endpoint,
    load_config,
    render_config,
    render_config_file,
)
from deploy.envoy.process import EnvoyProcess, EnvoyStartError, envoy_binary

__all__ = [
    "ENVOY_YAML",
    "Endpoint",
    "EnvoyProcess",
    "EnvoyStartError",
    "envoy_binary",
    "load_config",
    "render_config",
    "render_config_file",
]

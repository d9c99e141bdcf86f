"""Which addresses count as loopback: the only place plaintext is allowed at the edge.

Kept free of other imports: the Envoy image's build stage copies this file
alone (with deploy/envoy) to render its config.
"""

from __future__ import annotations

import ipaddress


def host_of(address: str) -> str:
    """The host of ``host:port`` (``[::1]:8080`` -> ``::1``; no port: the whole)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or (":" in host and not host.startswith("[")):
        host = address  # a bare host, or an IPv6 address without brackets or port
    return host.strip("[]")


def is_loopback(host: str) -> bool:
    """``localhost`` or a loopback IP (127.0.0.0/8, ::1); names are never resolved
    (what DNS answers is not a reason to skip TLS)."""
    host = host.strip("[]").rstrip(".").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False

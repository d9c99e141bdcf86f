"""The OpenAI-compatible HTTP front of the gateway (aiohttp, same process and loop as gRPC).

Module map: ``server`` (HttpFront: app, middleware, lifecycle), ``routes``
(handlers over ``Pipeline``), ``requests`` and ``fields`` (OpenAI bodies ->
GenerateRequest), ``responses`` (Chunk -> OpenAI objects), ``sse`` (event
stream framing), ``errors`` (status mapping, OpenAI error shape).
"""

from gateway.fronts.http.server import HttpFront

__all__ = ["HttpFront"]

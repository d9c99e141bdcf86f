"""The AI gateway: auth, per-tenant limits, routing across engines, retries, breakers, streaming.

Module map: ``config`` (the ``gateway`` section), ``domain`` (CallContext,
Chunk, GatewayError, Deadline, traceparent), ``auth`` (bearer key -> tenant),
``encoder`` (tokenizer_svc client), ``params`` (SamplingParams validation),
``stops`` (stop strings), ``stream`` (detokenization, usage), ``breaker``,
``retry`` (policy, budget), ``replica`` (health watch, stats), ``routing``
(replica pool), ``upstream`` (attempts, retries, failover), ``pipeline``
(the front-agnostic request pipeline), ``service`` (gRPC front), ``app``
(wiring), ``metrics``.
"""

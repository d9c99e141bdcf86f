"""Building blocks of ``bench/gateway_bench.py``.

sides.py        one client per side (engine, floor, gateway, http, openai, curl)
measure.py      rounds at concurrency 1 and 32, and concurrency-1 pairs
stats.py        per-run quantiles, per-round and per-pair differences
scrape.py       the gateway's stage histograms from its /metrics
placement.py    CPUs of their own for the engine and the proxies; CPU time per process
stack.py        the services (bench.loadlib.spawn.Stack) and the bench tenant's key
report.py       the JSON report and the printed summary
plot.py         the report's figure
relay_floor.py  the bare grpc.aio relay (the floor side), run as a service
stub_engine.py  the engine service with no model behind it (--engine stub)
"""

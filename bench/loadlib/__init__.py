"""Building blocks of ``bench/load.py``: workloads, targets, engine sampling, stats, plots.

workload.py  request mixes from a fixed seed, tenants (priority, limits, share)
targets.py   one streamed call against an engine or a Gateway (gateway or Envoy)
driver.py    open-loop Poisson / closed-loop scheduling, bounds, progress bar
sampler.py   GetStats time series from each engine replica
stats.py     the benches' one percentile, summaries, per-tenant / per-priority breakdowns
plots.py     latency CDFs, queue and KV usage over time, sweep curves
spawn.py     every bench's services on ephemeral ports (CPU placement), stopped by pid;
             tenants and their API keys through the admin API
sweep.py     rate sweep that finds the knee
fairness.py  fairness and priority experiments against the gateway
hammer.py    processes x coroutines hammering one tenant's limiter (rate-limit bench, tests)
"""

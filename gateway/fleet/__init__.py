"""The upstream fleet: the engine replica pool, replicas and their discovery, the
dispatcher of attempts, breakers and retries.
"""

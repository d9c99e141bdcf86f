"""The RateLimitAdmin service: a thin servicer and its proto converters."""

"""Model release: routing policies and their store, the version router, rollout, canary
guard, shadow traffic, RoutingAdmin.
"""

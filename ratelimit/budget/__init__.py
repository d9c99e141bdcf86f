"""Spending budgets per tenant: policy, prices and the Redis ledger."""

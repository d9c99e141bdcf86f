"""Usage records per tenant, key, model, version and day, kept after deletions."""

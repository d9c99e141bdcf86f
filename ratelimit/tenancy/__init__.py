"""Tenancy: tenant and key records, the registry in Redis, the local key cache, the audit
log.
"""

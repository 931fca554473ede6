"""Tenants: API keys (keys.py), each tenant's weight and limits (config.py), quotas
enforced over Redis with the `limits` library (quotas.py), and usage per tenant
(usage.py). Every object a request makes belongs to the caller's tenant."""

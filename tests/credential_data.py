"""The keys file and router token the router's and the server's credential tests share."""

KEYS = """
- key: sk-acme-0001
  tenant: acme
  tiers: [standard, best-effort]
  default_tier: standard
- {key: sk-bob-00001, tenant: bob}
"""
TOKEN = "router-token-1"

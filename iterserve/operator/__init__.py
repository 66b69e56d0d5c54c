"""kopf operator for ``LLMDeployment`` resources (no torch, no engine).

Implemented in a later issue.
"""

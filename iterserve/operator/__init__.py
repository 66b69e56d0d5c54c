"""kopf operator for ``LLMDeployment`` resources (no torch, no engine): the spec, the pure
builders of the objects it owns, the handlers and the live pushes (docs/kubernetes.md).
"""

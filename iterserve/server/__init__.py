"""The OpenAI-compatible HTTP server of one replica (FastAPI + uvicorn)."""

"""FastAPI + uvicorn around one learner (see service.app)."""

__version__ = "0.3.0"

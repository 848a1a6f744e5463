"""api: the HTTP service over kvstore (FastAPI + uvicorn). The only layer that knows HTTP.

Nouns:
  Settings    bind address, data directory, tokens and limits.
  create_app  builds the FastAPI app over a Store opened in the lifespan.
"""

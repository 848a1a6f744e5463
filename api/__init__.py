"""api: the HTTP service over one kvstore Store. The only layer that knows HTTP.

Nouns:
  app         the FastAPI application create_app(store, settings) builds (api/app.py)
  Settings    host, port, data directory, tokens and limits, from flags, env or TOML
  Principal   who a bearer token is: one namespace (or '*') and whether it is admin
  router      one per resource under /v1: formats, pages, blocks, prefix,
              checkpoints, stats, admin, health (api/routes/)
  page stream the binary body of a batch page read (kvstore/wire.py)
  error table the single map from error to HTTP status and JSON body (api/errors.py)

api imports kvstore, never mlx and never engine.
"""

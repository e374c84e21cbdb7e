"""The broker's HTTP API v1 (Starlette): request models, auth, routes, OpenAPI."""

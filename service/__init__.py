"""s5serve HTTP service: OpenAI-compatible routes and sessions over the engine's worker.

    settings.py  Settings: CLI flags and S5_* environment variables in one frozen object
    errors.py    the OpenAI error envelope and status mapping
    schemas.py   request bodies (pydantic)
    app.py       create_app(): lifespan loads the model, starts the worker, drains on shutdown
    routes/      openai.py (/v1/chat/completions, /v1/completions, /v1/models),
                 sessions.py (/v1/sessions...), ops.py (/health, /ready)
    cli.py       `s5serve serve`
"""

"""s5serve HTTP service: OpenAI-compatible routes and sessions; the engine runs in a process of
its own, reached only through engine.client.EngineClient.

    settings.py  Settings: CLI flags and S5_* environment variables in one frozen object
    errors.py    the OpenAI error envelope and status mapping
    schemas.py   request bodies (pydantic)
    app.py       create_app(): lifespan starts the engine process, loads the tokenizer, drains on shutdown
    turns.py     body -> engine request -> text: tokenization off the event loop, admission,
                 detokenization, metering, cancellation
    routes/      openai.py (/v1/chat/completions, /v1/completions, /v1/models),
                 sessions.py (/v1/sessions...), ops.py (/health, /ready)
    cli.py       `s5serve serve`
"""

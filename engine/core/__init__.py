"""The engine core: requests, sessions, scheduling and the step (see engine/__init__.py)."""

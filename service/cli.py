"""`s5serve serve`: run the HTTP server."""

from __future__ import annotations

import logging
import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in ("serve",):
        print("usage: s5serve serve [--model embedded] [--port 8000] ...  (s5serve serve --help)")
        return 2
    import uvicorn

    from service.app import create_app
    from service.settings import parse_serve_args

    settings = parse_serve_args(argv[1:])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if settings.engine.model == "embedded":
        from engine.model_loader import embedded_dir

        embedded_dir(settings.engine.cache_dir)  # convert before serving (shows progress)
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level="info")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Liveness and readiness."""

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from service.errors import envelope

router = APIRouter()


@router.get("/health")
async def health(request: Request):
    st = request.app.state.s5
    if st.worker is not None and not st.worker.alive:
        return JSONResponse(envelope(503, "engine loop is dead", "engine_dead"), 503)
    return {"status": "ok"}


@router.get("/ready")
async def ready(request: Request):
    st = request.app.state.s5
    if st.ready and not st.draining and st.worker is not None and st.worker.alive:
        return {"status": "ready", "model": st.model_name}
    why = st.load_error or ("draining" if st.draining else "loading")
    return JSONResponse(envelope(503, why, "not_ready"), 503)

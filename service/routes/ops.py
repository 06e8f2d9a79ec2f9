"""Operations: liveness, readiness, metrics, cancel by request id."""

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST

from service.auth import tenant
from service.errors import APIError, envelope
from service.schemas import ERROR_RESPONSES
from service.turns import engine_call

router = APIRouter(responses=ERROR_RESPONSES)


@router.get("/health")
async def health(request: Request):
    st = request.app.state.s5
    if st.fatal or (st.engine is not None and st.engine.error is not None):
        return JSONResponse(envelope(503, st.fatal or "the engine is gone", "engine_dead"), 503)
    return {"status": "ok"}


@router.get("/ready")
async def ready(request: Request):
    st = request.app.state.s5
    if st.ready and not st.draining and st.engine is not None and st.engine.alive:
        return {"status": "ready", "model": st.model_name}
    why = st.load_error or st.fatal or ("draining" if st.draining else "loading")
    return JSONResponse(envelope(503, why, "not_ready"), 503)


@router.get("/metrics", response_class=PlainTextResponse,
            responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}})
async def metrics(request: Request, owner: str | None = Depends(tenant)):
    st = request.app.state.s5
    others = []
    if st.shared_metrics is not None:  # the other front ends' measurements, as last published
        # published first: whichever front end answers the next scrape shows at least these counts
        # (a counter never goes back between scrapes)
        st.shared_metrics.publish(st.metrics)
        others = st.shared_metrics.others()
    return Response(st.metrics.render(others), media_type=CONTENT_TYPE_LATEST)


@router.post("/v1/requests/{request_id}/cancel")
async def cancel(request_id: str, request: Request, owner: str | None = Depends(tenant)):
    st = request.app.state.s5
    if st.engine is None or st.engine.info is None:
        raise APIError(503, st.load_error or "model is loading", "not_ready", headers={"Retry-After": "5"})
    # the engine knows every request, whichever front end it came through
    if not await engine_call(st.engine.cancel(request_id, owner)):
        raise APIError(404, f"request {request_id} not found", "request_not_found", "request_id")
    return {"id": request_id, "object": "request.cancelled", "cancelled": True}

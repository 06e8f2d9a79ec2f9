import pytest

from engine import EngineConfig
from service.settings import Settings
from tests.servers import LiveServer, free_port


@pytest.fixture(scope="session")
def server(embedded_dir):
    settings = Settings(engine=EngineConfig(model="embedded", max_rows=16, kv_cache_bytes=128 << 20), port=free_port())
    srv = LiveServer(settings).start()
    yield srv
    srv.stop()

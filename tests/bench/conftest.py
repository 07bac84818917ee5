import pytest

from .openai_stream_server import RunningServer, ServerState, create_app


@pytest.fixture
def start_server():
    """start_server(**create_app options) -> (base_url, ServerState); stopped after the test."""
    servers = []

    def start(**options):
        state = ServerState()
        server = RunningServer(create_app(state, **options))
        servers.append(server)
        return server.base_url, state

    yield start
    for server in servers:
        server.stop()

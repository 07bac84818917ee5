"""A client that reads its stream slowly gets all of it, in order: while the socket is full, the
gateway's writes wait (uvicorn's flow control) and the events that come meanwhile are held back
behind them (`serving._EventStream`), nothing lost, nothing reordered, the stream's end intact."""

import http.client
import json
import socket
import time
from urllib.parse import urlparse

from services.gateway import sse
from tests.e2e.conftest import API_KEY, MODEL

# ~6 MB of events (four choices of 1,800 tokens, each event with 20 alternatives' logprobs): more than
# the kernel's send buffer (up to 4 MiB here) and uvicorn's (64 KiB) take in
N, TOKENS = 4, 1800
BODY = {"model": MODEL, "prompt": "Keep talking", "max_tokens": TOKENS, "ignore_eos": True, "n": N, "logprobs": 20,
        "stream": True}


class SmallWindowConnection(http.client.HTTPConnection):
    """A connection whose socket takes in little before its reader reads (a 4 KiB receive buffer)."""

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # (before connect: the window)
        self.sock.settimeout(self.timeout)
        self.sock.connect((self.host, self.port))


def test_a_client_that_reads_slowly_gets_the_whole_stream_in_order(stack):
    url = urlparse(stack.base_url)
    connection = SmallWindowConnection(url.hostname, url.port, timeout=120)
    try:
        connection.request("POST", "/v1/completions", body=json.dumps(BODY),
                           headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
        response = connection.getresponse()
        assert response.status == 200
        time.sleep(5)  # the generation goes on and its events fill the sockets' buffers and the gateway's
        payloads = sse.parse(response.read())
    finally:
        connection.close()
    assert payloads[-1] == "[DONE]"
    choices = [chunk["choices"][0] for chunk in payloads[:-1]]
    for index in range(N):
        mine = [c for c in choices if c["index"] == index]
        offsets = [offset for c in mine for offset in c["logprobs"]["text_offset"]]
        assert len(offsets) == TOKENS and offsets == sorted(offsets)  # every token, in order
        assert [c["finish_reason"] for c in mine].count("length") == 1 and mine[-1]["finish_reason"] == "length"

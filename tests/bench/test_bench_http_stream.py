"""The benchmark's streaming HTTP client against raw loopback servers that answer exactly as written."""

import asyncio

import pytest

from services.bench.http_stream import StreamError, Target, post_recorded, request_bytes


def run_against(answer: bytes, close_after: bool = True, timeout_s: float | None = 5.0):
    """POSTs to a loopback server that sends ``answer`` (then closes, if ``close_after``); returns the
    status and error body of `post_recorded`, the events its replay gave, and the request the server read."""
    events, seen = [], {}

    async def main():
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length")))
            seen["request"] = head + await reader.readexactly(length)
            writer.write(answer)
            await writer.drain()
            if close_after:
                writer.close()
            else:
                await asyncio.sleep(30)

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]

        def record(data: str, t: float) -> bool:
            events.append(data)
            return True

        async with server:
            status, error_body, recorded = await post_recorded(f"http://127.0.0.1:{port}/v1/completions?x=1",
                                                               b'{"a": 1}', [("Authorization", "Bearer k")], timeout_s)
        if status == 200:
            recorded.replay(record)
        return status, error_body

    result = asyncio.run(main())
    return result, events, seen.get("request")


def chunked(*pieces: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"


SSE_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"


def test_chunked_events_split_anywhere_and_the_request_as_sent():
    answer = SSE_HEAD + b"Transfer-Encoding: chunked\r\n\r\n" + chunked(b'data: {"n":1}\n\nda', b'ta: {"n":2}\n', b"\n",
                                                                        b": ping\n\ndata: [DONE]\n\n")
    (status, body), events, request = run_against(answer)
    assert status == 200 and body == b""
    assert events == ['{"n":1}', '{"n":2}', "[DONE]"]
    assert request.startswith(b"POST /v1/completions?x=1 HTTP/1.1\r\n")
    assert b"\r\nAuthorization: Bearer k\r\n" in request and b"\r\nContent-Length: 8\r\n" in request
    assert request.endswith(b'\r\n\r\n{"a": 1}')


def test_a_body_that_ends_with_the_connection_is_whole():
    (status, _), events, _ = run_against(SSE_HEAD + b"\r\ndata: 1\n\ndata: 2")  # no length, no chunks
    assert status == 200 and events == ["1", "2"]


def test_an_error_status_returns_its_body():
    body = b'{"error": {"message": "no such model"}}'
    (status, error_body), events, _ = run_against(
        b"HTTP/1.1 404 Not Found\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    assert (status, error_body, events) == (404, body, [])


@pytest.mark.parametrize("pieces", [
    (b"data: 1\n\n", b"data: [DONE]\n\n"),
    (b"data: 1\r\n\r\ndata: [DO", b"NE]\r\n\r\n"),  # split inside it, CRLF line ends
    (b"data: 1\n\ndata:[DONE]\n", b"\n"),
])
def test_a_done_event_ends_the_stream(pieces):
    answer = SSE_HEAD + b"Transfer-Encoding: chunked\r\n\r\n" + chunked(*pieces)[:-5]
    (status, _), events, _ = run_against(answer, close_after=False)
    assert status == 200 and events == ["1", "[DONE]"]  # returned although the server holds the connection open


def test_done_inside_an_event_ends_nothing():
    answer = SSE_HEAD + b"Transfer-Encoding: chunked\r\n\r\n" + chunked(b'data: {"t": "data: [DONE]"}\n\n')[:-5]
    with pytest.raises(TimeoutError):
        run_against(answer, close_after=False, timeout_s=0.3)


def test_events_are_read_after_the_stream_with_their_pieces_arrival_times():
    async def main():
        async def handle(reader, writer):
            await reader.readuntil(b"\r\n\r\n")
            writer.write(SSE_HEAD + b"Transfer-Encoding: chunked\r\n\r\n" + chunked(b"data: 1\n\nda")[:-5])
            await writer.drain()
            await asyncio.sleep(0.2)
            writer.write(chunked(b"ta: 2\n\n", b"data: 3\n\n"))
            writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        async with server:
            status, _, recorded = await post_recorded(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/",
                                                      b"{}")
        seen = []
        recorded.replay(lambda data, t: seen.append((data, t)) or data != "2")
        return status, seen, [now for now, _ in recorded._pieces]

    status, seen, arrivals = asyncio.run(main())
    assert status == 200 and [data for data, _ in seen] == ["1", "2"]  # False after "2": no "3"
    assert all(t in arrivals for _, t in seen)  # each event at the arrival of a piece
    assert seen[1][1] - seen[0][1] >= 0.15  # "2" completed by a piece sent after the server's 0.2 s pause


@pytest.mark.parametrize("answer, reason", [
    (SSE_HEAD + b"Transfer-Encoding: chunked\r\n\r\n" + chunked(b"data: 1\n\n")[:-5], "Server disconnected"),  # cut
    (SSE_HEAD + b"Content-Length: 100\r\n\r\ndata: 1\n\n", "Server disconnected"),
    (b"SSH-2.0-OpenSSH_9.6\r\n", "not an HTTP response"),
])
def test_a_broken_answer_is_a_stream_error(answer, reason):
    with pytest.raises(StreamError, match=reason):
        run_against(answer)


def test_a_stalled_stream_times_out():
    with pytest.raises(TimeoutError):
        run_against(SSE_HEAD + b"Transfer-Encoding: chunked\r\n\r\n", close_after=False, timeout_s=0.3)


def test_nothing_listening_is_a_stream_error():
    async def main():
        return await post_recorded("http://127.0.0.1:9/x", b"{}")
    with pytest.raises(StreamError, match="cannot connect to 127.0.0.1:9"):
        asyncio.run(main())


def test_targets():
    assert Target.of("https://api.example.com/v1/chat/completions") == Target(
        "api.example.com", 443, True, "/v1/chat/completions", "api.example.com")
    assert Target.of("http://[::1]:8000/v1/completions?a=b") == Target("::1", 8000, False, "/v1/completions?a=b",
                                                                       "[::1]:8000")
    assert request_bytes(Target.of("http://h"), [], b"").startswith(b"POST / HTTP/1.1\r\nHost: h\r\n")
    with pytest.raises(ValueError, match="not an http"):
        Target.of("ftp://h/x")

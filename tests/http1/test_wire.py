"""http1/wire.py: the answer bytes both HTTP servers write, read back by llhttp's own response
parser (httptools), as a client would."""
from __future__ import annotations

import httptools
from hypothesis import given, strategies as st

from http1.wire import LAST_CHUNK, answer_bytes, chunk, status_line


class _Seen:
    def __init__(self):
        self.headers: list[tuple[bytes, bytes]] = []
        self.body = b""
        self.done = False

    def on_header(self, name, value):
        self.headers.append((name.lower(), value))

    def on_body(self, body):
        self.body += body

    def on_message_complete(self):
        self.done = True


def _parse(data: bytes) -> tuple[httptools.HttpResponseParser, _Seen]:
    seen = _Seen()
    p = httptools.HttpResponseParser(seen)
    p.feed_data(data)
    return p, seen


_token = st.text(alphabet="abcdefghijklmnopqrstuvwxyz-", min_size=1, max_size=12)


@given(status=st.sampled_from([200, 201, 400, 404, 413, 429, 503]), body=st.binary(max_size=300),
       headers=st.lists(st.tuples(_token, st.text(alphabet="abc xyz/;=0123", max_size=20)), max_size=5),
       keep=st.booleans())
def test_a_complete_answer_frames_its_body_exactly(status, body, headers, keep):
    # a route's own framing headers would contradict the real framing: they are dropped
    hdrs = headers + [("Content-Length", "999"), ("Transfer-Encoding", "chunked"), ("Connection", "x")]
    p, seen = _parse(answer_bytes(status, hdrs, body, keep))
    assert seen.done and seen.body == body and p.get_status_code() == status
    names = [n for n, _ in seen.headers]
    assert names.count(b"content-length") == 1 and b"transfer-encoding" not in names
    assert names.count(b"date") == 1
    assert (b"connection", b"close") in seen.headers if not keep else b"connection" not in names
    for k, v in headers:
        assert (k.encode(), v.strip().encode()) in [(n, val.strip()) for n, val in seen.headers]


def test_head_answers_carry_the_length_but_no_body():
    data = answer_bytes(200, [], b"hello", True, head_only=True)
    assert data.endswith(b"Content-Length: 5\r\n\r\n")


def test_status_lines_use_the_standard_reason_unless_told_otherwise():
    assert status_line(404) == b"HTTP/1.1 404 Not Found\r\n"
    assert status_line(404, "Not Found") is status_line(404)
    assert status_line(499, "Client Closed") == b"HTTP/1.1 499 Client Closed\r\n"
    assert status_line(599) == b"HTTP/1.1 599 Unknown\r\n"


def test_chunks_decode_back_to_the_stream():
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    parts = [b"data: 1\n\n", b"x" * 300, b"data: [DONE]\n\n"]
    _, seen = _parse(head + b"".join(chunk(d) for d in parts) + LAST_CHUNK)
    assert seen.done and seen.body == b"".join(parts)

"""KV-cache event publisher: ZMQ PUB in vLLM's framing plus a ROUTER replay socket.

Wire format (docs/kv-events.md "What our worker publishes", docs/worker.md, "HTTP contract"):

* live: PUB frames ``[topic, seq_be8, payload]``; ``payload`` is ``router.events.encode_vllm_batch``
  (vLLM 0.33 map-format events); ``seq`` counts batches from 0, one per ``publish`` call;
* replay: vLLM 0.33's ROUTER/DEALER replay, framed by ``protocol.kv_replay`` (the subscriber,
  coordinator/kv_repair.py, uses the same module): one reply per buffered batch with
  ``seq >= start`` (oldest first), then the end marker; a first replayed seq above the requested
  one means the ring buffer already dropped the gap (resync from ``/kv_snapshot``).
* ``data_parallel_rank`` is 0 unless given, as vLLM's publisher stamps every batch (a worker is
  one DP rank).
* recovery (the shape of vLLM PR #57789 and SGLang RFC #33394, docs/kv-events.md): every batch
  carries the publisher's ``epoch`` (its start id, also in ``/server_info`` and ``/kv_snapshot``)
  as a trailing element of the batch array, which vLLM's decoder skips; ``heartbeat`` publishes an
  empty batch (it takes a seq, like any batch) when nothing was published for ``heartbeat_s``, so a
  subscriber learns the epoch and the resume seq of an idle publisher, and a silent one is dead;
  ``/kv_snapshot`` answers the resident keys with the last seq they include (resume at ``seq+1``).

Threads: ``publish`` is called from the engine's event-loop thread, which alone owns the PUB socket
(a PUB send never blocks; past the high-water mark ZMQ drops, which subscribers see as a seq gap).
The replay socket lives on its own daemon thread; the ring buffer is shared under a lock.
"""
from __future__ import annotations

import collections
import logging
import threading
import time

import zmq

from protocol import kv_replay
from router.events import encode_vllm_batch

log = logging.getLogger("splitserve.worker.kv_events")

__all__ = ["KvEventPublisher", "END_MARKER_SEQ", "DEFAULT_TOPIC"]

DEFAULT_TOPIC = "kv-events"
END_MARKER_SEQ = kv_replay.END_SEQ


def _bind(sock: zmq.Socket, host: str, port: int) -> int:
    if port:
        sock.bind(f"tcp://{host}:{port}")
        return port
    return sock.bind_to_random_port(f"tcp://{host}")


def _fmt_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


class KvEventPublisher:
    """Publishes event batches and serves replays. ``last_seq`` is -1 until the first batch."""

    def __init__(self, *, host: str = "127.0.0.1", pub_port: int = 0, replay_port: int = 0,
                 advertise_host: str | None = None, topic: str = DEFAULT_TOPIC,
                 buffer_steps: int = 10_000, hwm: int = 100_000, dp_rank: int = 0,
                 epoch: str | None = None, heartbeat_s: float = 1.0):
        if buffer_steps < 1:
            raise ValueError(f"buffer_steps must be >= 1, got {buffer_steps}")
        self.topic = topic
        self._topic_b = topic.encode()
        self.epoch = epoch
        self.heartbeat_s = heartbeat_s
        self._last_sent = time.monotonic()
        self.heartbeats = 0
        self.dp_rank = dp_rank
        self._host = host
        self._advertise = advertise_host or host
        self._ctx = zmq.Context(io_threads=1)
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self.pub_port = _bind(self._pub, host, pub_port)
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.SNDHWM, 2 * (buffer_steps + 1))
        self._router.setsockopt(zmq.LINGER, 0)
        # A DEALER that went away must not block replies to the others.
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 0)
        self.replay_port = _bind(self._router, host, replay_port)
        self._ring: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=buffer_steps)
        self._lock = threading.Lock()
        self._next_seq = 0
        self.batches_published = 0
        self.events_published = 0
        self.replays_served = 0
        self._ctl_addr = f"inproc://kv-replay-ctl-{id(self)}"
        self._ctl_recv = self._ctx.socket(zmq.PAIR)
        self._ctl_recv.bind(self._ctl_addr)
        self._ctl_send = self._ctx.socket(zmq.PAIR)
        self._ctl_send.connect(self._ctl_addr)
        self._thread = threading.Thread(target=self._serve_replay, name="kv-replay", daemon=True)
        self._thread.start()
        self._closed = False

    # ------------------------------------------------------------------ endpoints
    @property
    def publisher_endpoint(self) -> str:
        return f"tcp://{_fmt_host(self._advertise)}:{self.pub_port}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://{_fmt_host(self._advertise)}:{self.replay_port}"

    @property
    def last_seq(self) -> int:
        return self._next_seq - 1

    # ------------------------------------------------------------------ publishing
    def publish(self, events: list) -> int:
        """Encode and send one batch; returns its seq. Called from the engine's loop thread."""
        if self._closed:
            raise RuntimeError("publisher is closed")
        payload = encode_vllm_batch(time.time(), events, self.dp_rank, self.epoch)
        self._last_sent = time.monotonic()
        seq = self._next_seq
        seq_b = kv_replay.seq_bytes(seq)
        with self._lock:
            self._ring.append((seq, payload))
            self._next_seq = seq + 1
        try:
            self._pub.send_multipart([self._topic_b, seq_b, payload], flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:  # over the HWM: subscribers see the gap and replay
            log.warning("KV event batch %d dropped at the PUB high-water mark", seq)
        self.batches_published += 1
        self.events_published += len(events)
        return seq

    def heartbeat(self) -> int | None:
        """Publish an empty batch if nothing went out for ``heartbeat_s``; its seq, or None.
        Called from the same thread as ``publish`` (the worker's event loop)."""
        if self._closed or time.monotonic() - self._last_sent < self.heartbeat_s:
            return None
        self.heartbeats += 1
        return self.publish([])

    # ------------------------------------------------------------------ replay
    def _serve_replay(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._ctl_recv, zmq.POLLIN)
        while True:
            try:
                ready = dict(poller.poll())
            except zmq.ContextTerminated:
                return
            if self._ctl_recv in ready:
                return
            if self._router not in ready:
                continue
            try:
                frames = self._router.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                continue
            except zmq.ZMQError:
                return
            try:
                self._answer(frames)
            except zmq.ZMQError as e:
                log.warning("replay reply failed: %s", e)

    def _answer(self, frames: list[bytes]) -> None:
        delim, start = kv_replay.parse_request(frames[1:])
        head = [frames[0], *delim]
        if start is None:
            log.warning("malformed replay request (%d frames after identity; expected one 8-byte "
                        "start seq); answering with the end marker only", len(frames) - 1)
            self._router.send_multipart(head + kv_replay.end_frames())
            return
        with self._lock:
            batch = [(s, p) for s, p in self._ring if s >= start]
        for s, p in batch:
            self._router.send_multipart(head + kv_replay.reply_frames(self._topic_b, s, p), copy=False)
        self._router.send_multipart(head + kv_replay.end_frames())
        self.replays_served += 1

    # ------------------------------------------------------------------ shutdown
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._ctl_send.send(b"stop")
        except zmq.ZMQError:
            pass
        self._thread.join(timeout=5)
        for s in (self._pub, self._router, self._ctl_send, self._ctl_recv):
            s.close(linger=0)
        self._ctx.term()

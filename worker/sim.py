"""The sim engine: the real scheduler, block pool, prefix cache and KV events, with no model.

A step takes ``prefill_us_per_token`` per uncached prompt token it feeds (plus
``prefill_us_per_token_per_kctx`` per token per thousand tokens of context before it: attention
grows with the position) and, when it carries any decode, ``decode_us_per_step`` +
``decode_us_per_seq`` per decoding sequence + ``decode_us_per_ctx_token`` per context token those
sequences attend to (a batch of decodes costs one step, as on a GPU; the KV read grows with
batch and context), slept on the event loop. bench/routing/routing.py calibrates these to the H200 ``1b``
numbers in bench/RESULTS.md. ``prefix_reuse=False`` publishes every stored block as usual but
never reuses one (an engine whose events claim a cache it does not use: the coordinator's
predicted-vs-actual check must notice). Tokens are a pure function of (prompt, seed, position), drawn from
tokens that decode to plain letters and spaces, so:

* outputs are reproducible whatever the batch, cache state or preemptions;
* a two-leg run (context_only here, generation_only on another sim worker) produces exactly the
  tokens of a one-leg run;
* ``cached_tokens`` follows the LRU cache like the torch engine's (same pool, same keys).

generation_only needs no KV data here: ``SimReceiver`` waits the simulated transfer time and
then tells the context worker (the ``worker_url`` in the opaque state) to release its pins, the
way a real transfer's completion notification would. No torch is imported on this path.
"""
from __future__ import annotations

import array
import asyncio
import logging

import xxhash

from protocol.disagg import OpaqueState, OpaqueStateError, decode_opaque_state
from protocol.tasks import cancel_and_wait
from worker.kv_cache import BlockPool
from worker.engine import SchedulingEngine
from worker.kv_connector import KvConnector
from worker.requests import ReceiveSpec
from worker.scheduler import Plan, Scheduler

log = logging.getLogger("splitserve.worker.sim")

__all__ = ["SimEngine", "SimReceiver"]

_MAX_ALPHABET_SCAN = 4096


def _alphabet(tokenizer, vocab_size: int, eos) -> list[int]:
    """Token ids that decode to short runs of letters or spaces (readable fake text)."""
    out = []
    for i in range(min(vocab_size, _MAX_ALPHABET_SCAN)):
        if i in eos:
            continue
        try:
            t = tokenizer.decode([i])
        except ValueError:
            continue
        if t and len(t) <= 12 and all(c.isascii() and (c.isalpha() or c == " ") for c in t):
            out.append(i)
    if not out:  # an odd vocabulary: any non-EOS id will do
        out = [i for i in range(min(vocab_size, _MAX_ALPHABET_SCAN)) if i not in eos]
    return out


class SimReceiver(KvConnector):
    """generation_only on the sim engine: no bytes to move. Waits ``us_per_token`` per prompt
    token, then asks the context worker to release the pinned blocks (best effort; the context
    side's pin timeout covers a lost notification)."""

    def __init__(self, us_per_token: float = 0.0, notify_timeout_s: float = 2.0,
                 wait_timeout_s: float = 30.0):
        self.us_per_token = float(us_per_token)
        self.notify_timeout_s = notify_timeout_s
        self.wait_timeout_s = wait_timeout_s
        self._session = None
        self._tasks: set[asyncio.Task] = set()
        self.notified = 0

    async def receive(self, spec: ReceiveSpec) -> None:
        url = None
        state = OpaqueState()
        blob = spec.disaggregated_params.get("encoded_opaque_state")
        if isinstance(blob, str):
            try:
                state = decode_opaque_state(blob)
                url = state.worker_url
            except OpaqueStateError as e:
                log.warning("opaque state of %s unreadable (%s); the context side will time out "
                            "its pins", spec.request_id, e)
        cid = spec.ctx_request_id
        if not (isinstance(url, str) and url.startswith(("http://", "https://"))):
            url = None  # only a worker URL, never another scheme, is ever called back
        if state.wait and url and cid is not None:
            # Both legs started together (SGLang): the prefill may still be running.
            await self._wait_ready(url, cid)
        if self.us_per_token > 0:
            await asyncio.sleep(self.us_per_token * len(spec.prompt_token_ids) / 1e6)
        if url and cid is not None:
            t = asyncio.create_task(self._notify(url, cid))
            self._tasks.add(t)
            t.add_done_callback(self._tasks.discard)

    def _http(self):
        import aiohttp

        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.notify_timeout_s))
        return self._session

    async def _wait_ready(self, url: str, ctx_request_id: int) -> None:
        """Wait at the prefill's bootstrap server until its KV for ``ctx_request_id`` is ready
        (raises, failing the request, when it never is)."""
        import aiohttp

        t = self.wait_timeout_s
        async with self._http().post(f"{url}/kv_wait", json={"ctx_request_id": ctx_request_id, "timeout_s": t},
                                     timeout=aiohttp.ClientTimeout(total=t + 5)) as r:
            ok = r.status == 200 and (await r.json()).get("ready") is True
        if not ok:
            raise TimeoutError(f"the prefill of room {ctx_request_id} at {url} was not ready within {t:g}s")

    async def _notify(self, url: str, ctx_request_id: int) -> None:
        self._http()
        try:
            async with self._session.post(f"{url}/kv_release", json={
                    "ctx_request_id": ctx_request_id, "reason": "transferred"}) as r:
                await r.read()
                self.notified += 1
        except Exception as e:  # the context worker may be gone; its sweep frees the pins
            log.info("release notification to %s for %s failed: %s", url, ctx_request_id, e)

    async def close(self) -> None:
        await cancel_and_wait(*self._tasks)
        if self._session is not None:
            await self._session.close()
            self._session = None


class SimEngine(SchedulingEngine):
    """A ``Scheduler`` whose steps sleep the latency model and emit ``fake_token``s."""

    engine_name = "sim"

    def __init__(self, tokenizer, *, num_blocks: int = 4096, block_size: int = 16,
                 max_model_len: int = 1 << 20, max_batch_size: int = 256,
                 max_num_tokens: int = 8192, prefill_us_per_token: float = 20.0,
                 decode_us_per_step: float = 5000.0, transfer_us_per_token: float = 0.0,
                 pin_timeout_s: float = 60.0, worker_id: str = "sim", ns_seed: int = 0,
                 vocab_size: int | None = None, eos_token_ids=None,
                 prefill_us_per_token_per_kctx: float = 0.0, decode_us_per_seq: float = 0.0,
                 decode_us_per_ctx_token: float = 0.0, prefix_reuse: bool = True,
                 kv_connector: KvConnector | None | str = "sim"):
        lat = {"prefill": prefill_us_per_token, "decode": decode_us_per_step,
               "prefill per kctx": prefill_us_per_token_per_kctx,
               "decode per seq": decode_us_per_seq, "decode per ctx token": decode_us_per_ctx_token}
        bad = {k: v for k, v in lat.items() if v < 0}
        if bad:
            raise ValueError(f"sim latencies must be >= 0 µs, got {bad}")
        vocab = int(vocab_size or tokenizer.vocab_size)
        eos = tuple(eos_token_ids if eos_token_ids is not None
                    else getattr(tokenizer, "eos_token_ids", ()) or ())
        # "sim": its own receiver (closed by stop()); None: no generation_only (HTTP 501).
        own = kv_connector == "sim"
        self._sim_receiver = SimReceiver(transfer_us_per_token) if own else None
        if own:
            kv_connector = self._sim_receiver
        self.scheduler = Scheduler(
            execute=self._execute, engine_name=self.engine_name, prefix_reuse=prefix_reuse,
            pool=BlockPool(num_blocks, block_size, ns_seed=ns_seed), tokenizer=tokenizer,
            eos_token_ids=eos, vocab_size=vocab, max_model_len=max_model_len,
            max_batch_size=max_batch_size, max_num_tokens=max_num_tokens,
            pin_timeout_s=pin_timeout_s, worker_id=worker_id, kv_connector=kv_connector)
        if kv_connector is not None:
            kv_connector.bind(self)
        self.prefill_us_per_token = float(prefill_us_per_token)
        self.decode_us_per_step = float(decode_us_per_step)
        self.prefill_us_per_token_per_kctx = float(prefill_us_per_token_per_kctx)
        self.decode_us_per_seq = float(decode_us_per_seq)
        self.decode_us_per_ctx_token = float(decode_us_per_ctx_token)
        self._alphabet = _alphabet(tokenizer, vocab, set(eos))

    def routing_model(self) -> dict:
        """The latency model in /server_info's `routing_model` (router/policy_kv.py `model_of`):
        what kv_cache_aware's time cost estimates a time to first token from. The per-kctx
        prefill term is left out (the policy's learned scale absorbs its mean)."""
        return {"prefill_s_per_token": self.prefill_us_per_token / 1e6,
                "chunk_tokens": self.max_num_tokens,
                "decode_s_per_step": self.decode_us_per_step / 1e6,
                "decode_s_per_request": self.decode_us_per_seq / 1e6,
                "decode_s_per_context_token": self.decode_us_per_ctx_token / 1e6}

    def step_time_s(self, plan: Plan) -> float:
        us = plan.num_prefill_tokens * self.prefill_us_per_token
        kctx, dctx = self.prefill_us_per_token_per_kctx, self.decode_us_per_ctx_token
        if kctx or (dctx and plan.num_decode_tokens):
            pre = ctx = 0.0
            for s, start, n, _ in plan.entries:
                if start >= s.num_prompt and n == 1:
                    ctx += start
                else:  # positions start .. start+n-1 attend to their prefix
                    pre += n * (start + (n - 1) / 2)
            us += pre * kctx / 1000 + ctx * dctx
        if plan.num_decode_tokens:
            us += self.decode_us_per_step + plan.num_decode_tokens * self.decode_us_per_seq
        return us / 1e6

    def fake_token(self, prompt_token_ids, seed: int | None, position: int) -> int:
        """The token the sim emits at ``position`` (index into prompt + output) for this prompt."""
        base = xxhash.xxh3_64_intdigest(array.array("I", prompt_token_ids).tobytes(),
                                        (seed or 0) & ((1 << 64) - 1))
        return self._token_at(base, position)

    def _token_at(self, base: int, position: int) -> int:
        h = xxhash.xxh3_64_intdigest(position.to_bytes(8, "little"), base)
        return self._alphabet[h % len(self._alphabet)]

    async def _execute(self, plan: Plan) -> list[int | None]:
        dt = self.step_time_s(plan)
        # Always yield: a zero-latency sim must still let HTTP handlers run between steps.
        await asyncio.sleep(dt)
        out: list[int | None] = []
        for s, start, n, sample in plan.entries:
            if not sample:
                out.append(None)
                continue
            if s.rng is None:
                s.rng = xxhash.xxh3_64_intdigest(
                    array.array("I", s.tokens[:s.num_prompt]).tobytes(),
                    (s.req.sampling.seed or 0) & ((1 << 64) - 1))
            out.append(self._token_at(s.rng, start + n))
        return out

    async def stop(self) -> None:
        await super().stop()
        if self._sim_receiver is not None:
            await self._sim_receiver.close()

"""Applying a step's sampled tokens and finishing requests: ``StepApplyMixin``, which
``worker.scheduler.Scheduler`` inherits.

``_apply`` advances each planned sequence, commits its full blocks to the prefix cache and hands
sampled tokens to ``_on_token`` (stop conditions, streaming, a context leg's pinned result);
``_finish`` is the one way out of a request's life and returns exactly the blocks it holds (or
defers that until the step holding it is applied). Runs on the event loop thread only.
"""
from __future__ import annotations

from typing import Any

from router.block_keys import KEY_SCHEME
from worker.requests import CONTEXT_ONLY, GENERATION_ONLY, ContextResult, TokenEvent
from worker.sequence import FINISHED, RECEIVING, RUNNING, WAITING, Plan, Seq

__all__ = ["StepApplyMixin"]


class StepApplyMixin:
    """Step application and request finishing of ``Scheduler`` (state and planning live there)."""

    def _apply(self, plan: Plan, sampled: list[int | None] | None, error: str | None) -> None:
        self._stats.record_step(plan.num_prefill_tokens, plan.num_decode_tokens)
        for i, (s, start, n, sample) in enumerate(plan.entries):
            if s.state == FINISHED:  # aborted during the step: free what it held now
                if s.free_after_step and s.id not in self._in_step:
                    s.free_after_step = False
                    self._drop_blocks(s)
                continue
            if s.state != RUNNING:
                continue
            if error is not None:
                self._finish(s, "error", error=error)
                continue
            if self.launch is None:
                s.num_computed = start + n
            # Only what this step wrote is offered to the prefix cache: under async scheduling a later
            # step may still be writing the positions after it.
            self._commit_full_blocks(s, start + n)
            if self.kv_connector is not None and s.req.request_type == CONTEXT_ONLY \
                    and start < s.num_prompt:  # pipelining: finished blocks can leave now
                self.kv_connector.prefill_progress(s.req, min(start + n, s.num_prompt),
                                                   s.blocks)
            if sample:
                if self.launch is not None:
                    s.inflight -= 1
                self._on_token(s, int(sampled[i]))

    def _commit_full_blocks(self, s: Seq, upto: int | None = None) -> None:
        done = s.num_computed if upto is None else min(upto, s.num_computed)
        full = min(done // self.block_size, len(s.blocks))
        if full <= s.num_committed:
            return
        keys = self._keys_upto(s, full)
        B = self.block_size
        for i in range(s.num_committed, full):
            self.pool.commit(s.blocks[i], keys[i], keys[i - 1] if i else None,
                             s.tokens[i * B:(i + 1) * B])
        s.num_committed = full

    def _on_token(self, s: Seq, tok: int) -> bool:
        """Append a sampled token, emit it, finish on a stop condition. True if finished."""
        s.tokens.append(tok)
        s.num_output += 1
        self.counters["generation_tokens"] += 1
        sp = s.req.sampling
        finish = stop_reason = None
        text = ""
        if tok in self.eos_token_ids and not sp.ignore_eos:
            finish = "stop"
        elif tok in sp.stop_token_ids:
            finish, stop_reason = "stop", tok
        else:
            text = s.detok.add(tok)
            if s.detok.stopped_on is not None:
                finish, stop_reason = "stop", s.detok.stopped_on
        if finish is None and (s.num_output >= sp.max_tokens or len(s.tokens) >= self.max_model_len):
            finish = "length"
        if finish is None and s.req.request_type == CONTEXT_ONLY:
            finish = "length"  # a context leg ends after its first token; gen continues
        if finish is not None:
            text += s.detok.flush()
        ev = TokenEvent(token_ids=[tok], text=text, prompt_tokens=s.num_prompt,
                        cached_tokens=s.cached_tokens, completion_tokens=s.num_output)
        if finish is None:
            s.queue.put_nowait(ev)
            return False
        ev.stop_reason = stop_reason
        if s.req.request_type == CONTEXT_ONLY:
            ev.context = self._finish_context(s, keep=finish == "length")
        self._finish(s, finish, last=ev)
        return True

    def _finish_context(self, s: Seq, keep: bool) -> ContextResult:
        """Turn a finished prefill's references into pins (when a generation leg will follow)."""
        cid = int(s.req.ctx_request_id)
        prompt_blocks = list(s.blocks[:self._blocks_for(s.num_prompt)])
        opaque: dict[str, Any] = {
            "v": 1, "worker_id": self.worker_id, "ctx_request_id": cid,
            "num_tokens": s.num_prompt, "block_size": self.block_size, "key_scheme": KEY_SCHEME,
            "block_ids": prompt_blocks, "worker_url": self.worker_url,
        }
        if keep:
            p = self.pins.pin(cid, request_id=s.id, aliases=s.req.aliases,
                              prompt_token_ids=list(s.tokens[:s.num_prompt]),
                              block_ids=prompt_blocks)
            if self.kv_connector is not None:
                opaque.update(self.kv_connector.context_finished(p))
        return ContextResult(ctx_request_id=cid, first_gen_tokens=list(s.tokens[s.num_prompt:]),
                             prompt_token_ids=list(s.tokens[:s.num_prompt]), block_ids=prompt_blocks,
                             opaque_state=opaque, pinned=keep)

    # ------------------------------------------------------------------ finishing
    def _finish_by_id(self, sid: str, reason: str, error: str | None = None) -> bool:
        s = self._seqs.get(sid)
        if s is None or s.state == FINISHED:
            return False
        if s.state == RECEIVING and s.receive_task is not None:
            # Finish now (the client sees the abort); blocks are freed when the receiver confirms.
            self._finish(s, reason, error=error, keep_blocks=True)
            s.receive_task.cancel()
            return True
        self._finish(s, reason, error=error)
        return True

    def _finish(self, s: Seq, reason: str, *, error: str | None = None,
                last: TokenEvent | None = None, keep_blocks: bool = False) -> None:
        prev = s.state
        s.state = FINISHED
        s.finish_reason = reason
        if prev == WAITING:
            try:
                self._waiting.remove(s)
            except ValueError:
                pass
        elif prev == RUNNING:
            self._running.remove(s)
        if not keep_blocks:
            if s.id in self._in_step:
                s.free_after_step = True
            else:
                self._drop_blocks(s)
        self._seqs.pop(s.id, None)
        names = {s.id, *s.req.aliases}
        if s.req.ctx_request_id is not None:
            names.add(str(s.req.ctx_request_id))
        for a in names:
            ids = self._aliases.get(str(a))
            if ids is not None:
                ids.discard(s.id)
                if not ids:
                    del self._aliases[str(a)]
        s.rng = None
        self.counters[f"finished_{reason}"] += 1
        if last is None:
            last = TokenEvent(token_ids=[], text=s.detok.flush() if reason != "error" else "",
                              prompt_tokens=s.num_prompt, cached_tokens=s.cached_tokens,
                              completion_tokens=s.num_output)
        last.finish_reason = reason
        last.error = error
        s.queue.put_nowait(last)
        if self.kv_connector is not None:
            if s.req.request_type == CONTEXT_ONLY:
                self.kv_connector.context_ended(s.req)
            elif not s.admitted and s.req.request_type == GENERATION_ONLY:
                # ended before its receive began (aborted while queued; client gone, shutdown):
                # the context worker may hold its KV pinned
                self.kv_connector.receive_abandoned(s.req)
        self._wake.set()

    def _drop_blocks(self, s: Seq) -> None:
        if s.blocks:
            self.pool.free(s.blocks)
            s.blocks = []

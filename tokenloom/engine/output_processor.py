"""The front end of a step: engine-core outputs (token ids) → RequestOutputs (text).

Incremental detokenization, stop strings (held back while streaming, so a client never sees the
first characters of a stop string that then completes), logprobs, the stream interval (vLLM's
--stream-interval and SamplingParams.stream_interval: a stream hands out its tokens in batches of that many,
the first and the last output at once), and the fan-in of `n > 1` completions
(engine/parallel_sampling.py's ParentRequest.get_outputs): streamed (DELTA / CUMULATIVE), one
RequestOutput per child that progressed, a finished child never sent again, `finished` on the output that
finishes the last; FINAL_ONLY, one RequestOutput with all n once every child is done.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from tokenloom.core.outputs import EngineCoreOutput, SampleLogprobs
from tokenloom.core.request import Request
from tokenloom.engine.outputs import (
    CompletionOutput,
    Logprob,
    PoolingOutput,
    PoolingRequestOutput,
    RequestMetrics,
    RequestOutput,
)
from tokenloom.engine.parallel_sampling import ParentRequest
from tokenloom.logprobs import as_container
from tokenloom.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from tokenloom.model.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class _Completion:
    """One sequence of a request (one core request)."""

    index: int
    core_request: Request
    params: SamplingParams
    detokenizer: IncrementalDetokenizer | None
    # Tokens a DELTA output waits for (1: every step's), the first and the finishing output excepted.
    stream_interval: int = 1
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    sent_text_len: int = 0
    sent_token_len: int = 0
    sent_logprobs_len: int = 0
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    pooling_output: Any = None  # a pooling request's result (a float32 numpy array)
    kv_transfer_params: dict[str, Any] | None = None  # the KV connector's, when the request finished

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    arrival_time: float
    completions: list[_Completion]
    # n > 1: what each child's output makes the user see (vLLM's parent_req); None for a single completion.
    parent_req: ParentRequest | None = None
    # prompt_logprobs: [None (the first token has none), {token: Logprob}, ...], filled as chunks compute.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    prompt_logprobs_ready: int = 0  # positions the chunks have scored so far (they come in order)
    prompt_logprobs_sent: int = 0  # positions a DELTA output has handed out
    # A decode engine's request after a remote prefill: the prefill engine's prefix-cache hit, reported as the
    # request's cached tokens (vLLM's RequestState.remote_prefill_cached_tokens); None otherwise.
    remote_prefill_cached_tokens: int | None = None


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None, stream_interval: int = 1) -> None:
        """`stream_interval`: the engine's (vLLM's --stream-interval, at least 1); a request may raise its own."""
        self.tokenizer = tokenizer
        self.stream_interval = stream_interval
        self._parents: dict[str, _Parent] = {}
        self._by_core_id: dict[str, tuple[_Parent, _Completion]] = {}
        self._token_texts: dict[int, str] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        core_requests: list[Request],
        arrival_time: float,
    ) -> None:
        completions = []
        for i, core in enumerate(core_requests):
            params = core.sampling_params
            detok = None
            if self.tokenizer is not None and core.pooling_params is None and params.detokenize:
                from tokenloom.model.tokenizer import IncrementalDetokenizer

                detok = IncrementalDetokenizer(
                    self.tokenizer, skip_special_tokens=params.skip_special_tokens, prompt_ids=prompt_token_ids
                )
            completions.append(
                _Completion(i, core, params, detok, self._stream_interval_of(params),
                            logprobs=[] if params.logprobs is not None else None,
                            cumulative_logprob=0.0 if params.logprobs is not None else None)
            )
        parent = _Parent(request_id, prompt, prompt_token_ids, arrival_time, completions)
        if completions:
            parent.remote_prefill_cached_tokens = remote_prefill_cached_tokens(completions[0].params)
        if len(completions) > 1:
            parent.parent_req = ParentRequest.of_children(request_id, completions[0].params.output_kind,
                                                          [c.core_request.request_id for c in completions])
        if completions and completions[0].params.prompt_logprobs is not None:
            parent.prompt_logprobs = [None] * len(prompt_token_ids)
        self._parents[request_id] = parent
        for c in completions:
            self._by_core_id[c.core_request.request_id] = (parent, c)

    def _stream_interval_of(self, params: SamplingParams) -> int:
        """vLLM's: a request's stream_interval raises the engine's, never lowers it."""
        return max(params.stream_interval or 1, self.stream_interval)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._parents

    def has_unfinished_requests(self) -> bool:  # vLLM's OutputProcessor name
        return bool(self._parents)

    def core_ids(self, request_id: str) -> list[str]:
        parent = self._parents.get(request_id)
        return [c.core_request.request_id for c in parent.completions] if parent else []

    def num_unfinished(self) -> int:
        return len(self._parents)

    def request_ids(self) -> list[str]:
        """The unfinished requests' ids, in the order they were added."""
        return list(self._parents)

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Returns the RequestOutputs of requests that progressed, and core ids to abort (stop strings)."""
        results = []
        to_abort: list[str] = []
        for out in outputs:
            entry = self._by_core_id.get(out.request_id)
            if entry is None:
                continue
            parent, comp = entry
            if comp.finished:
                continue
            if out.new_prompt_logprobs is not None and parent.prompt_logprobs is not None:
                # Indexed by position: a chunk recomputed after preemption overwrites itself.
                first, entries = out.new_prompt_logprobs
                for k, lp in enumerate(entries):
                    # vLLM's context for a prompt position: the scored prompt tokens before it (position 0 has none).
                    pos = first + k
                    parent.prompt_logprobs[pos] = self._logprob_dict(
                        lp, decode=comp.params.detokenize, context=parent.prompt_token_ids[max(1, pos - 4) : pos])
                parent.prompt_logprobs_ready = max(parent.prompt_logprobs_ready, first + len(entries))
            if self._apply(comp, out):
                to_abort.append(out.request_id)
            result = self._request_output(parent, comp)
            if result is not None:
                results.append(result)
            if all(c.finished for c in parent.completions):
                self._forget(parent)
        return results, to_abort

    def _request_output(self, parent: _Parent, comp: _Completion) -> RequestOutput | PoolingRequestOutput | None:
        """What the user sees of `comp`'s progress (vLLM's RequestState.make_request_output), or None: FINAL_ONLY
        before the end, a DELTA stream between two intervals, or an n > 1 request whose parent holds it back."""
        if comp.core_request.pooling_params is not None:
            return self._pooling_output(parent)
        if comp.params.output_kind is RequestOutputKind.FINAL_ONLY and not comp.finished:
            return None
        if not self._stream_interval_due(comp):
            return None
        completion = self._completion_output(comp)
        if parent.parent_req is None:
            return self._make_output(parent, [completion], comp.finished)
        completions, finished = parent.parent_req.get_outputs(comp.core_request.request_id, completion)
        return self._make_output(parent, completions, finished) if completions else None

    @staticmethod
    def _stream_interval_due(comp: _Completion) -> bool:
        """vLLM's rule: with a stream interval above 1, an output goes out when it finishes the completion, is
        its first, or carries at least the interval's new tokens. Applied to CUMULATIVE streams too, whose
        delta fields carry the new tokens: the server streams through them (vLLM's server asks for DELTA
        outputs); vLLM moves its mark of what was sent for DELTA outputs only, so its CUMULATIVE ones go out
        every step whatever the interval (docs/conformance.md)."""
        if comp.stream_interval <= 1 or comp.params.output_kind is RequestOutputKind.FINAL_ONLY:
            return True
        return (comp.finished or comp.sent_token_len == 0
                or len(comp.token_ids) - comp.sent_token_len >= comp.stream_interval)

    def finish_aborted(self, request_id: str, reason: str = "abort", error: str | None = None) -> RequestOutput | None:
        """Close a request from outside (client went away, engine error); returns its last output."""
        parent = self._parents.get(request_id)
        if parent is None:
            return None
        cut = [c for c in parent.completions if not c.finished]
        for c in cut:
            c.finish_reason = reason
            c.error = error
        if parent.completions[0].params.output_kind is RequestOutputKind.FINAL_ONLY:
            cut = parent.completions  # vLLM's aggregate: all n at once
        if parent.completions[0].core_request.pooling_params is not None:
            result = self._pooling_output(parent)
        else:
            # Streaming: only the completions the abort ended (those finished before were sent already), in one
            # output, as vLLM's collector merges the per-child abort outputs it queues at once.
            result = self._make_output(parent, [self._completion_output(c) for c in cut or parent.completions[-1:]],
                                       True)
        self._forget(parent)
        return result

    # --------------------------------------------------------------------------------------
    def _apply(self, comp: _Completion, out: EngineCoreOutput) -> bool:
        """Fold one core output into a completion; True if a stop string ended it early."""
        n = len(out.new_token_ids)
        if n > 1 and comp.params.stop and comp.detokenizer is not None:
            # Several tokens in one step (accepted drafts): fold them one by one, so that a stop
            # string ends the output at the token completing it, as without speculation.
            for i in range(n):
                last = i == n - 1
                piece = replace(out, new_token_ids=out.new_token_ids[i : i + 1],
                                new_logprobs=out.new_logprobs[i : i + 1] if out.new_logprobs else None,
                                finish_reason=out.finish_reason if last else None,
                                stop_reason=out.stop_reason if last else None, error=out.error if last else None)
                ended = self._apply_one(comp, piece)
                if comp.finished:
                    return ended
            return False
        return self._apply_one(comp, out)

    def _apply_one(self, comp: _Completion, out: EngineCoreOutput) -> bool:
        if out.pooling_output is not None:
            comp.pooling_output = out.pooling_output
        comp.token_ids.extend(out.new_token_ids)
        if out.new_logprobs and comp.logprobs is not None:
            for lp in out.new_logprobs:
                pos = len(comp.logprobs)  # this token's place in the output, whose tokens are in token_ids already
                comp.logprobs.append(self._logprob_dict(lp, ranked=comp.params.logprob_token_ids is None,
                                                        decode=comp.params.detokenize,
                                                        context=comp.token_ids[max(0, pos - 4) : pos]))
                comp.cumulative_logprob = (comp.cumulative_logprob or 0.0) + lp.logprob
        if comp.detokenizer is not None:
            old_len = len(comp.text)
            text_ids = self._ids_with_text(comp, out)
            comp.text += comp.detokenizer.step(text_ids) if text_ids else ""
            if out.finished:
                comp.text += comp.detokenizer.flush()
            stop = self._find_stop_string(comp, old_len)
            if stop is not None:
                comp.finish_reason = "stop"
                comp.stop_reason = stop
                return not out.finished
        if out.finished:
            comp.finish_reason = out.finish_reason
            comp.stop_reason = out.stop_reason
            comp.error = out.error
            comp.kv_transfer_params = out.kv_transfer_params
        return False

    @staticmethod
    def _ids_with_text(comp: _Completion, out: EngineCoreOutput) -> list[int]:
        """The step's tokens that add to the text. vLLM's detokenizer (BaseIncrementalDetokenizer.update)
        leaves out the token that stopped the request, EOS or a stop token id, unless
        include_stop_str_in_output: it is kept in token_ids, not in the text (with skip_special_tokens off,
        an EOS would otherwise show; a stop id's text always would). tokenloom's other stop, a grammar
        completed under ignore_eos, ends on an ordinary token, whose text stays."""
        ids = out.new_token_ids
        params = comp.params
        if (out.finish_reason == "stop" and ids and not params.include_stop_str_in_output
                and ids[-1] in params.all_stop_token_ids):
            return ids[:-1]
        return ids

    @staticmethod
    def _find_stop_string(comp: _Completion, old_len: int) -> str | None:
        stops = comp.params.stop
        # vLLM (v1/engine/detokenizer.py): stop strings count only once the output is longer than
        # min_tokens, and only one ending in the text of a token past the first min_tokens (tokens
        # are folded one at a time when there are stop strings, so old_len is then that boundary).
        if not stops or len(comp.token_ids) <= comp.params.min_tokens:
            return None
        include = comp.params.include_stop_str_in_output
        found = check_stop_strings(comp.text, len(comp.text) - old_len, stops, include_in_output=include)
        if found is None:
            return None
        stop, truncate_to = found
        if truncate_to != -1:
            comp.text = comp.text[:truncate_to]
        return stop

    def _logprob_dict(self, lp: SampleLogprobs, ranked: bool = True, decode: bool = True,
                      context: Sequence[int] = ()) -> dict[int, Logprob]:  # fmt: skip
        """One position's Logprobs. `top` is the top-n by rank, or (logprob_token_ids) the tokens asked for, whose
        ranks are unknown. decode=False (detokenize=False): no decoded_token, as vLLM. `context`: the tokens the
        sequence holds just before this position (at most 4), which complete a token's partial character."""
        text = (lambda tid: self._decoded_token(tid, context)) if decode else (lambda _: None)
        # The sampled (or prompt) token first, then the top-n, as vLLM's sampler lays a position out (its dict's
        # order is what a client iterating prompt_logprobs or a completion's top_logprobs sees); a top-n entry
        # for the same token overwrites it in place.
        d = {lp.token_id: Logprob(lp.logprob, lp.rank, text(lp.token_id))}
        for rank, (tid, v) in enumerate(lp.top):
            d[tid] = Logprob(v, rank + 1 if ranked else None, d[tid].decoded_token if tid in d else text(tid))
        return d

    def _decoded_token(self, token_id: int, context: Sequence[int]) -> str | None:
        """vLLM's Logprob.decoded_token: the token's own text, unless that ends in U+FFFD, a byte of a character
        split over several tokens (byte-level and byte-fallback vocabularies); then the text it adds after the
        tokens before it, "" while the character is still unfinished (LogprobsProcessor._correct_decoded_token)."""
        text = self._token_text(token_id)
        if text is None or not text.endswith("\ufffd"):
            return text
        assert self.tokenizer is not None
        for num_ctx in range(1, min(len(context), 4) + 1):  # 4 tokens hold any UTF-8 character
            ctx = list(context[-num_ctx:])
            full = self.tokenizer.decode(ctx + [token_id], skip_special_tokens=False)
            if full.endswith("\ufffd"):
                continue
            # The context's own trailing partial bytes belong to the character this token completes: their text
            # (none, when they were read) is this token's.
            clean_end = len(ctx)
            while clean_end > 0 and (self._token_text(ctx[clean_end - 1]) or "").endswith("\ufffd"):
                clean_end -= 1
            clean_prefix = self.tokenizer.decode(ctx[:clean_end], skip_special_tokens=False) if clean_end else ""
            # A normalizing tokenizer may not keep the prefix as it is: cut the longest common one.
            return full[len(os.path.commonprefix([clean_prefix, full])):]
        return ""

    def _token_text(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        # One decode per vocabulary entry at most: top-n lists repeat tokens, and whole-vocabulary
        # logprobs (--max-logprobs -1) would otherwise decode the vocabulary at every position.
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def _make_output(self, parent: _Parent, outs: list[CompletionOutput], finished: bool) -> RequestOutput:
        """The RequestOutput of `outs` (all n, or the one child that progressed); the metrics, prompt and cache
        figures are the parent request's."""
        first = parent.completions[0].core_request
        cores = [c.core_request for c in parent.completions]
        finished_times = [r.finished_time for r in cores if r.finished_time is not None]
        metrics = RequestMetrics(
            arrival_time=parent.arrival_time,
            first_scheduled_time=min((r.first_scheduled_time for r in cores if r.first_scheduled_time), default=None),
            first_token_time=min((r.first_token_time for r in cores if r.first_token_time), default=None),
            last_token_time=max((r.last_token_time for r in cores if r.last_token_time), default=None),
            finished_time=max(finished_times) if len(finished_times) == len(cores) else None,
            num_preemptions=sum(r.num_preemptions for r in cores),
        )
        # The error of a completion this output carries, else of an earlier one (a child that failed).
        carried = {o.index for o in outs}
        errors = ([c.error for c in parent.completions if c.error and c.index in carried]
                  + [c.error for c in parent.completions if c.error])
        prompt_logprobs = parent.prompt_logprobs
        if prompt_logprobs is not None and parent.completions[0].params.output_kind is RequestOutputKind.DELTA:
            # vLLM's pop: each position once, as its chunk is scored (the first output's starts with None).
            sent, parent.prompt_logprobs_sent = parent.prompt_logprobs_sent, parent.prompt_logprobs_ready
            prompt_logprobs = prompt_logprobs[sent : parent.prompt_logprobs_ready]
        elif prompt_logprobs is not None:
            prompt_logprobs = list(prompt_logprobs)
        prompt_logprobs = as_container(prompt_logprobs, parent.completions[0].params.flat_logprobs)
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            outputs=outs,
            finished=finished,
            metrics=metrics,
            num_cached_tokens=(max(first.num_cached_tokens, 0) if parent.remote_prefill_cached_tokens is None
                               else parent.remote_prefill_cached_tokens),
            num_cache_creation_tokens=first.num_cache_creation_tokens or 0,
            kv_transfer_params=parent.completions[0].kv_transfer_params,
            error=errors[0] if errors else None,
            prompt_logprobs=prompt_logprobs,
            lora_request=first.lora_request,
        )

    @staticmethod
    def _pooling_output(parent: _Parent) -> PoolingRequestOutput:
        comp = parent.completions[0]
        core = comp.core_request
        return PoolingRequestOutput(
            request_id=parent.request_id,
            outputs=PoolingOutput(comp.pooling_output),
            prompt_token_ids=parent.prompt_token_ids,
            num_cached_tokens=max(core.num_cached_tokens, 0),
            finished=comp.finished,
            prompt=parent.prompt,
            error=comp.error if comp.error else (None if comp.finish_reason in (None, "stop") else
                                                 f"the request ended: {comp.finish_reason}"),
            metrics=RequestMetrics(arrival_time=parent.arrival_time, first_scheduled_time=core.first_scheduled_time,
                                   first_token_time=core.first_token_time, last_token_time=core.last_token_time,
                                   finished_time=core.finished_time, num_preemptions=core.num_preemptions),
        )

    @staticmethod
    def _completion_output(c: _Completion) -> CompletionOutput:
        # While streaming, hold back a tail that could still grow into a stop string.
        hold = 0
        if not c.finished and c.params.stop and not c.params.include_stop_str_in_output:
            hold = max(len(s) for s in c.params.stop) - 1
        visible = len(c.text) - hold if hold else len(c.text)
        visible = max(visible, c.sent_text_len)
        delta_text = c.text[c.sent_text_len : visible]
        delta_ids = c.token_ids[c.sent_token_len :]
        delta_lp = c.logprobs[c.sent_logprobs_len :] if c.logprobs is not None else None
        c.sent_text_len, c.sent_token_len = visible, len(c.token_ids)
        c.sent_logprobs_len = len(c.logprobs) if c.logprobs is not None else 0
        if c.params.output_kind is RequestOutputKind.DELTA:  # vLLM's: only the new part (the sum stays whole)
            text, token_ids, logprobs = delta_text, list(delta_ids), delta_lp
        else:  # vLLM's get_next_output_text(delta=False): the whole text, less the held-back tail
            text, token_ids = c.text[:visible], list(c.token_ids)
            logprobs = list(c.logprobs) if c.logprobs is not None else None
        flat = c.params.flat_logprobs  # the containers the request asked for (vLLM's FlatLogprobs or lists)
        return CompletionOutput(
            index=c.index,
            text=text,
            token_ids=token_ids,
            cumulative_logprob=c.cumulative_logprob,
            logprobs=as_container(logprobs, flat),
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
            delta_text=delta_text,
            delta_token_ids=delta_ids,
            delta_logprobs=as_container(delta_lp, flat),
            lora_request=c.core_request.lora_request,
        )

    def _forget(self, parent: _Parent) -> None:
        self._parents.pop(parent.request_id, None)
        for c in parent.completions:
            self._by_core_id.pop(c.core_request.request_id, None)


def remote_prefill_cached_tokens(params: SamplingParams) -> int | None:
    """vLLM's: the prefill engine's prefix-cache hit that a decode engine's request carries in its kv_transfer_params
    (`remote_prefill_cached_tokens`, with do_remote_prefill), or None."""
    kv_params = (params.extra_args or {}).get("kv_transfer_params")
    if isinstance(kv_params, dict) and kv_params.get("do_remote_prefill"):
        cached = kv_params.get("remote_prefill_cached_tokens")
        if isinstance(cached, int):
            return cached
    return None


def check_stop_strings(output_text: str, new_char_count: int, stop: Sequence[str],
                       include_in_output: bool) -> tuple[str, int] | None:
    """vLLM's check_stop_strings (v1/engine/detokenizer.py): the stop string found in the text's last
    `new_char_count` characters (or spanning their seam with the text before), and the length to cut the
    text to (-1: no cut, the stop string ends the text and is kept), or None.

    Of several in the new text (one token's text can hold more than one), the one that completes first
    wins, ties going to the earlier in `stop`: the stop string the output would have met first, had its
    text come a character at a time, whatever order the list gives them."""
    if not new_char_count or not stop:
        return None
    best: tuple[int, int, str] | None = None  # (end, start, stop string)
    for s in stop:
        # Only the new text, plus enough of the old to catch a stop string spanning the seam.
        start = output_text.find(s, max(0, len(output_text) - new_char_count - len(s) + 1))
        if start != -1 and (best is None or start + len(s) < best[0]):
            best = (start + len(s), start, s)
    if best is None:
        return None
    end, start, s = best
    if not include_in_output:
        return s, start
    return s, -1 if end >= len(output_text) else end

"""StructuredOutputManager: grammars for constrained requests, compiled off the step loop (vLLM's shape).

vLLM: `vllm/v1/structured_output/__init__.py`. The scheduler drives it:

- `grammar_init(request)` when a constrained request arrives: compilation is submitted to a thread
  pool (cached by (kind, spec), so equal schemas compile once and share the result); the request
  waits in WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR and is skipped, not blocking the queue, until `is_ready` says so;
- `grammar_bitmask(requests, spec_tokens)` each step: per request that samples in this step, one
  bitmask row per scheduled draft position plus one for the token after them (the allowed next
  tokens, one bit per vocabulary entry), carried in the SchedulerOutput. The matcher walks the drafts
  to fill their rows and is rolled back after (vLLM's grammar_bitmask with spec tokens);
- `validate_tokens(request, drafts)`: the longest prefix of the proposer's drafts the grammar accepts
  (what the scheduler keeps; vLLM's update_draft_token_ids);
- `accept_tokens(request, ids)` with the tokens the step produced: advances the matcher;
- `free(request)` when the request ends (finished, aborted, errored), also while still compiling;
- `clear_backend()` when the engine stops: a compile under way finishes, queued ones are cancelled.

Each request's StructuredOutputRequest answers vLLM's questions about its grammar: `is_grammar_ready` (compiling
is over, either way) and `grammar` (its matcher, the compile's error, or None while compiling).

With a reasoning parser (`--reasoning-parser`, tokenloom/reasoning), the grammar waits for the end of the
reasoning, as vLLM's `_get_constraint_bounds` decides it: until the parser sees the reasoning end, the rows
are unconstrained and the matcher is not fed; the token that ends it (`</think>`) is not fed either, the ones
after it are; an implicit end (Qwen3's `<tool_call>`) is fed, being content, though its own row stays free.
Drafts are split the same way: those before the end pass unchecked, those after it are validated. Whether
the prompt already ended the reasoning comes with the request (`reasoning_ended`, from the server's parser)
or, when it does not say (None), is asked of the engine's own parser. `enable_in_reasoning` constrains from
the first token. Each request gets its own parser (its `reasoning_parser_kwargs`: Qwen3's enable_thinking),
built from the engine's tokenizer (vLLM's manager does the same), so every engine process has the gate.

Pure Python, no torch: the grammar library sits behind a `GrammarBackend` (tokenloom/model/grammar.py
builds the xgrammar one from the tokenizer); bitmasks are opaque to this module.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, TypeVar

from tokenloom import envs
from tokenloom.reasoning import ReasoningParser
from tokenloom.sampling_params import NO_TOKENIZER_ERROR

if TYPE_CHECKING:
    from tokenloom.core.request import Request

_T = TypeVar("_T")


# A request whose grammar allowed no token at this point (its text so far cannot be completed: a rule that
# never ends, `root ::= "a" b`, `b ::= b "x"`), so the sampled token was refused. The request's own input is at
# fault, so the server answers it as a 400 (server/errors.py generation_error); vLLM logs the mismatch and goes
# on unconstrained. Every such message starts with these words.
GRAMMAR_DEAD_END_ERROR = "the structured-output grammar allows no token here"


def grammar_dead_end_message(num_generated: int, token_ids: Sequence[int]) -> str:
    return (f"{GRAMMAR_DEAD_END_ERROR}: after {num_generated} generated tokens it cannot be completed (the sampled "
            f"tokens {list(token_ids)} were refused; does a rule never end?)")


def is_grammar_dead_end(error: str | None) -> bool:
    return error is not None and error.startswith(GRAMMAR_DEAD_END_ERROR)


class GrammarMatcher(Protocol):
    """One request's position in its grammar."""

    def accept_token(self, token_id: int) -> bool: ...
    def fill_bitmask(self, bitmask: Any, index: int) -> None: ...
    def is_terminated(self) -> bool: ...
    def rollback(self, num_tokens: int) -> None: ...


class GrammarBackend(Protocol):
    def compile(self, kind: str, spec: str) -> Any: ...
    def matcher(self, compiled: Any, stop_token_ids: Sequence[int]) -> GrammarMatcher: ...
    def allocate_bitmask(self, num_rows: int) -> Any: ...
    def fill_all_allowed(self, bitmask: Any, index: int) -> None: ...
    def copy_row(self, bitmask: Any, src: int, dst: int) -> None: ...
    # Beam search's use (tokenloom/engine/beam_search.py): a row as the list of the token ids it allows.
    def allowed_token_ids(self, bitmask: Any, index: int) -> list[int]: ...


@dataclass
class StructuredOutputRequest:
    """The grammar side of one request (Request.structured_output_request)."""

    key: tuple[str, str]
    compiled: Future[Any] | None = None
    matcher: GrammarMatcher | None = None
    # Why the grammar did not compile (the compile's exception), once it is known.
    compile_error: Exception | None = None
    # The request's matcher from the compiled grammar (grammar_init sets it: the backend, the request's stop tokens).
    build_matcher: Callable[[Any], GrammarMatcher] | None = field(default=None, repr=False)
    num_accepted: int = 0
    # Seconds from grammar_init to the compiled grammar (0 for a cache hit): for the figures.
    compile_wait_s: float = field(default=0.0, repr=False)
    # vLLM's reasoning gate: True once reasoning has ended (the grammar applies), False while it goes on, None
    # until the engine has asked its parser about the prompt. The server sets it from its own parser.
    reasoning_ended: bool | None = None
    reasoning_parser_kwargs: dict[str, Any] | None = None  # what this request's parser is built with
    reasoner: ReasoningParser | None = field(default=None, repr=False)

    def _check_grammar_completion(self) -> bool:
        """vLLM's: whether compiling is over, and the matcher built if it succeeded. A compile that raised is
        over, whatever it raised: a TimeoutError from the compiler is a failure, not a compile still running
        (vLLM #53130), since only `done()` says whether it runs."""
        if self.matcher is not None or self.compile_error is not None:
            return True
        if self.compiled is None or not self.compiled.done():
            return False
        try:
            compiled = self.compiled.result()
        except Exception as exc:  # whatever the compile raised (a cancelled one too) is why it failed
            self.compile_error = exc
            return True
        assert self.build_matcher is not None, "grammar_init sets build_matcher"
        self.matcher = self.build_matcher(compiled)
        return True

    @property
    def is_grammar_ready(self) -> bool:
        """vLLM's name: compiling is over (the matcher is built, or compile_error says why not)."""
        return self._check_grammar_completion()

    @property
    def grammar(self) -> GrammarMatcher | Exception | None:
        """vLLM's name: the request's matcher, the compile's error, or None while it compiles."""
        if not self._check_grammar_completion():
            return None
        return self.compile_error if self.compile_error is not None else self.matcher


class ConstraintBounds(NamedTuple):
    """Where, in a step's new tokens (or drafts), the grammar starts reading them and masking the sampling."""

    grammar_start: int
    constraint_start: int


_CONSTRAINED_FROM_START = ConstraintBounds(0, 0)
_NO_SPEC_TOKENS = ConstraintBounds(1, 1)  # reasoning goes on: the next sampled token is free


def strip_speculative_padding(token_ids: Sequence[int]) -> list[int]:
    """The drafts up to the first placeholder (-1), which the grammar never sees."""
    for i, token_id in enumerate(token_ids):
        if token_id < 0:
            return list(token_ids[:i])
    return list(token_ids)


def compile_regex_with_timeout(compile_fn: Callable[[str], _T], pattern: str) -> _T:
    """`compile_fn(pattern)`, given at most VLLM_REGEX_COMPILATION_TIMEOUT_S seconds (0 or less: no limit), else a
    ValueError in vLLM's words naming the pattern. A regex of nested quantifiers can take exponential time to
    become an automaton (vLLM's advisory GHSA-rwxx-mrjm-wc2m); a compile that runs over is left to finish on its
    own thread (a thread cannot be stopped), the request is refused now. Errors of the compile itself propagate."""
    timeout = envs.VLLM_REGEX_COMPILATION_TIMEOUT_S
    if timeout <= 0:
        return compile_fn(pattern)
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="regex-compile")
    future = executor.submit(compile_fn, pattern)
    executor.shutdown(wait=False)
    try:
        return future.result(timeout=timeout)
    except concurrent.futures.TimeoutError:
        raise ValueError(f"Regex compilation timed out after {timeout}s. The pattern may be too complex or contain "
                         "constructs that cause exponential state-space explosion (e.g. nested quantifiers). "
                         f"Pattern: {pattern[:200]}") from None


class StructuredOutputManager:
    # Compiled grammars kept by (kind, spec); xgrammar keeps its own cache behind this one as well.
    cache_size = 256

    def __init__(self, backend_factory: Callable[[], GrammarBackend] | None,
                 max_workers: int | None = None,
                 reasoner_factory: Callable[[dict[str, Any]], ReasoningParser] | None = None,
                 enable_in_reasoning: bool = False) -> None:
        """`backend_factory` None: no tokenizer (vLLM's skip_tokenizer_init), so no grammar can ever
        compile; a constrained request that reaches the scheduler anyway fails (see grammar_init).
        `reasoner_factory`: a request's reasoning parser from its reasoning_parser_kwargs (None: no
        --reasoning-parser, grammars apply from the first token, as with `enable_in_reasoning`)."""
        self._backend_factory = backend_factory
        self._reasoner_factory = reasoner_factory
        self.enable_in_reasoning = enable_in_reasoning
        # Built on first use (get_backend), None again after clear_backend: vLLM's attribute.
        self.backend: GrammarBackend | None = None
        self._backend_lock = threading.Lock()
        # Compilation runs here, never on the step loop (vLLM: half the cores; none without a tokenizer).
        workers = max_workers or max(1, ((os.cpu_count() or 2) + 1) // 2)
        self.executor = (ThreadPoolExecutor(max_workers=workers, thread_name_prefix="grammar")
                         if backend_factory is not None else None)
        self._compiled: OrderedDict[tuple[str, str], Future[Any]] = OrderedDict()
        # Live constrained requests by id: what `free` must clear (the leak check reads it).
        self.requests: dict[str, StructuredOutputRequest] = {}
        self.num_compiles = 0
        self.num_cache_hits = 0

    def get_backend(self) -> GrammarBackend:
        """The grammar backend, built on first use, in a compile thread: building the tokenizer's vocabulary
        table takes about a second and must not stall a step (vLLM builds it in grammar_init)."""
        with self._backend_lock:
            if self.backend is None:
                assert self._backend_factory is not None, "no grammar backend without a tokenizer"
                self.backend = self._backend_factory()
            return self.backend

    # Requests in and out ---------------------------------------------------------------------
    def grammar_init(self, request: Request) -> None:
        so = request.structured_output_request
        assert so is not None
        so.compile_wait_s = -time.perf_counter()
        so.build_matcher = self._matcher_builder(request)
        self.requests[request.request_id] = so
        if self.executor is None:
            # vLLM's scheduler leaves such a request waiting for a grammar that never comes (its
            # frontend refuses it first, with this message); here it waits one schedule() like any
            # request whose compile failed, then finishes with this error instead of hanging.
            so.compiled = Future()
            so.compiled.set_exception(ValueError(NO_TOKENIZER_ERROR))
            return
        future = self._compiled.get(so.key)
        if future is not None and not (future.done() and future.exception() is not None):
            self._compiled.move_to_end(so.key)
            self.num_cache_hits += 1
        else:
            future = self.executor.submit(self._compile, so.key)
            self._compiled[so.key] = future
            self.num_compiles += 1
            while len(self._compiled) > self.cache_size:
                self._compiled.popitem(last=False)
        so.compiled = future

    def _compile(self, key: tuple[str, str]) -> Any:
        return self.get_backend().compile(*key)

    def _matcher_builder(self, request: Request) -> Callable[[Any], GrammarMatcher]:
        """How the request's matcher is made from its compiled grammar: the request's stop tokens (EOS and its
        stop_token_ids) end the grammar, and only where it may end (vLLM's override_stop_tokens)."""
        stop_token_ids = sorted(request.sampling_params.all_stop_token_ids)
        return lambda compiled: self.get_backend().matcher(compiled, stop_token_ids)

    def is_ready(self, request: Request) -> bool:
        """True once the grammar compiled (the matcher is then built); raises the compile error."""
        so = request.structured_output_request
        assert so is not None and so.compiled is not None
        if so.matcher is not None:
            return True
        if not so._check_grammar_completion():
            return False
        if so.compile_error is not None:
            raise so.compile_error
        so.compile_wait_s += time.perf_counter()
        return True

    def free(self, request: Request) -> None:
        so = self.requests.pop(request.request_id, None)
        if so is not None:
            # The compiled grammar stays cached for the next request with this schema; only this
            # request's matcher goes.
            so.matcher = None

    # The reasoning gate -------------------------------------------------------------------------
    def _reasoner(self, request: Request) -> ReasoningParser | None:
        """The request's own parser, built on first use (vLLM's _get_reasoner)."""
        so = request.structured_output_request
        if so is None or self._reasoner_factory is None:
            return None
        if so.reasoner is None:
            so.reasoner = self._reasoner_factory(so.reasoning_parser_kwargs or {})
        return so.reasoner

    def constraint_bounds(self, request: Request, tokens: Sequence[int], committed: bool = False
                          ) -> ConstraintBounds:
        """Where in `tokens` (a step's new tokens, or drafts, no placeholders) the grammar starts reading
        and masking (vLLM's _get_constraint_bounds): 0 once reasoning has ended; past the end while it
        goes on; after the token that ends it when one of them does. `committed`: `tokens` are already
        the end of request.all_token_ids."""
        so = request.structured_output_request
        assert so is not None
        if self.enable_in_reasoning or so.reasoning_ended:
            return _CONSTRAINED_FROM_START
        reasoner = self._reasoner(request)
        if reasoner is None:
            return _CONSTRAINED_FROM_START
        if so.reasoning_ended is None:
            if reasoner.is_reasoning_end(request.prompt_token_ids):
                return _CONSTRAINED_FROM_START
            so.reasoning_ended = False
        if not tokens:
            return _NO_SPEC_TOKENS
        find_end = getattr(reasoner, "find_reasoning_end", None)
        if find_end is not None and getattr(reasoner, "reasoning_end_token_ids", None):
            end = find_end(tokens)
            if end is not None:
                start = end.offset + 1
                return ConstraintBounds(end.offset if end.implicit else start, start)
        return self._bounds_by_streaming_end(reasoner, request, tokens, committed)

    @staticmethod
    def _bounds_by_streaming_end(reasoner: ReasoningParser, request: Request, tokens: Sequence[int],
                                 committed: bool) -> ConstraintBounds:
        """A parser that only answers is_reasoning_end_streaming: the grammar starts after the shortest
        prefix of `tokens` that ends reasoning (vLLM's fallback)."""
        n = len(tokens)
        input_ids = list(request.all_token_ids) if committed else [*request.all_token_ids, *tokens]
        if not reasoner.is_reasoning_end_streaming(input_ids, list(tokens)):
            return ConstraintBounds(n + 1, n + 1)
        delta_ids = list(tokens)
        for i in range(n - 1, 0, -1):
            input_ids.pop()
            delta_ids.pop()
            if not reasoner.is_reasoning_end_streaming(input_ids, delta_ids):
                return ConstraintBounds(i + 1, i + 1)
        return ConstraintBounds(1, 1)

    # The step ----------------------------------------------------------------------------------
    def grammar_bitmask(self, requests: Sequence[Request],
                        spec_tokens: Mapping[str, Sequence[int]] | None = None) -> Any:
        """Rows in request order: for each request, one per scheduled draft (what may stand at that
        position given the drafts before it), then one for the token after the drafts. A placeholder
        draft (-1) and everything after it is unconstrained (its output is never used); once a draft
        is rejected, the rows after it repeat the last valid one (vLLM does both). While reasoning goes
        on the rows are unconstrained, up to the draft that ends it (constraint_bounds)."""
        spec_tokens = spec_tokens or {}
        backend = self.get_backend()
        bitmask = backend.allocate_bitmask(sum(1 + len(spec_tokens.get(r.request_id, ())) for r in requests))
        row = 0
        for request in requests:
            so = request.structured_output_request
            assert so is not None and so.matcher is not None
            matcher = so.matcher
            drafts = spec_tokens.get(request.request_id, ())
            grammar_start, constraint_start = self.constraint_bounds(request, strip_speculative_padding(drafts))
            advanced, seen_padding, failed = 0, False, None
            for i, token in enumerate(drafts):
                if failed is not None:
                    backend.copy_row(bitmask, failed, row)
                    row += 1
                    continue
                self._fill_row(matcher, bitmask, row, not seen_padding and i >= constraint_start)
                if token < 0:
                    seen_padding = True
                elif not seen_padding and i >= grammar_start:
                    if not matcher.is_terminated() and matcher.accept_token(token):
                        advanced += 1
                    else:
                        failed = row  # validate_tokens makes this unexpected
                row += 1
            if failed is not None:
                backend.copy_row(bitmask, failed, row)
            else:
                self._fill_row(matcher, bitmask, row, not seen_padding and constraint_start <= len(drafts))
            row += 1
            if advanced:
                matcher.rollback(advanced)
        return bitmask

    def _fill_row(self, matcher: GrammarMatcher, bitmask: Any, row: int, apply: bool) -> None:
        if apply and not matcher.is_terminated():
            matcher.fill_bitmask(bitmask, row)
        else:  # unconstrained: a placeholder position, or past the grammar's end (ignore_eos)
            self.get_backend().fill_all_allowed(bitmask, row)

    def validate_tokens(self, request: Request, token_ids: Sequence[int]) -> list[int]:
        """The longest prefix of `token_ids` the grammar accepts from the request's position (drafts
        that are still reasoning pass unchecked); the matcher is left where it was."""
        so = request.structured_output_request
        assert so is not None and so.matcher is not None
        token_ids = strip_speculative_padding(token_ids)
        grammar_start, _ = self.constraint_bounds(request, token_ids)
        if grammar_start >= len(token_ids):
            return token_ids
        accepted = 0
        for token in token_ids[grammar_start:]:
            if so.matcher.is_terminated() or not so.matcher.accept_token(token):
                break
            accepted += 1
        if accepted:
            so.matcher.rollback(accepted)
        return token_ids[:grammar_start + accepted]

    def accept_tokens(self, request: Request, token_ids: Sequence[int]) -> bool:
        """Advance the request's matcher with the step's tokens (those after the end of reasoning, which
        this latches); False if the grammar rejects a token."""
        so = request.structured_output_request
        assert so is not None and so.matcher is not None
        if not token_ids:
            return True
        grammar_start, _ = self.constraint_bounds(request, token_ids, committed=True)
        if grammar_start > len(token_ids):
            return True
        so.reasoning_ended = True
        for token in token_ids[grammar_start:]:
            if so.matcher.is_terminated():
                return True  # tokens after the grammar's end (ignore_eos) are not constrained
            if not so.matcher.accept_token(token):
                return False
            so.num_accepted += 1
        return True

    def is_terminated(self, request: Request) -> bool:
        so = request.structured_output_request
        return so is not None and so.matcher is not None and so.matcher.is_terminated()

    def clear_backend(self) -> None:
        """vLLM's: stop compiling (a compile already running finishes, queued ones are cancelled) and let the
        backend go; again is a no-op."""
        if self.executor is not None:
            self.executor.shutdown(wait=True, cancel_futures=True)
        self.backend = None

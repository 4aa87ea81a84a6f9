"""Beam search above the engine, as vLLM 0.32 runs it (vllm/entrypoints/generate/beam_search/).

Nothing of beam search lives in the scheduler or the runner. Each step, every live beam is an
ordinary request for one token that asks for `2 * beam_width` logprobs (the sampled token comes
with them, as with any request); every (beam, token) pair of those is a candidate whose score is the
beam's cumulative logprob plus the token's. A candidate ending in EOS is finished (unless
`ignore_eos`); of the others the best `beam_width` by cumulative logprob live on. At the end the
finished and the live beams are ranked by `cum_logprob / length ** length_penalty` (the length
counts the prompt and not a final EOS: vLLM's formula, after Hugging Face's) and the best
`beam_width` are returned.

Re-sending a beam's whole prefix every step is cheap because the requests of step N free their
blocks into the prefix cache, where step N+1's beams find them: only the last, partly filled block
and the new token are computed again.

`LLM.beam_search` (offline) and the server's `use_beam_search` (beam_search_async.py) differ where
vLLM's two paths differ: offline beams keep the prompt and a final EOS in `tokens` and `text`; online
outputs are the generated tokens only, EOS dropped unless include_stop_str_in_output, with
finish_reason "stop"/"length".

Structured outputs (offline only, as in vLLM 0.32, whose server drops them from beam search; tokenloom's server
refuses them): `BeamGrammar` constrains each step. A grammar compiled once per search; per beam a matcher replays
the beam's generated tokens (vLLM's rule: no state is kept between steps). A beam whose grammar has terminated
(or allows nothing) is completed, if it generated anything; otherwise its allowed next tokens go to its step
request as `allowed_token_ids` (however many: vLLM stops sending them past 1024, see constrained_step_params),
and its candidates are filtered to the allowed set (the raw logprobs the step returns are from before the mask;
the sampled token, an allowed one, rides along).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from tokenloom.engine.outputs import Logprob, RequestOutput
from tokenloom.sampling_params import BeamSearchParams, SamplingParams

if TYPE_CHECKING:
    from tokenloom.core.structured_output import GrammarBackend



@dataclass
class BeamSearchSequence:
    """One beam: its tokens (the prompt's included) and the logprobs dict of each step."""

    orig_prompt: dict[str, Any]  # {"type": "token", "prompt_token_ids": [...], "prompt": text or None}
    tokens: list[int]
    logprobs: list[dict[int, Logprob]]
    lora_request: Any = None  # vLLM's field: the prompt's LoRARequest (read from orig_prompt), or None
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def __post_init__(self) -> None:
        if self.lora_request is None:
            self.lora_request = self.orig_prompt.get("lora_request")

    def get_prompt(self) -> dict[str, Any]:
        """The beam as the next step's prompt (with its LoRARequest under "lora_request" when it has one)."""
        prompt = {"prompt_token_ids": self.tokens, "prompt": self.orig_prompt.get("prompt")}
        if self.lora_request is not None:
            prompt["lora_request"] = self.lora_request
        return prompt


@dataclass
class BeamSearchOutput:
    """The best beams of one prompt, best first (at most beam_width)."""

    sequences: list[BeamSearchSequence]


class BeamSearchInstance:
    """One prompt's search: the live beams and the finished ones."""

    def __init__(self, prompt: dict[str, Any], logprobs: list[dict[int, Logprob]] | None = None) -> None:
        self.beams = [BeamSearchSequence(orig_prompt=prompt, tokens=list(prompt["prompt_token_ids"]),
                                         logprobs=list(logprobs or []))]
        self.completed: list[BeamSearchSequence] = []


def get_beam_search_score(tokens: list[int], cumulative_logprob: float, eos_token_id: int | None,
                          length_penalty: float = 1.0) -> float:
    """cum_logprob / len ** length_penalty; a final EOS does not count (vLLM's, from transformers)."""
    seq_len = len(tokens)
    if tokens and tokens[-1] == eos_token_id:
        seq_len -= 1
    return _score(cumulative_logprob, seq_len, length_penalty)


def _score(cumulative_logprob: float, seq_len: int, length_penalty: float) -> float:
    try:
        denominator = max(seq_len, 1) ** length_penalty
    except OverflowError:  # an extreme length_penalty: the limit, not a crash
        denominator = math.inf
    if denominator == 0.0:
        return math.copysign(math.inf, cumulative_logprob) if cumulative_logprob else 0.0
    return cumulative_logprob / denominator


def create_sort_beams_key_function(eos_token_id: int | None,
                                   length_penalty: float) -> Callable[[BeamSearchSequence], float]:
    def sort_beams_key(x: BeamSearchSequence) -> float:
        return get_beam_search_score(x.tokens, x.cum_logprob, eos_token_id, length_penalty)

    return sort_beams_key


def step_sampling_params(params: BeamSearchParams, max_logprobs: int = 20, seed: int | None = None) -> SamplingParams:
    """What each beam asks the engine for in one step: one token and 2 * beam_width logprobs. The
    sampled token rides along in the logprobs (a candidate too, as in vLLM: at temperature > 0 it may
    be outside the top 2 * beam_width); `seed` (the server's request seed) makes that draw repeatable."""
    wanted = 2 * params.beam_width
    if 0 <= max_logprobs < wanted:
        raise ValueError(f"beam_width={params.beam_width} needs {wanted} logprobs per step, more than "
                         f"max_logprobs ({max_logprobs}); lower the beam width or raise max_logprobs")
    return SamplingParams(logprobs=wanted, max_tokens=1, temperature=params.temperature, seed=seed, max_logprobs=-1)


def step_logprobs(result: RequestOutput) -> dict[int, Logprob] | None:
    """The one logprobs dict of a one-token request (None if it produced no token)."""
    comp = result.outputs[0]
    return comp.logprobs[0] if comp.logprobs else None


def top_by_cum_logprob(candidates: list[BeamSearchSequence], beam_width: int) -> list[BeamSearchSequence]:
    # Stable: equal scores keep the order the candidates were made in (beam order, then the logprobs dict's).
    return sorted(candidates, key=lambda b: b.cum_logprob, reverse=True)[:beam_width]


def search_is_decided(completed: list[BeamSearchSequence], beams: list[BeamSearchSequence], beam_width: int,
                      eos_token_id: int | None, length_penalty: float, max_len: int) -> bool:
    """True when no further step can change the answer, so stopping now returns exactly what running
    all max_tokens steps would (vLLM runs them all: with chat's default max_tokens, the whole context).

    Every sequence still to come descends from a live beam, so its cum_logprob is at most the best live
    one's (logprobs are <= 0) and its length (prompt included, a final EOS not) lies between the live
    beams' and `max_len`; its score is therefore at most `bound`. Once beam_width finished beams all
    score strictly above that bound, nothing can enter the top beam_width or reorder it."""
    if len(completed) < beam_width or not beams:
        return not beams
    best_cum = max(b.cum_logprob for b in beams)
    if best_cum > 0.0:
        return False
    length = len(beams[0].tokens)
    # cum <= 0: cum / L ** p is largest at the longest L for p > 0, at the shortest for p < 0.
    bound = _score(best_cum, max_len if length_penalty > 0 else length, length_penalty)
    score = create_sort_beams_key_function(eos_token_id, length_penalty)
    kth = sorted((score(b) for b in completed), reverse=True)[beam_width - 1]
    return kth > bound


# Structured outputs (vLLM's _init_beam_search_structured_output / _build_beam_sampling_params) -------------
class BeamGrammar:
    """One search's grammar: compiled once by the engine's grammar backend (the StructuredOutputManager's
    xgrammar one), a fresh matcher per beam and step that replays the beam's generated tokens. vLLM replays
    too (its backends cannot clone a matcher); the replay is microseconds a token, the bitmask fill the cost."""

    def __init__(self, backend: GrammarBackend, key: tuple[str, str], eos_token_id: int | None) -> None:
        self.backend = backend
        self.compiled = backend.compile(*key)
        # The grammar's end is EOS, the token that finishes a beam (vLLM's backend: the tokenizer's EOS).
        self.stop_token_ids = [eos_token_id] if eos_token_id is not None else []
        self.bitmask = backend.allocate_bitmask(1)

    def allowed_next(self, generated: Sequence[int]) -> list[int] | None:
        """The token ids the grammar allows after `generated`; None when it has terminated, rejects a
        generated token (a step's logprobs filter keeps that from happening) or allows nothing: the beam is done."""
        matcher = self.backend.matcher(self.compiled, self.stop_token_ids)
        for token in generated:
            if matcher.is_terminated() or not matcher.accept_token(token):
                return None
        if matcher.is_terminated():
            return None
        matcher.fill_bitmask(self.bitmask, 0)
        return self.backend.allowed_token_ids(self.bitmask, 0) or None


def constrained_step_params(beams: Sequence[BeamSearchSequence], base: SamplingParams,
                            grammar: BeamGrammar) -> list[tuple[SamplingParams, frozenset[int]] | None]:
    """Per beam, its step request's params and the set its candidates are filtered to; None for a beam the
    grammar has finished. The per-step rule of vLLM's _build_beam_sampling_params."""
    entries: list[tuple[SamplingParams, frozenset[int]] | None] = []
    for beam in beams:
        allowed = grammar.allowed_next(beam.tokens[len(beam.orig_prompt["prompt_token_ids"]):])
        if allowed is None:
            entries.append(None)
            continue
        # Always masked: vLLM sends at most 1024 ids (its GPU sampler's cap) and runs a larger set unmasked, so
        # a beam whose raw top logprobs hold no allowed token dies, and a search can return nothing (SmolLM2,
        # regex [0-9]{3}-[a-z]{4}: every beam died at the letters, 4,892 allowed ids). tokenloom's sampler has
        # no cap, so the sampled token is always an allowed one and every live beam keeps a candidate.
        params = replace(base, allowed_token_ids=allowed)
        entries.append((params, frozenset(allowed)))
    return entries


# Offline (vLLM's BeamSearchOfflineMixin.beam_search) ----------------------------------------------------
# One-token requests for the given prompts, one SamplingParams for all or one per prompt.
RunStep = Callable[[list[dict[str, Any]], SamplingParams | list[SamplingParams]], list[RequestOutput]]


def beam_search_offline(
    prompts: Sequence[dict[str, Any]],
    params: BeamSearchParams,
    run_step: RunStep,
    decode: Callable[[list[int], bool], str],
    eos_token_id: int | None,
    max_logprobs: int = 20,
    concurrency_limit: int | None = None,
    use_tqdm: bool = False,
    early_stop: bool = True,
    grammar: BeamGrammar | None = None,
) -> list[BeamSearchOutput]:
    """`prompts`: {"prompt_token_ids": [...], "prompt": text or None} each. `run_step` runs one-token
    requests to completion (LLM.generate); `decode(ids, skip_special_tokens)` is the tokenizer's.
    `early_stop=False` runs every one of max_tokens steps, as vLLM does (same answer, more steps).
    `grammar`: params.structured_outputs compiled (LLM.beam_search builds it), constraining every beam."""
    base = step_sampling_params(params, max_logprobs)
    sort_key = create_sort_beams_key_function(eos_token_id, params.length_penalty)
    instances = [BeamSearchInstance({"type": "token", **p}) for p in prompts]
    limit = concurrency_limit if concurrency_limit is not None else max(len(instances), 1)
    if limit < 1:
        raise ValueError(f"concurrency_limit must be at least 1, got {limit}")
    for start in range(0, len(instances), limit):
        batch = instances[start:start + limit]
        steps: Any = range(params.max_tokens)
        if use_tqdm:
            from tqdm import tqdm

            steps = tqdm(steps, desc="Beam search", unit="token", unit_scale=False)
        for _ in steps:
            if _offline_step(batch, base, run_step, eos_token_id, params.ignore_eos, params.beam_width, grammar):
                break
            for instance in batch:
                if not (early_stop and instance.beams):
                    continue
                max_len = len(instance.beams[0].orig_prompt["prompt_token_ids"]) + params.max_tokens
                if search_is_decided(instance.completed, instance.beams, params.beam_width, eos_token_id,
                                     params.length_penalty, max_len):
                    # The live beams score below every beam returned: they end here, as they would later.
                    instance.completed.extend(instance.beams)
                    instance.beams = []
    outputs = []
    for instance in instances:
        instance.completed.extend(instance.beams)
        best = sorted(instance.completed, key=sort_key, reverse=True)[:params.beam_width]
        for beam in best:
            beam.text = decode(beam.tokens, params.skip_special_tokens)
        outputs.append(BeamSearchOutput(sequences=best))
    return outputs


def _offline_step(batch: list[BeamSearchInstance], base: SamplingParams, run_step: RunStep,
                  eos_token_id: int | None, ignore_eos: bool, beam_width: int,
                  grammar: BeamGrammar | None = None) -> bool:
    """One token for every live beam of the batch; True when no beam is left to extend."""
    allowed_sets: list[frozenset[int] | None] | None = None
    if grammar is not None:
        entries = constrained_step_params([beam for instance in batch for beam in instance.beams], base, grammar)
        allowed_sets, pos = [], 0
        for instance in batch:
            live = []
            for beam, entry in zip(instance.beams, entries[pos:pos + len(instance.beams)]):
                if entry is None:
                    # The grammar has ended: the beam is finished (vLLM drops one that generated nothing).
                    if len(beam.tokens) > len(beam.orig_prompt["prompt_token_ids"]):
                        instance.completed.append(beam)
                else:
                    live.append(beam)
                    allowed_sets.append(entry[1])
            pos += len(instance.beams)
            instance.beams = live
        step_params: SamplingParams | list[SamplingParams] = [entry[0] for entry in entries if entry is not None]
    else:
        step_params = base
    all_beams = [beam for instance in batch for beam in instance.beams]
    if not all_beams:
        return True
    results = run_step([beam.get_prompt() for beam in all_beams], step_params)
    pos = 0
    for instance in batch:
        beams, outs = instance.beams, results[pos:pos + len(instance.beams)]
        allowed_of = allowed_sets[pos:pos + len(beams)] if allowed_sets is not None else [None] * len(beams)
        pos += len(beams)
        if any(out.outputs[0].finish_reason == "abort" for out in outs):
            for beam in beams:
                beam.finish_reason = "abort"
                instance.completed.append(beam)
            instance.beams = []
            continue
        candidates = []
        for beam, out, allowed in zip(beams, outs, allowed_of):
            logprobs = step_logprobs(out)
            if logprobs is None:
                continue
            for token_id, lp in logprobs.items():
                # The step's logprobs are the raw ones, from before any mask: a token outside the grammar is
                # no candidate (the only enforcement where the allowed set was too large to send).
                if allowed is not None and token_id not in allowed:
                    continue
                new = BeamSearchSequence(beam.orig_prompt, tokens=beam.tokens + [token_id],
                                         logprobs=beam.logprobs + [logprobs],
                                         cum_logprob=beam.cum_logprob + lp.logprob)
                if token_id == eos_token_id and not ignore_eos:
                    instance.completed.append(new)
                else:
                    candidates.append(new)
        instance.beams = top_by_cum_logprob(candidates, beam_width)
    return False

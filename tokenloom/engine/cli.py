"""`tokenloom generate` and `tokenloom chat`: the default model from the command line."""

from __future__ import annotations

import argparse
import sys

from tokenloom.engine.args import add_engine_args


def register(sub: argparse._SubParsersAction) -> None:
    g = sub.add_parser("generate", help="complete prompts with a model (offline, batched by the scheduler)")
    add_engine_args(g, with_model=False)
    g.add_argument("prompts", nargs="+", help="one or more prompts")
    g.add_argument("--model", default=None, help="a .gguf file or HF directory (default: SmolLM2-135M-Instruct)")
    _add_sampling_args(g)
    g.add_argument("--chat-template", action="store_true", help="wrap each prompt as a user message")
    g.set_defaults(func=_generate)

    c = sub.add_parser("chat", help="talk to a model in the terminal (the model's own chat template)")
    add_engine_args(c, with_model=False)
    c.add_argument("--model", default=None)
    c.add_argument("--system", default=None, help="system prompt")
    _add_sampling_args(c, max_tokens=256)
    c.set_defaults(func=_chat)


def _add_sampling_args(p: argparse.ArgumentParser, max_tokens: int = 64) -> None:
    s = p.add_argument_group("sampling")
    s.add_argument("--max-tokens", type=int, default=max_tokens)
    s.add_argument("--temperature", type=float, default=0.0)
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--top-k", type=int, default=0)
    s.add_argument("--min-p", type=float, default=0.0)
    s.add_argument("--repetition-penalty", type=float, default=1.0)
    s.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    s.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    s.add_argument("--ignore-eos", action="store_true")


def _sampling(args: argparse.Namespace):
    from tokenloom.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        min_p=args.min_p, repetition_penalty=args.repetition_penalty, seed=args.sampling_seed, stop=args.stop,
        ignore_eos=args.ignore_eos,
    )


def _make_llm(args: argparse.Namespace):
    from tokenloom.engine.args import engine_kwargs_from_args
    from tokenloom.engine.llm import LLM

    return LLM(args.model, **engine_kwargs_from_args(args))


def _generate(args: argparse.Namespace) -> int:
    params = _sampling(args)
    llm = _make_llm(args)
    if args.chat_template:
        outs = llm.chat([[{"role": "user", "content": p}] for p in args.prompts], params, use_tqdm=False)
    else:
        outs = llm.generate(args.prompts, params, use_tqdm=False)
    for out in outs:
        comp = out.outputs[0]
        m = out.metrics
        print(f"--- {out.prompt or out.request_id!r}")
        print(comp.text)
        print(f"[{len(comp.token_ids)} tokens, finish={comp.finish_reason}, ttft={m.time_to_first_token:.3f}s, "
              f"e2e={m.e2e_latency:.3f}s]", file=sys.stderr)
    return 0


# What ends `tokenloom chat` (compared lower-cased, surrounding spaces ignored); so do Ctrl-D and Ctrl-C.
EXIT_WORDS = ("/exit", "/quit", "/bye", "exit", "quit", ":q")
CHAT_BANNER = ("tokenloom chat with {model}: type a message and press Enter. To leave: /exit (or /quit, /bye, "
               "exit, quit, :q), Ctrl-D or Ctrl-C.")


def _chat(args: argparse.Namespace) -> int:
    params = _sampling(args)
    llm = _make_llm(args)
    engine = llm.llm_engine
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    print(CHAT_BANNER.format(model=engine.model_name), file=sys.stderr)
    return chat_loop(engine, params, messages)


def chat_loop(engine, params, messages: list[dict[str, str]], read=input) -> int:
    """Read a line, answer it, until an exit word, EOF (Ctrl-D) or Ctrl-C; an empty line is not sent.
    Ctrl-C during an answer ends the chat too (after the partial answer): a step cut in the middle is not
    one to go on from."""
    while True:
        try:
            line = read("you> ").strip()
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)  # leave the terminal on a fresh line
            return 0
        if not line:
            continue
        if line.lower() in EXIT_WORDS:
            return 0
        messages.append({"role": "user", "content": line})
        ids = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        rid = engine.add_request(None, {"prompt_token_ids": ids}, params)
        reply = ""
        print("model> ", end="", flush=True)
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.request_id == rid:
                        delta = out.outputs[0].delta_text
                        reply += delta
                        print(delta, end="", flush=True)
        except KeyboardInterrupt:
            print(" [interrupted]")
            return 0
        print()
        messages.append({"role": "assistant", "content": reply})

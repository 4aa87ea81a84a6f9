"""POST /tokenize and /detokenize, with vLLM's request and response shapes."""

from __future__ import annotations

import json

from fastapi import Request

from tokenloom.server.body import parse_model, read_json
from tokenloom.server.errors import APIError
from tokenloom.server.params import check_request_chat_template, render_chat
from tokenloom.server.protocol import DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest
from tokenloom.server.responses import JSONResponse
from tokenloom.server.state import get_state


async def tokenize(raw: Request) -> JSONResponse:
    state = get_state(raw)
    obj = await read_json(raw, state.config.max_request_body_bytes)
    tok = state.tokenizer
    if "messages" in obj:
        chat = parse_model(TokenizeChatRequest, obj)
        state.model_name(chat.model)
        check_request_chat_template(chat, state.config.trust_request_chat_template)
        ids = await state.in_tokenizer_thread(
            render_chat, tok, chat.messages, chat.add_generation_prompt, chat.continue_final_message,
            chat.chat_template_kwargs, chat.add_special_tokens, chat.chat_template,
        )
        want_strs = chat.return_token_strs
    else:
        req = parse_model(TokenizeCompletionRequest, obj)
        state.model_name(req.model)
        ids = await state.in_tokenizer_thread(tok.encode, req.prompt, req.add_special_tokens)
        want_strs = req.return_token_strs
    strs = await state.in_tokenizer_thread(tok.convert_ids_to_tokens, ids) if want_strs else None
    return JSONResponse({"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids, "token_strs": strs})


async def detokenize(raw: Request) -> JSONResponse:
    state = get_state(raw)
    req = parse_model(DetokenizeRequest, await read_json(raw, state.config.max_request_body_bytes))
    state.model_name(req.model)
    vocab = state.tokenizer.vocab_size
    bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise APIError(400, f"token id {bad} is out of vocabulary (size {vocab})", "tokens")
    text = await state.in_tokenizer_thread(state.tokenizer.decode, req.tokens)
    return JSONResponse({"prompt": text})


async def tokenizer_info(raw: Request) -> JSONResponse:
    """vLLM's GET /tokenizer_info (only with --enable-tokenizer-info-endpoint: it shows the chat template)."""
    state = get_state(raw)
    if not state.config.enable_tokenizer_info_endpoint:
        raise APIError(404, "Not Found (start the server with --enable-tokenizer-info-endpoint)")
    hf = state.tokenizer.hf
    config = {k: v for k, v in (getattr(hf, "init_kwargs", None) or {}).items()
              if k not in ("vocab_file", "merges_file", "tokenizer_file", "name_or_path")}
    config = json.loads(json.dumps(config, default=str))  # special-token objects → their text
    config["tokenizer_class"] = type(hf).__name__
    if state.tokenizer.chat_template:
        config["chat_template"] = state.tokenizer.chat_template
    return JSONResponse(config)

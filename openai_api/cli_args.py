"""The HTTP API's command-line flags, one definition for pagedgen-engine and pagedgen-router."""

from __future__ import annotations

import argparse

from openai_api.auth import API_KEY_ENV, api_key_from
from openai_api.reasoning_parsers import PARSERS as REASONING_PARSERS
from openai_api.tool_parsers import PARSERS


def add_http_args(p: argparse.ArgumentParser, routed: bool) -> None:
    """--http-port, --http-host, --api-key; `routed`: the router's help says requests are
    routed as gRPC ones are."""
    how = ", routed as gRPC requests are" if routed else ""
    p.add_argument("--http-port", type=int, default=0,
                   help="port of the OpenAI-compatible HTTP API (/v1/completions, "
                        f"/v1/chat/completions, /v1/models, /health, ...){how}; 0 = off")
    p.add_argument("--http-host", default=None,
                   help="address the HTTP API binds (default: --host)")
    p.add_argument("--api-key", default=None,
                   help=f"one API key for every gRPC and HTTP call but health and "
                        f"reflection (authorization: Bearer KEY), the shorthand of a key file "
                        f"of one tenant allowed everything (default: ${API_KEY_ENV}; unset: "
                        f"no key needed)")
    p.add_argument("--tool-call-parser", choices=PARSERS, default=None,
                   help="how chat's tool_choice \"auto\" (the default with tools) reads tool "
                        "calls out of the model's text, by its format: hermes (<tool_call> "
                        "JSON </tool_call>: Qwen2.5, Qwen3, Hermes), llama3_json (Llama "
                        "3.1/3.2), mistral ([TOOL_CALLS]: Mistral's) or pythonic ([f(x=1)]: "
                        "Llama 3.2/4); default: none, and \"auto\" with tools is a 400 "
                        "(\"required\" and a named function need no parser)")
    p.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default=None,
                   help="how chat replies' thinking is told from the answer, by the model's "
                        "format: qwen3 (Qwen3's <think> ... </think>, which the model opens) "
                        "or deepseek_r1 (DeepSeek-R1 and distills, QwQ, Qwen3 Thinking-2507: "
                        "the template opens it); the thinking goes to the message's "
                        "reasoning_content (and reasoning); default: none, all is content")


def resolve_http_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Checks the flags (p.error on a bad one) and fills in --http-host and the API key."""
    if not 0 <= args.http_port <= 65535:
        p.error(f"--http-port must be in [0, 65535] (0 = off), got {args.http_port}")
    args.http_host = args.host if args.http_host is None else args.http_host
    try:
        args.api_key = api_key_from(args.api_key)
    except ValueError as error:
        p.error(str(error))

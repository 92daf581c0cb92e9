"""The commands that read a prompt with a trained model: `generate`, `explain`, `experts` (a whole text),
`serve`.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from ..base.fields import arguments_of
from .common import check_text, load_model, model_for_prompt


def cmd_generate(args: argparse.Namespace) -> None:
    from ..engine.generation import Sampling, generate, stream

    check_text(args.prompt)
    # the flags are Sampling's fields, and Sampling checks them: the same limits as the API's and Python's
    values = arguments_of(args, Sampling)
    sampling = Sampling(**{**values, "temperature": 0.0 if args.greedy else values["temperature"]})
    model, tokenizer = model_for_prompt(args)
    options = dict(max_new_tokens=args.max_new_tokens, sampling=sampling, slide=not args.no_slide,
                   compile=args.compile)
    tokenizer.encode(args.prompt)  # unknown characters fail here, before any output
    if args.stream:
        print(args.prompt, end="", flush=True)
        for piece in stream(model, tokenizer, args.prompt, **options):
            print(piece, end="", flush=True)
        print()
    else:
        print(args.prompt + generate(model, tokenizer, args.prompt, **options))


def cmd_explain(args: argparse.Namespace) -> None:
    from ..explain import show, show_generation, show_norms, trace, trace_generation
    from ..explain.page import check_page_target, write_page

    check_text(args.prompt)
    if args.html:
        check_page_target(Path(args.html), args.force)
    model, tokenizer = model_for_prompt(args)
    if args.untrained:  # the same shape as initialised, before any step: what training moved away from
        import torch

        from ..ops import build_model

        torch.manual_seed(args.seed)
        model = build_model(model.cfg).to(next(model.parameters()).dtype)
    t = trace(model, tokenizer, args.prompt, mode=args.mode, seed=args.seed)
    if args.norms:
        show_norms(t)
        return
    # generation is traced before anything is printed: a request too long for the context is one line alone
    steps = trace_generation(model, tokenizer, args.prompt, args.generate) if args.generate else None
    show(t, modules=args.trace)
    if steps is not None:
        print()
        show_generation(steps)
    if args.html:
        write_page(t, Path(args.html), f"nanollama4 explain: {args.prompt!r}")
        print(f"page: {args.html}")


def cmd_experts(args: argparse.Namespace) -> None:
    from ..reports.experts import experts, training_routing
    from ..reports.expertspage import check_experts_page_target, write_experts_page
    from ..reports.expertsview import check_json_target, check_outputs_apart, show_experts, write_json
    from ..reports.routes import model_and_text

    if args.json and args.html:
        check_outputs_apart(Path(args.json), Path(args.html))
    if args.json:
        check_json_target(Path(args.json))
    if args.html:
        check_experts_page_target(Path(args.html))
    model, tokenizer, ids, source = model_and_text(args.path, args.data, args.tokens)
    report = experts(model, tokenizer, ids, batch=args.batch, quiet=args.quiet, untrained=args.untrained_null,
                     geometry=args.geometry_null)
    report.source = f"{args.path}; {source}"
    report.training = training_routing(args.path)
    print(f"text: {source}")
    show_experts(report)
    if args.json:
        write_json(report, Path(args.json))
        print(f"json: {args.json}")
    if args.html:
        write_experts_page(report, Path(args.html), f"nanollama4 experts: {args.path}")
        print(f"page: {args.html}")


def cmd_serve(args: argparse.Namespace) -> None:
    import torch

    from ..serve.chat import chat_format_of
    from ..serve.server import serve

    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 2) - 1))
    model, tokenizer = load_model(args)
    chat = chat_format_of(args.path, tokenizer)
    name = args.name or Path(args.path).resolve().name
    serve(model, tokenizer, name, host=args.host, port=args.port, max_batch=args.max_batch,
          max_queue=args.max_queue, announce=lambda line: print(line, flush=True),
          allowed_hosts=args.allowed_host, allow_origins=args.allow_origin, max_context=args.max_context, chat=chat,
          stream_interval=None if args.stream_interval is None else args.stream_interval / 1000)


"""`export`: a run to transformers' layout or to llama.cpp's GGUF, and the two changes it can measure
before making them (--drop-bias, --approximate).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..base.errors import ConfigError
from .common import token_bar


def cmd_export(args: argparse.Namespace) -> None:
    from ..interop.checkpoint import load_run
    from ..interop.hf import check_export_target, export_hf, padding_note

    out = Path(args.out)
    if args.format == "gguf":
        return _export_gguf(args, out)
    if args.outtype != "f32":
        raise ConfigError("--outtype is for --format gguf; a transformers export holds the run's float32 weights")
    if args.approximate:
        raise ConfigError("--approximate is for --format gguf (llama.cpp fixes its chunk and temperature); a "
                          "transformers export reads them from config.json: export without it")
    check_export_target(out)  # before the model is read
    if args.drop_bias:
        model, tokenizer = _without_bias(args)
    else:
        model, tokenizer, _ = load_run(args.run_dir, prefer=args.checkpoint)
    eos, notes = tokenizer.eos_id, []
    export_hf(model, out, tokenizer.save_hf, drop_bias=args.drop_bias, bos_token_id=eos, eos_token_id=eos,
              notes=notes)
    print(f"exported {args.run_dir} ({args.checkpoint} checkpoint) to {out}: config.json, model.safetensors, "
          f"generation_config.json, tokenizer.json{', tokenizer_config.json' if eos is not None else ''}")
    if eos is None:
        print("note: this run's tokenizer has no end-of-text token (it was trained before nanollama4 had one): the "
              "export declares no EOS, so transformers' generate stops on length only")
    if padding_note(model.cfg):
        print(padding_note(model.cfg))
    for note in notes:
        print(f"note: {note}")


def _export_gguf(args: argparse.Namespace, out: Path) -> None:
    from ..interop.checkpoint import load_run
    from ..interop.llamacpp import GGUF_TYPES, export_gguf

    if out.is_symlink() or out.exists():  # before the model is read
        raise ConfigError(f"{out} exists; export the GGUF to a new file name")
    if args.outtype not in GGUF_TYPES:
        raise ConfigError(f"unknown --outtype {args.outtype!r}; choose one of {', '.join(GGUF_TYPES)}")
    if args.approximate:
        model, tokenizer = _nearest_llamacpp(args)
    elif args.drop_bias:
        model, tokenizer = _without_bias(args)
    else:
        model, tokenizer, _ = load_run(args.run_dir, prefer=args.checkpoint)
    notes = export_gguf(model, tokenizer, out, name=Path(args.run_dir).name, weights=args.outtype)
    kind = "float32" if args.outtype == "f32" else f"its matrices in {args.outtype.upper()}"
    print(f"exported {args.run_dir} ({args.checkpoint} checkpoint) to {out}: llama.cpp's llama4, {kind}, "
          f"{out.stat().st_size / 2**20:.1f} MiB")
    for note in notes:
        print(f"note: {note}")


DROP_BIAS_TOKENS = 2**18  # validation tokens `export --drop-bias` measures the change on (at most)

def _nearest_llamacpp(args: argparse.Namespace):
    """The model llama.cpp computes from the run's weights (`llamacpp.nearest_llamacpp`: its chunk and NoPE
    temperature, and no balancing bias), after measuring what the changes do to the validation loss: the
    user decides with the number, as with --drop-bias."""
    import torch

    from ..interop.llamacpp import nearest_llamacpp
    from ..ops import build_model
    from ..training.evaluation import validation_of_run

    run = validation_of_run(args.run_dir, prefer=args.checkpoint, max_tokens=DROP_BIAS_TOKENS)
    cfg, changes = nearest_llamacpp(run.model.cfg)
    biased = any(moe.router.expert_bias.abs().max() > 0 for moe in run.model.moe_layers())
    if biased:
        changes.append("the routers' balancing biases are dropped (llama.cpp's Llama 4 has none)")
    if not changes:
        print("--approximate: llama.cpp computes this model as it is; nothing to change")
        return run.model.cpu(), run.tokenizer
    as_trained = run.loss(progress=token_bar("--approximate: the loss as trained"))
    nearest = build_model(cfg).to(run.device)
    nearest.load_state_dict(run.model.state_dict())
    with torch.no_grad():
        for moe in nearest.moe_layers():
            moe.router.expert_bias.zero_()
    run.model = nearest
    theirs = run.loss(progress=token_bar("--approximate: the loss as llama.cpp computes it"))
    print(f"--approximate: {'; '.join(changes)}. Validation loss {as_trained:.4f} as trained, {theirs:.4f} as "
          f"llama.cpp computes it ({theirs - as_trained:+.4f} nats/token over {len(run.tokens):,} validation tokens); "
          "exporting the model llama.cpp computes")
    return nearest.cpu(), run.tokenizer


def _without_bias(args: argparse.Namespace):
    """The run's model with its routers' balancing biases set to 0, after measuring what that does to the
    validation loss (the reference format has no such bias): the user decides with the number."""
    import torch

    from ..training.evaluation import validation_of_run

    run = validation_of_run(args.run_dir, prefer=args.checkpoint, max_tokens=DROP_BIAS_TOKENS)
    biases = [moe.router.expert_bias for moe in run.model.moe_layers()]
    if not any(b.abs().max() > 0 for b in biases):
        print("--drop-bias: this model's routers carry no balancing bias; nothing to drop")
        return run.model.cpu(), run.tokenizer
    with_bias = run.loss(progress=token_bar("--drop-bias: the loss with the biases"))
    with torch.no_grad():
        for b in biases:
            b.zero_()
    without = run.loss(progress=token_bar("--drop-bias: the loss without them"))
    print(f"--drop-bias: validation loss {with_bias:.4f} with the routers' balancing biases, {without:.4f} without "
          f"them ({without - with_bias:+.4f} nats/token over {len(run.tokens):,} validation tokens); exporting "
          "the model without them")
    return run.model.cpu(), run.tokenizer


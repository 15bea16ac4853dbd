"""The `kog` command line. Every user error ends in one line `error: ...` and exit status 2."""
from __future__ import annotations

import argparse
import json
import sys

from .errors import KogError


def _add_model_args(p: argparse.ArgumentParser, model_required: bool = False):
    p.add_argument("--model", "-m", help="preset name (see `kog models`) or checkpoint path")
    p.add_argument("--backend", "-b", help="backend plugin (default: the best available; see `kog plugins`)")
    p.add_argument("--config", "-c", help="TOML config file; flags override it")
    p.add_argument("--random-weights", action="store_true", default=None, help="random weights of the preset's shapes")
    p.add_argument("--context-length", type=int, help="KV cache length (default min(model, 8192))")
    p.add_argument("--ranks", type=int, help="ranks (lanes split across them)")


def _add_sampling_args(p: argparse.ArgumentParser):
    p.add_argument("--max-tokens", "-n", type=int, help="most tokens to generate (default 256)")
    p.add_argument("--temperature", "-t", type=float, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int)
    p.add_argument("--top-p", type=float)
    p.add_argument("--seed", type=int, help="sampling seed (default: random)")
    p.add_argument("--stop", action="append", help="stop string (repeatable)")


def _engine(args, progress=True):
    from .engine import Engine
    return Engine.load(model=args.model, backend=args.backend, config=args.config, random_weights=args.random_weights,
                       context_length=args.context_length, ranks=args.ranks, progress=progress)


def cmd_run(args):
    from .config import load_config
    prompt = args.prompt
    if prompt is None:
        if sys.stdin.isatty():
            raise KogError('no prompt given; pass it as an argument (kog run --model M "question") or on stdin')
        prompt = sys.stdin.read()
    if args.prompt_ids:
        try:
            prompt = [int(t) for t in args.prompt_ids.replace(",", " ").split()]
        except ValueError:
            raise KogError("--prompt-ids takes integers separated by commas or spaces")
    load_config(args.config, {"sampling": {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p,
                                           "seed": args.seed, "max_tokens": args.max_tokens}})  # validate early
    engine = _engine(args, progress=not args.json)
    kwargs = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                  seed=args.seed, stop=args.stop, chat=False if args.raw else None)
    result = None
    for chunk in engine.stream(prompt, **kwargs):
        if not args.json and chunk.text:
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
        result = chunk.result or result
    if args.json:
        print(json.dumps({"text": result.text, "token_ids": result.token_ids, "finish_reason": result.finish_reason,
                          **result.timings()}))
    else:
        sys.stdout.write("\n")
        if args.verbose:
            t = result.timings()
            print(f"[{t['prompt_tokens']} prompt tokens, {t['completion_tokens']} generated, TTFT {1e3 * t['ttft_s']:.1f} ms, "
                  f"decode {t['decode_tok_s']:.1f} tok/s, finish: {result.finish_reason}, backend {engine.backend.name}]",
                  file=sys.stderr)


def cmd_bench(args):
    from .bench import format_bench, run_bench
    from .config import load_config
    load_config(args.config, {"sampling": {"temperature": args.temperature, "top_k": args.top_k,
                                           "top_p": args.top_p}})  # validate early (one-line errors)
    engine = _engine(args, progress=False)
    print(format_bench(run_bench(engine, tokens=args.tokens, prompt_tokens=args.prompt_tokens,
                                 temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)))


def cmd_inspect(args):
    from .inspect_model import inspect_program
    prog = inspect_program(args.model, context_length=args.context_length)
    if args.json:
        print(prog.to_json())
    else:
        print(prog.format(kv_len=args.kv_len, weight_dtype=args.dtype, kv_dtype=args.dtype))


def cmd_plugins(args):
    from .plugins import load_registry
    reg = load_registry()
    for p in reg.plugins:
        status = f"  BROKEN: {p.error}" if p.error else ""
        print(f"{p.name} ({p.distribution} {p.version}, {p.module}){status}")
        for item in p.provides:
            print(f"    {item}")
    print("backends:")
    for name, spec in sorted(reg.backends.items()):
        reason = spec.probe() if spec.probe else None
        caps = spec.capabilities
        print(f"  {name:16s} {'available' if not reason else 'unavailable: ' + reason}; devices {','.join(caps.devices)}; "
              f"dtypes {','.join(sorted(caps.dtypes))}; lanes<={caps.max_lanes}; ranks<={caps.max_ranks}")


def cmd_models(args):
    from .plugins import load_registry
    reg = load_registry()
    for name, p in sorted(reg.presets.items()):
        print(f"{name:16s} {p.architecture:12s} {p.description}")


def cmd_pull(args):
    from .hub import pull
    from .plugins import load_registry
    reg = load_registry()
    if args.name not in reg.presets:
        raise KogError(f"unknown model {args.name!r}; known: {', '.join(sorted(reg.presets))}")
    print(pull(reg.presets[args.name]))


def cmd_config(args):
    from .config import read_toml, validate_dict
    if args.action == "validate":
        data = read_toml(args.file)
        _, problems = validate_dict(data, args.file)
        if problems:
            for line in problems:
                print(line, file=sys.stderr)
            raise SystemExit(2)
        print(f"{args.file}: ok")
    elif args.action == "show":
        from .config import load_config
        print(json.dumps(load_config(args.file).model_dump(), indent=2))


def cmd_serve(args):
    from .server.app import serve
    serve(args)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kog", description="kog: batch-1 LLM decode at the memory-bandwidth limit")
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("run", help="generate an answer to a prompt (streams it)")
    _add_model_args(p)
    _add_sampling_args(p)
    p.add_argument("prompt", nargs="?", help="the prompt (default: stdin)")
    p.add_argument("--prompt-ids", help="token ids instead of text, e.g. 1,2,3")
    p.add_argument("--raw", action="store_true", help="send the prompt as is (no chat template)")
    p.add_argument("--verbose", "-v", action="store_true", help="print timings to stderr")
    p.add_argument("--json", action="store_true", help="print one JSON object with text, token ids and timings")
    p.set_defaults(fn=cmd_run)

    p = sub.add_parser("bench", help="measure prefill/decode speed and MBU")
    _add_model_args(p)
    p.add_argument("--tokens", type=int, default=512, help="tokens to generate (default 512)")
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); above 0 measures sampled decoding")
    p.add_argument("--top-k", type=int, default=0, help="with --temperature: keep the k most likely tokens (0 = all)")
    p.add_argument("--top-p", type=float, default=1.0, help="with --temperature: nucleus mass (1 = all)")
    p.set_defaults(fn=cmd_bench)

    p = sub.add_parser("inspect", help="print a model's decode program and bytes per token")
    p.add_argument("model")
    p.add_argument("--context-length", type=int)
    p.add_argument("--kv-len", type=int, default=0, help="KV length for the byte count (default 0)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "f16", "f32"])
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_inspect)

    p = sub.add_parser("plugins", help="list plugins, their versions and what they register")
    p.set_defaults(fn=cmd_plugins)
    p = sub.add_parser("models", help="list model presets")
    p.set_defaults(fn=cmd_models)
    p = sub.add_parser("pull", help="download a preset's weights into the model cache")
    p.add_argument("name")
    p.set_defaults(fn=cmd_pull)

    p = sub.add_parser("config", help="check or show a config file")
    p.add_argument("action", choices=["validate", "show"])
    p.add_argument("file")
    p.set_defaults(fn=cmd_config)

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    _add_model_args(p)
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.add_argument("--api-key")
    p.add_argument("--served-model-name")
    p.set_defaults(fn=cmd_serve)
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.fn(args)
    except KogError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())

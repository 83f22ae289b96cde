"""The `tandem` command: `generate`, `chat` and `serve`.

argv is parsed here and only here. Completions go to stdout; logs and progress go to stderr.
"""

from __future__ import annotations

import argparse
import functools
import logging
import sys

from tandem.app.engine_args import HelpFormatter, add_engine_arguments, engine_config_from_args
from tandem.app.version import tandem_version


def _add_sampling_arguments(
    p: argparse.ArgumentParser, temperature: float, max_tokens: int
) -> None:
    p.add_argument("--max-tokens", type=int, default=max_tokens, help="tokens to generate")
    p.add_argument("--temperature", type=float, default=temperature, help="0: greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    p.add_argument("--top-k", type=int, default=0, help="0: no top-k cut")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: random)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description="Tandem LLM inference server")
    parser.add_argument("--version", action="version", version=f"tandem {tandem_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    sub_parser = functools.partial(sub.add_parser, formatter_class=HelpFormatter)

    gen = sub_parser("generate", help="complete prompts and print one completion per prompt")
    add_engine_arguments(gen)
    _add_sampling_arguments(gen, temperature=0.0, max_tokens=128)
    gen.add_argument("--chat", action="store_true", help="treat each prompt as a user message")
    gen.add_argument("--system", default=None, help="system message (with --chat)")
    gen.add_argument("prompts", nargs="+", metavar="PROMPT")

    chat = sub_parser("chat", help="interactive chat in the terminal, streaming tokens")
    add_engine_arguments(chat)
    _add_sampling_arguments(chat, temperature=0.7, max_tokens=512)
    chat.add_argument("--system", default=None, help="system message")

    serve = sub_parser("serve", help="serve the OpenAI-style HTTP/SSE/WebSocket API")
    from tandem.app.serve import add_serve_arguments

    add_serve_arguments(serve)
    return parser


def log_filter(verbose: bool):  # noqa: ANN201
    """Warnings always; INFO with -v, and without it only records flagged `progress` (the
    first-start compile, the server's ready line)."""

    def keep(record: logging.LogRecord) -> bool:
        return verbose or record.levelno >= logging.WARNING or getattr(record, "progress", False)

    return keep


def _setup_logging(verbose: bool) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    handler.addFilter(log_filter(verbose))
    logging.basicConfig(level=logging.INFO, handlers=[handler])


def _make_llm(args: argparse.Namespace):
    from tandem.runtime.llm import LLM

    return LLM(engine_config=engine_config_from_args(args))


def _sampling(args: argparse.Namespace):
    from tandem.runtime.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
    )


def cmd_generate(args: argparse.Namespace) -> int:
    params = _sampling(args)
    llm = _make_llm(args)
    if args.chat:
        system = [{"role": "system", "content": args.system}] if args.system else []
        convs = [system + [{"role": "user", "content": p}] for p in args.prompts]
        outs = llm.chat(convs, params)
    else:
        outs = llm.generate(args.prompts, params)
    for o in outs:
        sys.stdout.write(o.text + "\n")
    sys.stdout.flush()
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    params = _sampling(args)
    llm = _make_llm(args)
    history: list[dict] = [{"role": "system", "content": args.system}] if args.system else []
    interactive = sys.stdin.isatty()
    if interactive:
        print(
            "Tandem chat. /reset clears the conversation, /exit or Ctrl-D quits.", file=sys.stderr
        )

    def stream(delta) -> None:
        sys.stdout.write(delta.new_text)
        sys.stdout.flush()

    while True:
        try:
            if interactive:
                sys.stderr.write("\n> ")
                sys.stderr.flush()
            line = sys.stdin.readline()
        except KeyboardInterrupt:
            return 0
        if not line:
            return 0
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            return 0
        if text == "/reset":
            history = history[:1] if args.system else []
            continue
        history.append({"role": "user", "content": text})
        try:
            out = llm.chat(history, params, on_delta=stream)[0]
        except KeyboardInterrupt:
            sys.stdout.write("\n")
            history.pop()
            continue
        sys.stdout.write("\n")
        sys.stdout.flush()
        history.append({"role": "assistant", "content": out.text})


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "serve":
        from tandem.app.serve import resolve_model_argument

        try:
            resolve_model_argument(args)
        except ValueError as e:
            parser.error(str(e))
    _setup_logging(getattr(args, "verbose", False))
    try:
        if args.command == "generate":
            return cmd_generate(args)
        if args.command == "chat":
            return cmd_chat(args)
        from tandem.app.serve import run_server

        return run_server(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"tandem: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C before the server's own handler (loading the model)
        print("tandem: interrupted", file=sys.stderr)
        return 130
    except RuntimeError as e:
        from tandem.ext.cpu import CpuExtensionError  # loaded by now: the engine set-up imported it

        if not isinstance(e, CpuExtensionError):
            raise
        print(f"tandem: error: the CPU expert pool is unavailable: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

"""`specmesh` command line: serve, generate, client, bench."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from dataclasses import replace
from pathlib import Path

from services.common.config import (
    OPTIONS,
    PARSE,
    SERVER_OPTIONS,
    TOPOLOGY_OPTIONS,
    EngineConfig,
    Option,
    ServerConfig,
    Topology,
)
from services.common.security import TokenFile


def _flag_type(kind: str):
    """An argparse type that parses as the option table's ``kind`` does (its message names the problem)."""

    def parse(text: str):
        try:
            return PARSE[kind](text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    parse.__name__ = kind
    return parse


# The suffix cache's options of the table that `specmesh replay` takes (it runs no model).
REPLAY_OPTIONS = ("suffix_max_depth", "suffix_max_draft", "suffix_live_outputs", "suffix_lag_live")


def _add_options(
    ap: argparse.ArgumentParser,
    serve_only: bool,
    names: tuple[str, ...] | None = None,
    table: dict[str, Option] = OPTIONS,
) -> None:
    """Flags for an option table's options (``services/common/config.py``: the engine's,
    ``SERVER_OPTIONS`` or ``TOPOLOGY_OPTIONS``); ``names``: only those."""
    for opt in table.values():
        if opt.serve_only != serve_only or (names is not None and opt.name not in names):
            continue
        flags = [f"--{opt.name.replace('_', '-')}"] + ([opt.short] if opt.short else [])
        text = opt.help + (f" (env {opt.env})" if opt.env else "")
        if opt.kind == "bool":
            ap.add_argument(*flags, action=argparse.BooleanOptionalAction, default=opt.fallback(), help=text)
        elif opt.kind == "names":  # one name or several
            ap.add_argument(*flags, nargs="+", default=opt.fallback(), metavar="NAME", help=text)
        else:
            ap.add_argument(
                *flags,
                type=_flag_type(opt.kind),
                default=opt.fallback(),
                choices=opt.choices or None,
                help=text,
                metavar={"ngram": "MIN:MAX:K", "json": "JSON", "seconds": "SECONDS"}.get(opt.kind),
            )


def add_engine_args(ap: argparse.ArgumentParser) -> None:
    """The engine's flags (the option table's, as ``specmesh generate`` takes them) on a script's
    own parser; ``engine_config(args)`` turns the parsed flags into the engine's config."""
    _add_options(ap, serve_only=False)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine's configuration from the parsed flags, through the option table
    (``EngineConfig.from_mapping``, as the Ray app's args); exits naming a bad option."""
    from services.router.engine import METHODS

    values = {k: v for k, v in vars(args).items() if k in OPTIONS}
    try:
        cfg = EngineConfig.from_mapping(values, METHODS)
    except ValueError as e:
        sys.exit(f"error: {e}")
    if not (cfg.target / "config.json").exists():
        sys.exit(
            f"error: no model at {cfg.target} (no config.json): pass --target DIR, or --models-dir DIR / env "
            "SPECMESH_MODELS for a directory holding target/, draft/, eagle3/ and predictor/"
        )
    return cfg


def _trust(args: argparse.Namespace) -> None:
    """The CA a router trusts for its verifiers and internal services (``--tls-ca``, env
    SPECMESH_TLS_CA), checked at start: a router that serves TLS reaches its verifiers over TLS
    too, and cannot without it."""
    ca = args.tls_ca or (Path(os.environ["SPECMESH_TLS_CA"]) if os.environ.get("SPECMESH_TLS_CA") else None)
    if ca is not None:
        try:
            pem = ca.read_text()
        except (OSError, UnicodeDecodeError) as e:
            sys.exit(f"error: --tls-ca {ca}: cannot be read ({e.__class__.__name__})")
        if "-----BEGIN CERTIFICATE-----" not in pem:
            sys.exit(f"error: --tls-ca {ca}: holds no PEM certificate")
        os.environ["SPECMESH_TLS_CA"] = str(ca)
    elif args.tls_cert and (args.topology == "distributed" or args.role == "router"):
        sys.exit(
            "error: --tls-ca CA: a router serving TLS reaches its verifiers over TLS; give the CA that signed "
            "their certificates (env SPECMESH_TLS_CA)"
        )


def _auth_token(
    path: str | None, flag: str = "--auth-token-file", env: str = "SPECMESH_AUTH_TOKEN"
) -> str | TokenFile | None:
    """A bearer token: from its file, read again when it is rotated (``TokenFile``; a file that
    cannot be read or holds no token stops the server: it never serves open by mistake), else
    its environment variable."""
    if path is None:
        return os.environ.get(env) or None
    try:
        Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        sys.exit(
            f"error: {flag} {path}: cannot be read ({e.__class__.__name__}); the server would serve without authentication"
        )
    try:
        return TokenFile(path)
    except ValueError:
        sys.exit(f"error: {flag} {path}: holds no token; the server would serve without authentication")


def cmd_serve(args: argparse.Namespace) -> None:
    """embedded (default): everything in this process. distributed: verifier replicas as
    separate processes on loopback + the router here. --role runs one service alone
    (services/assembly.py builds each)."""
    from services.assembly import run
    from services.common.security import INTERNAL_TOKEN_ENV, internal_token
    from services.common.supervisor import StartFailed

    cfg = engine_config(args)
    token = _auth_token(args.auth_token_file)
    if args.internal_token_file:  # spawned verifiers and every internal channel read it from here
        os.environ[INTERNAL_TOKEN_ENV] = args.internal_token_file
    try:
        internal_token()
    except ValueError as e:
        sys.exit(f"error: {e}; internal services would run without authentication")
    scfg = replace(
        ServerConfig.from_mapping(vars(args)),
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        tls_client_ca=args.tls_client_ca,
        auth_token=token or None,
        admin_token=_auth_token(args.admin_token_file, "--admin-token-file", "SPECMESH_ADMIN_TOKEN"),
    )
    if args.tls_cert:  # component servers read their TLS settings from the environment
        os.environ.setdefault("SPECMESH_TLS_CERT", str(args.tls_cert))
        os.environ.setdefault("SPECMESH_TLS_KEY", str(args.tls_key))
        if args.tls_client_ca:
            os.environ.setdefault("SPECMESH_TLS_CLIENT_CA", str(args.tls_client_ca))
    _trust(args)
    topo = Topology.from_mapping(vars(args))
    options = {k: v for k, v in vars(args).items() if k in OPTIONS}
    try:
        run(cfg, topo, scfg, options)
    except (ValueError, StartFailed) as e:
        sys.exit(f"error: {e}")


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument(
        "--min-p", type=float, default=0.0, help="drop tokens less likely than this times the most likely one (0 = off)"
    )
    p.add_argument("--seed", type=int, default=None)


def _stop_args(p: argparse.ArgumentParser) -> None:
    """How generation ends, and what its text holds."""
    p.add_argument("--stop", action="append", help="end before this string (repeatable)")
    p.add_argument("--stop-token-id", type=int, action="append", help="end after this token (repeatable)")
    p.add_argument("--include-stop-str", action="store_true", help="keep the stop string in the output")
    p.add_argument(
        "--ignore-eos",
        action="store_true",
        help="generate --max-new-tokens tokens; the end-of-sequence token does not end the output",
    )
    p.add_argument("--min-tokens", type=int, default=0, help="no end-of-sequence token before this many tokens")
    p.add_argument(
        "--skip-special-tokens",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the tokenizer's special tokens add no text (--no-skip-special-tokens writes them)",
    )


def _penalty_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--repetition-penalty",
        type=float,
        default=1.0,
        help="divide the logits of tokens seen in the prompt or output by this (> 0; 1 = off)",
    )
    p.add_argument("--presence-penalty", type=float, default=0.0, help="[-2, 2]; 0 = off")
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="[-2, 2]; 0 = off")
    p.add_argument("--logit-bias", action="append", metavar="ID=BIAS", help="add BIAS to token ID's logit (repeatable)")
    p.add_argument("--allowed-token-id", type=int, action="append", help="generate only these tokens (repeatable)")
    p.add_argument("--bad-word", action="append", help="a word the output must not contain (repeatable)")


def _bias(args: argparse.Namespace) -> tuple[tuple[int, float], ...]:
    pairs = [b.split("=", 1) for b in args.logit_bias or ()]
    return tuple((int(i), float(v)) for i, v in pairs)


def _structured_args(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument("--json-schema", help="the output is a JSON instance of this schema (a JSON string, or @FILE)")
    g.add_argument("--regex", help="the output matches this regular expression as a whole")
    g.add_argument("--choice", action="append", help="the output is one of these strings (repeatable)")
    g.add_argument("--json-object", action="store_true", help="the output is a JSON object")


def _structured(args: argparse.Namespace) -> dict:
    """The structured-output fields the flags set: {} or one of json_schema / regex / choice."""
    schema = args.json_schema
    if schema and schema.startswith("@"):
        schema = Path(schema[1:]).read_text()
    found = {
        "json_schema": schema,
        "regex": args.regex,
        "choice": tuple(args.choice or ()),
        "json_object": args.json_object,
    }
    return {k: v for k, v in found.items() if v}


def cmd_generate(args: argparse.Namespace) -> None:
    from services.common.structured import StructuredOutput
    from services.common.types import Sampling
    from services.router.engine import Engine, GenerationRequest, InvalidRequest

    engine = Engine(engine_config(args))
    try:
        bad_words = engine.bad_word_ids(args.bad_word or ())
    except InvalidRequest as e:
        sys.exit(f"error: {e}")
    req = GenerationRequest(
        prompt_ids=engine.encode(args.prompt, add_special_tokens=True),
        max_new_tokens=args.max_new_tokens,
        sampling=Sampling(
            args.temperature,
            args.top_p,
            args.top_k,
            args.seed,
            args.repetition_penalty,
            args.presence_penalty,
            args.frequency_penalty,
            _bias(args),
            tuple(args.allowed_token_id or ()),
            bad_words,
            args.min_p,
        ),
        stop=tuple(args.stop or ()),
        stop_token_ids=tuple(args.stop_token_id or ()),
        include_stop_str_in_output=args.include_stop_str,
        method=args.method,
        logprobs=args.logprobs,
        prompt_logprobs=args.prompt_logprobs,
        structured=StructuredOutput(**_structured(args)) if _structured(args) else None,
        n=args.n,
        ignore_eos=args.ignore_eos,
        min_tokens=args.min_tokens,
        skip_special_tokens=args.skip_special_tokens,
    )
    try:
        completions = engine.generate_all(req)
    except InvalidRequest as e:
        sys.exit(f"error: {e}")
    if args.n > 1:  # completions stream interleaved: print each whole, in order
        for _ in completions:
            pass
        results = [g.result() for g in completions.gens]
        if args.json:
            print(json.dumps(results))
            return
        for i, r in enumerate(results):
            print(f"--- completion {i} [{r['finish_reason']}]\n{r['text']}")
        return
    gen = completions.gens[0]
    if args.json:
        print(json.dumps(gen.result()))
        return
    for step in gen:
        print(step.text, end="", flush=True)
    print(f"\n[{gen.finish_reason}] {gen.stats.to_dict()}", file=sys.stderr)


def cmd_run_batch(args: argparse.Namespace) -> None:
    """vLLM's run-batch: every line of an OpenAI batch file answered, in order, with progress
    on stderr; a bad line gets its own error line (services/router/batch_file.py)."""
    from services.router import openai_api as oa
    from services.router.batch_file import run_batch
    from services.router.engine import Engine

    if args.concurrency < 1 or args.max_sessions < 1:
        sys.exit(f"error: --concurrency and --max-sessions: must be >= 1, got {args.concurrency}, {args.max_sessions}")
    if args.input_file == "-":
        lines = [line for line in sys.stdin if line.strip()]
    else:
        with open(args.input_file, encoding="utf-8") as src:
            lines = [line for line in src if line.strip()]
    engine = Engine(engine_config(args))
    served = oa.served_names(tuple(args.served_model_name) or engine.cfg.target.name)
    template = args.chat_template.read_text() if args.chat_template else None
    outs = run_batch(engine, lines, served, template, args.concurrency, args.max_sessions)
    dst = sys.stdout if args.output_file == "-" else open(args.output_file, "w", encoding="utf-8")
    with dst:
        dst.writelines(json.dumps(out) + "\n" for out in outs)
    engine.close()


def cmd_client(args: argparse.Namespace) -> None:
    from services.common.refusals import Refusal
    from services.common.security import TLSConfig
    from services.router.client import GenerateClient, finish_name

    fields = dict(
        prompt=args.prompt,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        method=args.method,
        stop=args.stop or [],
        stop_token_ids=args.stop_token_id or [],
        include_stop_str_in_output=args.include_stop_str,
        cache_salt=args.cache_salt,
        priority=args.priority,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        n=args.n,
        logit_bias=dict(_bias(args)),
        allowed_token_ids=args.allowed_token_id or [],
        bad_words=args.bad_word or [],
        ignore_eos=args.ignore_eos,
        min_tokens=args.min_tokens,
        skip_special_tokens=args.skip_special_tokens,
        truncate_prompt_tokens=args.truncate_prompt_tokens,
        seed=args.seed,
    )
    token = args.token or os.environ.get("SPECMESH_AUTH_TOKEN")
    texts: dict[int, str] = {}
    with GenerateClient(args.addr, TLSConfig(args.tls_cert, args.tls_key, args.tls_ca), token) as client:
        try:
            for msg in client.generate(fields, _structured(args), timeout=args.timeout):
                if args.n > 1:  # completions arrive interleaved: each is printed whole when it ends
                    texts[msg.index] = texts.get(msg.index, "") + msg.text
                    if msg.finish_reason:
                        print(f"--- completion {msg.index}\n{texts[msg.index]}", end="", flush=True)
                else:
                    print(msg.text, end="", flush=True)
                if msg.finish_reason:
                    s, u = msg.stats, msg.usage
                    how = (  # a server started with --response-stats says how it decoded
                        f", {s.cycles} cycles, tau={s.tau:.2f}, acceptance={s.acceptance_rate:.2f}, "
                        f"{u.cached_prompt_tokens} of {u.prompt_tokens} prompt tokens cached"
                        if msg.HasField("stats")
                        else ""
                    )
                    print(f"\n[{finish_name(msg.finish_reason)}] {u.completion_tokens} tokens{how}", file=sys.stderr)
        except Refusal as e:
            sys.exit(f"\nerror: {e}")


def cmd_replay(args: argparse.Namespace) -> None:
    from services.drafter.base import DRAFTERS
    from services.drafter.replay import load_traces, replay

    if args.drafter != "suffix":
        sys.exit(f"error: --drafter {args.drafter!r}: replay supports the model-free drafter 'suffix'")
    values = {name: getattr(args, name) for name in REPLAY_OPTIONS}
    cfg = replace(EngineConfig.from_mapping(values).suffix, tree=args.tree)
    max_draft = cfg.spec.max_spec_tokens
    stats = replay(DRAFTERS["suffix"](cfg), load_traces(args.traces), max_draft, progress=True)
    report = {
        "drafter": args.drafter,
        "tree": args.tree,
        "traces": str(args.traces),
        "max_draft": max_draft,
        "max_depth": cfg.max_depth,
        **stats.report(),
    }
    print(json.dumps(report, indent=2))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


def _serve_parser(sub) -> None:
    """``specmesh serve``: engine, topology and role, transport security, limits, front ends."""
    p = sub.add_parser("serve", help="run the gRPC server (embedded all-in-one by default)")
    add_engine_args(p)
    _add_options(p, serve_only=False, table=TOPOLOGY_OPTIONS)
    _add_options(p, serve_only=True)
    p.add_argument("--tls-cert", type=Path, default=None, help="serve TLS: PEM certificate (with --tls-key)")
    p.add_argument("--tls-key", type=Path, default=None)
    p.add_argument("--tls-client-ca", type=Path, default=None, help="require client certificates from this CA (mTLS)")
    p.add_argument(
        "--tls-ca",
        type=Path,
        default=None,
        help="router: trust this CA for the verifier replicas and internal services it connects to (env "
        "SPECMESH_TLS_CA); required with --tls-cert in the distributed topology or as a router",
    )
    p.add_argument(
        "--auth-token-file",
        default=None,
        help="require `authorization: Bearer <token>` (token from this file, or env SPECMESH_AUTH_TOKEN)",
    )
    p.add_argument(
        "--admin-token-file",
        default=None,
        help="the admin endpoints (SGLang's /abort_request, /reset_prefix_cache, /flush_cache, gRPC Abort) "
        "take this token instead of the API's (file, or env SPECMESH_ADMIN_TOKEN); unset: the API token guards them",
    )
    p.add_argument(
        "--internal-token-file",
        default=None,
        help="a secret shared by the router and the internal services (verifier, drafter, predictor, memory): "
        "they require it as a bearer token and the router sends it (env SPECMESH_INTERNAL_TOKEN_FILE; "
        "an empty or unreadable file stops the server)",
    )
    _add_options(p, serve_only=False, table=SERVER_OPTIONS)
    p.set_defaults(func=cmd_serve)


def _generate_parser(sub) -> None:
    """``specmesh generate``: one request in-process."""
    p = sub.add_parser("generate", help="generate once in-process")
    add_engine_args(p)
    p.add_argument("--prompt", required=True)
    p.add_argument("--method", default="", help="speculative method (default: the engine's, as the server's)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    _sampling_args(p)
    _stop_args(p)
    _penalty_args(p)
    _structured_args(p)
    p.add_argument("-n", "--n", type=int, default=1, help="completions of the prompt (1-16; --json prints a list)")
    p.add_argument(
        "--logprobs",
        type=int,
        default=None,
        help="with --json: each token's target log-probability and this many alternatives (0-20)",
    )
    p.add_argument(
        "--prompt-logprobs",
        type=int,
        default=None,
        help="with --json: each prompt token's target log-probability and this many alternatives (0-20)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object with text, token_ids, stats")
    p.set_defaults(func=cmd_generate)


def _client_parser(sub) -> None:
    """``specmesh client``: one request to a running server over gRPC."""
    p = sub.add_parser("client", help="stream a completion from a running server")
    p.add_argument("--addr", default="127.0.0.1:50051")
    p.add_argument("--prompt", required=True)
    p.add_argument("--method", default="")
    p.add_argument("--max-new-tokens", type=int, default=128)
    _sampling_args(p)
    _stop_args(p)
    _penalty_args(p)
    _structured_args(p)
    p.add_argument("-n", "--n", type=int, default=1, help="completions of the prompt (1-16)")
    p.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    p.add_argument("--cache-salt", default="", help="share prefix-cache blocks only with requests of this salt")
    p.add_argument("--priority", type=int, default=0, help="admission order when the server is full: lower first")
    p.add_argument(
        "--truncate-prompt-tokens",
        type=int,
        default=None,
        help="keep only the prompt's last N tokens (-1: what fits the context)",
    )
    p.add_argument("--tls-ca", type=Path, default=None, help="connect with TLS, trusting this CA")
    p.add_argument("--tls-cert", type=Path, default=None, help="client certificate for mTLS (with --tls-key)")
    p.add_argument("--tls-key", type=Path, default=None)
    p.add_argument("--token", default=None, help="bearer token (or env SPECMESH_AUTH_TOKEN)")
    p.set_defaults(func=cmd_client)


def _tool_parsers(sub) -> None:
    """``specmesh replay`` and ``run-batch``: the offline tools. (Traces, calibration and benchmarks
    need the evaluation datasets: ``python -m training`` and ``python -m bench``, from a checkout.)"""
    p = sub.add_parser("replay", help="replay traces through a drafter without the target")
    p.add_argument("--drafter", default="suffix")
    p.add_argument("--traces", type=Path, required=True)
    _add_options(p, serve_only=False, names=REPLAY_OPTIONS)
    p.add_argument("--tree", action="store_true", help="draft speculation trees instead of paths")
    p.add_argument("--out", type=Path, default=None)
    p.set_defaults(func=cmd_replay)

    p = sub.add_parser("run-batch", help="answer an OpenAI batch file offline (vLLM's run-batch)")
    add_engine_args(p)
    p.add_argument(
        "-i",
        "--input-file",
        required=True,
        help="JSONL: one request per line ({custom_id, method, url, body}); - for standard input",
    )
    p.add_argument(
        "-o", "--output-file", required=True, help="JSONL: one answer per line, in input order; - for stdout"
    )
    p.add_argument(
        "--concurrency", type=int, default=8, help="requests decoding at once (their cycles verified together)"
    )
    p.add_argument(
        "--max-sessions",
        type=int,
        default=64,
        help="completions decoding at once over all requests (a request takes prompts × n); a request "
        "with more gets a 400",
    )
    _add_options(p, serve_only=False, names=("served_model_name", "chat_template"), table=SERVER_OPTIONS)
    p.set_defaults(func=cmd_run_batch)


def build_parser() -> argparse.ArgumentParser:
    """Every command and option (docs/configuration.md is generated from it)."""
    ap = argparse.ArgumentParser(prog="specmesh", description="Speculative-decoding LLM serving")
    sub = ap.add_subparsers(dest="cmd", required=True)
    _serve_parser(sub)
    _generate_parser(sub)
    _client_parser(sub)
    _tool_parsers(sub)
    return ap


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    from services.common.runtime import tune_gc

    tune_gc()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args.func(args)


if __name__ == "__main__":
    main()

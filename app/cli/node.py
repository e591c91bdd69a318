"""`tandem node`: run a prefill and/or decode node until interrupted."""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tandem.app.cli.args import MAX_PROMPT_HELP, add_model_arguments, model_path, size
from tandem.app.cli.errors import UsageError
from tandem.nodes.contract import http
from tandem.nodes.prefill.planning.ram import (
    DEFAULT_HOST_BUDGET,
    HOST_BUDGET_HELP,
    PREFIX_CACHE_HELP,
    host_budget_arg,
    prefix_cache_arg,
)

if TYPE_CHECKING:
    from tandem.nodes.model.verify import Verified
    from tandem.nodes.serve.node import NodeConfig

VERIFIED_CACHE = "verified-weights.json"  # in the user's cache dir: the model dir may be read-only


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("node", help="run a prefill and/or decode node")
    p.add_argument("--role", choices=["prefill", "decode", "both"], default="both")
    add_model_arguments(p)
    p.add_argument("--port", type=int, default=http.DEFAULT_PORT)
    p.add_argument("--host", default="127.0.0.1", help="non-loopback needs a token")
    p.add_argument("--budget", type=size, default=None, help="weights and activations")
    p.add_argument("--max-prompt-tokens", type=int, default=None, help=MAX_PROMPT_HELP)
    p.add_argument(
        "--host-budget", type=host_budget_arg, default=DEFAULT_HOST_BUDGET, help=HOST_BUDGET_HELP
    )
    p.add_argument("--prefix-cache", type=prefix_cache_arg, default="auto", help=PREFIX_CACHE_HELP)
    p.add_argument(
        "--max-batch-tokens", type=int, default=None,
        help="prefill: prompt tokens one weight pass serves in all (default: the longest "
        "prompt the activation reserve holds; elsewhere the context, up to 8192)",
    )  # fmt: skip
    p.add_argument("--chunk-tokens", type=int, default=http.DEFAULT_CHUNK_TOKENS)
    p.add_argument("--device", choices=["cuda", "mps", "cpu"], default=None)
    p.add_argument(
        "--devices", default=None, metavar="LIST",
        help="prefill on several devices at once, each its share of every layer "
        "(cuda:0,cuda:1; cpu,cpu): starts torchrun with a rank per device",
    )  # fmt: skip
    p.add_argument("--peer", action="append", default=[], metavar="URL")
    p.add_argument("--no-mdns", action="store_true")
    p.add_argument("--token-file", type=Path, default=None)
    p.add_argument(
        "--tls", action="store_true", help="serve HTTPS on loopback too (beyond it, always)"
    )
    p.add_argument("--remote-prefill", choices=["auto", "always", "never"], default="auto")
    p.add_argument(
        "--kv-bits", type=int, choices=[16, *http.KV_BITS], default=16,
        help="decode: KV on the wire and in the cache (16: the model's dtype)",
    )  # fmt: skip
    p.add_argument(
        "--kv-group-size", type=int, choices=list(http.KV_GROUP_SIZES),
        default=http.DEFAULT_KV_GROUP_SIZE,
    )  # fmt: skip
    p.add_argument("--name", default="")
    p.add_argument("--link-gbps", type=float, default=None, help="throttle host→device")
    p.add_argument("--net-gbps", type=float, default=None, help="cap KV bytes sent (Gbit/s)")
    p.add_argument(
        "--verify-weights", action="store_true",
        help="before serving, read every tensor: a sha256 each, no NaN/Inf (cached by size, mtime)",
    )  # fmt: skip
    _add_limits(p)
    p.set_defaults(func=run)


# queue and concurrency limits, and the remote-prefill timeout: (flag, type, default, help)
_LIMITS: tuple[tuple[str, type, float, str], ...] = (
    ("--queue-limit", int, http.DEFAULT_PREFILL_QUEUE, "prefills waiting, then 503"),
    ("--max-concurrent", int, http.DEFAULT_MAX_CONCURRENT, "decode: generations at once"),
    ("--max-queue", int, http.DEFAULT_MAX_QUEUE, "decode: generations waiting, then 503"),
    (
        "--remote-timeout", float, http.DEFAULT_REMOTE_TIMEOUT_S,
        "seconds before a remote prefill counts as failed and the decode node prefills locally",
    ),
    (
        "--stall-timeout", float, http.DEFAULT_STALL_TIMEOUT_S,
        "prefill: seconds a reader may take none of a KV frame before its stream is dropped "
        "(the next request goes on)",
    ),
)  # fmt: skip


def _add_limits(p: argparse.ArgumentParser) -> None:
    for flag, kind, default, help in _LIMITS:
        p.add_argument(flag, type=kind, default=default, help=help)


def node_config(a: argparse.Namespace) -> NodeConfig:
    """The node's configuration from parsed arguments."""
    from tandem.app.cli.pair import token_path
    from tandem.app.paths import config_dir
    from tandem.nodes.serve.node import NodeConfig, node_id_for
    from tandem.nodes.trust.auth import AuthError, load_token

    try:
        token = load_token(a.token_file, token_path())
    except AuthError as e:
        raise UsageError(str(e)) from None
    roles = ("prefill", "decode") if a.role == "both" else (a.role,)
    if a.max_batch_tokens is not None and a.max_batch_tokens < 1:
        raise UsageError("--max-batch-tokens must be at least 1")
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
        prefix_cache=a.prefix_cache,
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
        stall_timeout_s=a.stall_timeout,
        max_batch_tokens=a.max_batch_tokens,
        tls=a.tls,
        tls_dir=config_dir() / "nodes" / str(a.port),  # one identity per node, as its id
    )


def verify_model(model: Path) -> Verified:
    """Read and check every tensor of `model`, or only what changed since it last verified
    clean; a ModelError names the file and tensor that is not."""
    from tandem.app.paths import cache_dir
    from tandem.nodes.model.index import load_index
    from tandem.nodes.model.verify import verify_weights

    return verify_weights(load_index(model), cache_dir() / VERIFIED_CACHE)


def launched_rank() -> Any:
    """This process's place in a decode group `mlx.launch` started (`MLX_RANK`), or None."""
    if "MLX_RANK" not in os.environ:
        return None
    from tandem.nodes.decode.group.launch import launched

    return launched()


def follow_rank0(model: Path, group: Any) -> int:
    """A decode group's rank other than 0: its layers, and rank 0's orders until it stops."""
    from tandem.nodes.decode.group.launch import follow
    from tandem.nodes.decode.group.pipeline import GroupError
    from tandem.nodes.serve.node import keep_torch_out

    keep_torch_out()
    try:
        return follow(model, group)
    except GroupError as e:
        raise UsageError(str(e)) from None


def torchrun_rank() -> tuple[int, int, int] | None:
    """This process's (rank, ranks, local rank) where torchrun started it; None otherwise."""
    if "MLX_RANK" in os.environ or "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    from tandem.nodes.prefill.ranks.collective import world_from_env

    return world_from_env()


def start_ranks(devices: str, role: str) -> int:
    """`--devices cuda:0,cuda:1` (or cpu,cpu): this command again under torchrun, a rank per
    device (each sees its own card as cuda:LOCAL_RANK), in this process's place."""
    listed = [d.strip() for d in devices.split(",") if d.strip()]
    cuda = [d for d in listed if d.startswith("cuda:") and d[5:].isdigit()]
    if role != "prefill" or len(listed) < 2:
        raise UsageError("--devices takes two devices or more, for --role prefill")
    if (cuda and len(cuda) != len(listed)) or (not cuda and set(listed) != {"cpu"}):
        raise UsageError(f"--devices {devices}: list CUDA devices (cuda:0,cuda:1) or cpu,cpu")
    if len(set(cuda)) != len(cuda):
        raise UsageError(f"--devices {devices}: each card once (a rank per card)")
    if cuda:
        import torch

        have = torch.cuda.device_count()
        if max(int(d[5:]) for d in cuda) >= have:
            raise UsageError(f"--devices {devices}: this machine has {have} CUDA devices")
    argv, skip = [], False
    for arg in sys.argv[1:]:  # this command without --devices, on the ranks' --device
        if skip or arg.startswith("--devices="):
            skip = False
            continue
        skip = arg == "--devices"
        if not skip:
            argv.append(arg)
    env = dict(os.environ)
    if cuda:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(d[5:] for d in cuda)
    else:  # ranks on one machine: gloo over loopback
        env.setdefault("GLOO_SOCKET_IFNAME", "lo0" if sys.platform == "darwin" else "lo")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={len(listed)}", "-m", "tandem.app", *argv,
           "--device", "cuda" if cuda else "cpu"]  # fmt: skip
    os.execvpe(sys.executable, cmd, env)


def follow_prefill_rank(config: NodeConfig) -> int:
    """A prefill rank other than 0: its share of every layer, rank 0's passes until it stops."""
    from tandem.nodes.model.index import load_index
    from tandem.nodes.serve.prefill_side import follow_prefill

    return follow_prefill(load_index(config.model), config)


def run(a: argparse.Namespace) -> int:
    """Serve until interrupted; a port, token or model file problem is a UsageError, weights
    that fail `--verify-weights` a ModelError (before the port is taken)."""
    a.model = model_path(a.model, a.models_dir)  # an id: its directory, found offline
    ranks = torchrun_rank()
    if a.devices is not None and ranks is None:
        return start_ranks(a.devices, a.role)  # torchrun, in this process's place
    if ranks is not None:  # torchrun: one prefill node, a rank per device
        from tandem.nodes.serve.parent import die_with_parent

        die_with_parent()  # (torchrun's agent: its ranks go with it)
        if a.role != "prefill":
            raise UsageError("under torchrun a node is a prefill node of several devices: "
                             "use --role prefill")  # fmt: skip
        config = replace(node_config(a), ranks=ranks)
        if ranks[0] > 0:  # no port: rank 0's passes, on this rank's share, until it stops
            return follow_prefill_rank(config)
        return _serve(a, config)
    group = launched_rank()
    if group is not None and a.role != "decode":
        raise UsageError("under mlx.launch a node is a decode group: use --role decode")
    config = node_config(a)
    if group is not None:  # every rank proves the cluster's token to the others
        group = replace(group, token=config.token)
    if group is not None and group.rank > 0:  # no port: rank 0's orders, until it stops
        return follow_rank0(a.model, group)
    if group is not None:
        config = replace(config, group=group)
    return _serve(a, config)


def _serve(a: argparse.Namespace, config: NodeConfig) -> int:
    import asyncio

    from tandem.nodes.serve.node import ListenError, serve
    from tandem.nodes.trust.auth import AuthError

    if a.verify_weights:
        verify_model(a.model)
    try:
        asyncio.run(serve(config))
    except (AuthError, ListenError) as e:
        raise UsageError(str(e)) from None
    except OSError as e:  # a model file, the config dir: the message names it
        raise UsageError(f"{e.filename or ''}: {e.strerror or e}".lstrip(": ")) from None
    return 0

"""`tandem prefill`: a layer-streamed prefill of a token list into an mlx-lm prompt cache."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from tandem.app.cli.args import MAX_PROMPT_HELP, add_model_arguments, model_path, size
from tandem.app.cli.errors import UsageError
from tandem.nodes.contract import http
from tandem.nodes.contract.http import DEFAULT_CHUNK_TOKENS, KVFormat
from tandem.nodes.prefill.planning.ram import DEFAULT_HOST_BUDGET, HOST_BUDGET_HELP, host_budget_arg

log = logging.getLogger("tandem")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("prefill", help="layer-streamed prefill of a token list into a KV cache")
    add_model_arguments(p)
    p.add_argument("--tokens-file", type=Path, required=True, help="JSON list of token ids")
    p.add_argument("--out", type=Path, required=True, help="mlx-lm prompt cache .safetensors")
    p.add_argument("--budget", type=size, default=None, help="device memory, e.g. 512MiB")
    p.add_argument("--chunk-tokens", type=int, default=DEFAULT_CHUNK_TOKENS)
    p.add_argument("--max-prompt-tokens", type=int, default=None, help=MAX_PROMPT_HELP)
    p.add_argument("--device", choices=["cuda", "mps", "cpu"], default=None)
    p.add_argument("--link-gbps", type=float, default=None, help="throttle host→device (Gbit/s)")
    p.add_argument(
        "--host-budget", type=host_budget_arg, default=DEFAULT_HOST_BUDGET, help=HOST_BUDGET_HELP
    )
    p.add_argument(
        "--kv-bits", type=int, choices=[16, *http.KV_BITS], default=16,
        help="full-attention layers' caches quantized to this many bits (mlx-lm's "
        "QuantizedKVCache); 16: the model dtype",
    )  # fmt: skip
    p.add_argument(
        "--kv-group-size", type=int, choices=list(http.KV_GROUP_SIZES),
        default=http.DEFAULT_KV_GROUP_SIZE, help="values per quantization group (--kv-bits 8|4)",
    )  # fmt: skip
    p.add_argument(
        "--kv-kernel", choices=["cpu", "gpu"], default="cpu",
        help="whose mx.quantize rounding to match: the mlx device that reads the file",
    )  # fmt: skip
    p.add_argument("--stats-json", type=Path, default=None)
    p.set_defaults(func=run)


def read_tokens(path: Path) -> list[int]:
    """The JSON list of token ids in `path`, or a UsageError naming the file."""
    try:
        tokens = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise UsageError(f"{path}: cannot read a JSON token list ({e})") from None
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in tokens
    ):
        raise UsageError(f"{path}: expected a JSON list of integer token ids")
    return tokens


def _checked_tokens(a: argparse.Namespace, vocab: int) -> list[int]:
    """The prompt, checked against the model's vocabulary before the engine says anything."""
    tokens = read_tokens(a.tokens_file)
    if a.chunk_tokens < 1:
        raise UsageError("--chunk-tokens must be at least 1")
    if not tokens:
        raise UsageError(f"{a.tokens_file}: empty token list")
    if bad := [t for t in tokens if not 0 <= t < vocab]:
        raise UsageError(f"{a.tokens_file}: token id {bad[0]} outside the vocabulary [0, {vocab})")
    return tokens


def _kv_format(a: argparse.Namespace, head_dim: int) -> KVFormat | None:
    """The format full layers' caches are written in (--kv-bits), checked against the model."""
    if a.kv_bits == 16:
        return None
    try:
        http.check_group_size(a.kv_group_size, head_dim)
    except ValueError as e:
        raise UsageError(f"--kv-group-size: {e}") from None
    return KVFormat(a.kv_bits, a.kv_group_size, a.kv_kernel)


def run(a: argparse.Namespace) -> int:
    """Prefill, write the prompt cache and (with --stats-json) the engine's stats."""
    from tandem.nodes.model.spec import load_spec
    from tandem.nodes.prefill.cache_file import write_prompt_cache
    from tandem.nodes.prefill.engine import PrefillEngine
    from tandem.nodes.prefill.errors import PrefillError

    a.model = model_path(a.model, a.models_dir)  # an id: its directory, found offline
    spec = load_spec(a.model)
    tokens = _checked_tokens(a, spec.vocab_size)
    kv_format = _kv_format(a, spec.head_dim)
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
        layers = []
        for layer in engine.prefill(tokens, kv_format=kv_format):
            layers.append(layer)
            log.info("layer %d/%d done", layer.layer + 1, spec.num_layers)
        # what `mlx_lm.generate --prompt-cache-file` reads beside the caches
        about = {"model": str(a.model.resolve()), "tokenizer_config": "{}"}
        write_prompt_cache(a.out, layers, spec.layer_kinds, len(tokens), kv_format, about)
    except PrefillError as e:
        raise UsageError(str(e)) from None
    finally:
        engine.close()
    stats = engine.last_stats.to_json()
    if a.stats_json:
        a.stats_json.write_text(json.dumps(stats, indent=2) + "\n")
    log.info("prefill: %d tokens in %.3f s", stats["tokens"], stats["wall_s"])
    return 0

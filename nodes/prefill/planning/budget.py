"""What a prefill node's device budget holds: the activations of the longest prompt it takes,
then the weights (the plan). Used by the engine, the cost model and `tandem plan`.
"""

from __future__ import annotations

import os

import torch
from tandem.nodes.contract.http import DEFAULT_CHUNK_TOKENS
from tandem.nodes.model.index import ModelIndex
from tandem.nodes.model.safetensors_format import ITEMSIZE
from tandem.nodes.model.spec import ModelSpec
from tandem.nodes.prefill.families import PrefillFamily
from tandem.nodes.prefill.planning.activations import activation_bytes
from tandem.nodes.prefill.planning.plan import Plan, make_plan

DEFAULT_MAX_PROMPT_TOKENS = 8192  # CUDA: the longest prompt whose activations are reserved


def default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda")
    if torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def longest_prompt(spec: ModelSpec, device: str, asked: int | None = None) -> int | None:
    """The longest prompt a node takes, whose activations its budget reserves: `asked`, else
    on CUDA the model's context up to `DEFAULT_MAX_PROMPT_TOKENS`, else (host memory is the
    budget there) any: None, nothing reserved."""
    if asked is None and device == "cuda":
        return min(spec.max_position_embeddings, DEFAULT_MAX_PROMPT_TOKENS)
    return asked or None


def prompt_activations(
    spec: ModelSpec, count: int, start: int, chunk: int, itemsize: int, device: str,
    cut_ops: bool,
) -> int:  # fmt: skip
    """Device bytes of activations for `count` new tokens after `start` (0 for none), as
    blocks.py computes them on `device` (`blocks.fused_attention`: all queries at once)."""
    if count <= 0:
        return 0
    return activation_bytes(
        spec, count, start, chunk, itemsize, device_type=device, cut_ops=cut_ops
    )


def plan_for_prompts(
    index: ModelIndex, budget: int, tokens: int | None, device: str,
    chunk: int = DEFAULT_CHUNK_TOKENS, family: PrefillFamily | None = None,
) -> Plan:  # fmt: skip
    """The plan a node makes for `budget` bytes with room kept for the activations of a
    `tokens` prompt (none for None), its loads laid out for O_DIRECT reads (straight into the
    slot on a CPU, into pinned staging on CUDA). Planned first with what whole ops need; when
    the weights left must be cut into row ranges, again with room for the cut op's kept
    output too ([tokens, intermediate]: 470 MiB at 8k tokens for a 70B model)."""

    def plan(cut_ops: bool) -> Plan:
        itemsize = ITEMSIZE[index.dtype]
        reserve = prompt_activations(index.spec, tokens or 0, 0, chunk, itemsize, device, cut_ops)
        return make_plan(index, budget, direct=True, reserve=reserve, family=family)

    whole = plan(cut_ops=False)
    return plan(cut_ops=True) if whole.cuts_ops and whole.reserve_bytes else whole


def default_budget(
    index: ModelIndex, device: torch.device, reserve: int = 0, family: PrefillFamily | None = None
) -> int:
    """80% of free device memory, or what the whole model takes resident (its weights, a
    quantized model's scratch, and `reserve` bytes of activations) when that is smaller."""
    whole = make_plan(index, 1 << 62, direct=True, family=family).device_bytes + reserve
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
    else:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return min(int(free * 0.8), whole)


def exact_reductions(device: torch.device) -> None:
    """On CUDA, half-precision matmuls reduce in float32 as mlx's do: cuBLAS may otherwise
    round split-K partial sums to bf16/fp16 (torch's default allows it), which moves a bf16
    prompt's K/V further from mlx-lm's own than rounding alone does."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False


def indexed_device(device: torch.device) -> torch.device:
    """`cuda` as `cuda:N` (the current device): `torch.cuda.set_device` refuses a CUDA device
    without an index (torch 2.11), and the compute thread sets its own."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device

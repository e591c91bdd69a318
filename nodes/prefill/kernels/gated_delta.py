"""The gated delta rule (Gated DeltaNet's recurrence) in torch, as mlx-lm computes it.

Per value head, with state S [Dv, Dk], decay a_t = g_t and write strength beta_t:
    S_t = a_t S_{t-1} + beta_t (v_t - a_t S_{t-1} k_t) k_t^T,    y_t = S_t q_t.
`gated_delta_stepped` runs it token by token (mlx-lm's `_gated_delta_step_ops`);
`gated_delta_chunked` is the chunked parallel (WY / UT-transform) form for prefill.
Shapes: T = tokens, Hk/Hv = key/value heads (Hv a multiple of Hk: key head j // (Hv/Hk)
serves value head j), Dk/Dv = head dims, C = chunk, N = chunks. No batch dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def gated_delta_stepped(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor
) -> tuple[Tensor, Tensor]:
    """The recurrence one token at a time (the reference).

    q, k [T, Hk, Dk]; v [T, Hv, Dv]; g, beta [T, Hv]; state [Hv, Dv, Dk] float32.
    Returns y [T, Hv, Dv] in q's dtype and the new state (float32)."""
    q32, k32 = _per_value_head(q, k, v.shape[1])
    v32, g32, b32 = v.float(), g.float(), beta.float()
    s = state.float()
    ys = []
    for t in range(q.shape[0]):
        s = s * g32[t, :, None, None]
        kv_mem = (s * k32[t, :, None, :]).sum(-1)  # [Hv, Dv]
        delta = (v32[t] - kv_mem) * b32[t, :, None]  # [Hv, Dv]
        s = s + k32[t, :, None, :] * delta[..., None]
        ys.append((s * q32[t, :, None, :]).sum(-1))  # [Hv, Dv]
    if not ys:
        return v.new_empty(0, v.shape[1], v.shape[2], dtype=q.dtype), s
    return torch.stack(ys).to(q.dtype), s


def gated_delta_chunked(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor, chunk: int = 64
) -> tuple[Tensor, Tensor]:
    """The recurrence in chunks of `chunk` tokens; same arguments and results as
    `gated_delta_stepped` up to float rounding. Works in float32; the intra-chunk
    matrices are [N, Hv, C, C], so callers bound T (the mixer passes token blocks).

    Within a chunk starting from S0, with gamma_t the decay from the chunk's start and
    u_s = beta_s (v_s - a_s S_{s-1} k_s) (the pseudo-values):
        S_t = gamma_t S0 + sum_{s<=t} (gamma_t/gamma_s) u_s k_s^T
        (I + diag(beta) tril_{-1}(D * K K^T)) U = diag(beta) (V - diag(gamma) K S0^T)
        Y = diag(gamma) Q S0^T + tril_0(D * Q K^T) U,      D[t, s] = gamma_t / gamma_s.
    The unit-lower-triangular solve splits U = U0 - W S0^T (U0 and W need no state), so
    every chunk's solve runs at once and only small matmuls carry the state along."""
    T, Hv, Dv = v.shape
    if T == 0:
        return v.new_empty(0, Hv, Dv, dtype=q.dtype), state.float()
    q32, k32 = _per_value_head(q, k, Hv)
    n = -(-T // chunk)
    pad = n * chunk - T
    # padding tokens (g = 1, beta = 0, k = v = q = 0) leave the state as it is
    qc, kc, vc = (_chunks(x, n, chunk, pad) for x in (q32, k32, v.float()))  # [N, Hv, C, D]
    log_g = _chunks(g.float().log()[..., None], n, chunk, pad)[..., 0]  # [N, Hv, C]
    bc = _chunks(beta.float()[..., None], n, chunk, pad)[..., 0]  # [N, Hv, C]
    decay = _segsum(log_g).exp()  # [N, Hv, C, C]: gamma_t / gamma_s for s <= t, else 0
    gamma = log_g.cumsum(-1).exp()  # [N, Hv, C]: decay from the chunk's start to t
    to_end = decay[..., -1, :]  # [N, Hv, C]: decay from s to the chunk's end
    strict = (decay * (kc @ kc.transpose(-1, -2))).tril(-1)
    eye = torch.eye(chunk, dtype=strict.dtype, device=strict.device)
    lower = eye + bc[..., None] * strict
    rhs = torch.cat([bc[..., None] * vc, (bc * gamma)[..., None] * kc], dim=-1)
    solved = torch.linalg.solve_triangular(lower, rhs, upper=False, unitriangular=True)
    u0, w = solved[..., :Dv], solved[..., Dv:]  # [N, Hv, C, Dv], [N, Hv, C, Dk]
    attn = decay * (qc @ kc.transpose(-1, -2))  # [N, Hv, C, C], zero above the diagonal
    k_end = to_end[..., None] * kc  # [N, Hv, C, Dk]
    s = state.float()
    ys = []
    for i in range(n):
        s_t = s.transpose(-1, -2)  # [Hv, Dk, Dv]
        u = u0[i] - w[i] @ s_t  # [Hv, C, Dv]
        ys.append(gamma[i][..., None] * (qc[i] @ s_t) + attn[i] @ u)
        s = gamma[i, :, -1, None, None] * s + u.transpose(-1, -2) @ k_end[i]
    y = torch.stack(ys).permute(0, 2, 1, 3).reshape(n * chunk, Hv, Dv)[:T]
    return y.to(q.dtype), s


def _per_value_head(q: Tensor, k: Tensor, hv: int) -> tuple[Tensor, Tensor]:
    """q, k [T, Hk, Dk] -> float32 [T, Hv, Dk], key head j // r serving value head j."""
    r = hv // q.shape[1]
    return q.float().repeat_interleave(r, dim=1), k.float().repeat_interleave(r, dim=1)


def _chunks(x: Tensor, n: int, chunk: int, pad: int) -> Tensor:
    """[T, H, D] -> [N, H, C, D], zero-padded at the end."""
    x = F.pad(x, (0, 0, 0, 0, 0, pad))
    return x.view(n, chunk, x.shape[1], x.shape[2]).transpose(1, 2)


def _segsum(log_g: Tensor) -> Tensor:
    """[..., C] -> [..., C, C]: out[t, s] = sum of log_g over (s, t] for s <= t, -inf above.
    Each entry sums only its own terms (no difference of cumsums), so it stays exact and a
    zero gate (log = -inf) gives no NaN."""
    c = log_g.shape[-1]
    x = log_g[..., :, None].expand(*log_g.shape, c)  # x[t, s] = log_g[t]
    below = torch.ones(c, c, dtype=torch.bool, device=log_g.device).tril(-1)
    seg = x.masked_fill(~below, 0).cumsum(-2)
    return seg.masked_fill(below.T, float("-inf"))

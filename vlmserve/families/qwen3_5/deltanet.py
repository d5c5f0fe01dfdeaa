"""The arithmetic of a Gated DeltaNet layer, as pure functions over one sequence or a batch of
single-token steps. The recurrent state S [heads, key_dim, value_dim] is read by a query as
q @ S and updated by each token as

    S <- exp(g) * S;  S <- S + k (beta * (v - k @ S))^T

(decay, then a delta-rule write: only what S does not already predict for k is written). Prefill
runs the chunked form (the same sum, reorganised into matmuls over chunks of 64 tokens, exact in
real arithmetic); decode runs the recurrent form one token at a time, batched over sequences, and
so do a few tokens that continue a state (a verify step's k + 1: recurrent_rows). Both start from
a given state and return the final one, so a prompt may arrive in any chunks."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

CHUNK = 64


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def causal_conv1d(x: torch.Tensor, window: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv with SiLU over one sequence's new tokens.

    x [n, channels]; window [channels, kernel - 1]: the inputs before x (zeros at the start of a
    sequence); weight [channels, kernel]. Returns (out [n, channels], the new window)."""
    kernel = weight.shape[-1]
    assert window.shape == (x.shape[1], kernel - 1), "one window column per tap but the newest"
    full = torch.cat([window.to(weight.dtype), x.t().to(weight.dtype)], dim=-1)  # [channels, kernel - 1 + n]
    out = F.conv1d(full[None], weight[:, None, :], groups=weight.shape[0])[0]  # [channels, n]
    return F.silu(out).t().to(x.dtype), full[:, full.shape[1] - (kernel - 1) :]


def causal_conv1d_step(
    x: torch.Tensor, windows: torch.Tensor, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One new token for each of a batch of sequences: x [b, channels], windows [b, channels,
    kernel - 1] -> (out [b, channels], the new windows [b, channels, kernel - 1])."""
    full = torch.cat([windows.to(weight.dtype), x[..., None].to(weight.dtype)], dim=-1)  # [b, channels, kernel]
    out = F.conv1d(full, weight[:, None, :], groups=weight.shape[0])[..., 0]  # [b, channels]
    return F.silu(out).to(x.dtype), full[..., 1:]


def _prepare(q: torch.Tensor, k: torch.Tensor, num_v_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """L2-normalise q and k in float32, scale q by 1/sqrt(key_dim), and repeat each key head for
    the num_v_heads / num_k_heads value heads it serves (heads on dim -2)."""
    groups = num_v_heads // q.shape[-2]
    q = l2norm(q.float()).repeat_interleave(groups, dim=-2)
    k = l2norm(k.float()).repeat_interleave(groups, dim=-2)
    return q * q.shape[-1] ** -0.5, k


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's n tokens from `state`.

    q, k [n, num_k_heads, key_dim]; v [n, num_v_heads, value_dim]; g (log decay, <= 0) and beta
    [n, num_v_heads]; state [num_v_heads, key_dim, value_dim] float32.
    Returns (out [n, num_v_heads, value_dim] float32, the final state)."""
    n, heads = v.shape[0], v.shape[1]
    q, k = _prepare(q, k, heads)
    # -> [heads, n, dim], padded to whole chunks (zero k, v, beta and g leave the state as it is).
    pad = (-n) % CHUNK
    q, k, v = (F.pad(x.float().transpose(0, 1), (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x.float().t(), (0, pad)) for x in (g, beta))
    c = (n + pad) // CHUNK
    q, k, v = (x.reshape(heads, c, CHUNK, x.shape[-1]) for x in (q, k, v))  # [heads, chunks, CHUNK, dim]
    g, beta = g.reshape(heads, c, CHUNK), beta.reshape(heads, c, CHUNK)
    decay = g.cumsum(-1)  # [heads, chunks, CHUNK]: log of the decay from the chunk start through t
    causal = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).tril()
    # exp(decay_i - decay_j) for j <= i: the decay between token j's write and token i.
    between = (decay[..., :, None] - decay[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    # Within a chunk the delta writes solve a unit lower-triangular system (the UT transform):
    # (I + strictly_lower(k_beta k^T * between)) @ [u | w] = [v_beta | k_beta * exp(decay)]
    # (unitriangular: the solver reads only the strictly lower part and takes ones on the diagonal).
    system = (k_beta @ k.transpose(-1, -2)) * between
    rhs = torch.cat([v_beta, k_beta * decay.exp()[..., None]], dim=-1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    u, w = solved.split([v.shape[-1], k.shape[-1]], dim=-1)
    scores = (q @ k.transpose(-1, -2)) * between  # intra-chunk attention, causal
    q_decayed = q * decay.exp()[..., None]
    k_to_end = k * (decay[..., -1:] - decay).exp()[..., None]
    chunk_decay = decay[..., -1].exp()  # [heads, chunks]
    s = state.float()
    out = torch.empty_like(v)
    for i in range(c):
        # What the state does not already predict, then the chunk's reads and its write.
        new_v = u[:, i] - w[:, i] @ s
        out[:, i] = q_decayed[:, i] @ s + scores[:, i] @ new_v
        s = s * chunk_decay[:, i, None, None] + k_to_end[:, i].transpose(-1, -2) @ new_v
    return out.reshape(heads, -1, v.shape[-1])[:, :n].transpose(0, 1), s


def recurrent_gated_delta_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for each of b sequences: q, k [b, num_k_heads, key_dim]; v [b, num_v_heads,
    value_dim]; g, beta [b, num_v_heads]; state [b, num_v_heads, key_dim, value_dim] float32.
    Returns (out [b, num_v_heads, value_dim] float32, the new states)."""
    q, k = _prepare(q, k, v.shape[1])
    return _delta_step(q, k, v, g, beta, state)


def _delta_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """recurrent_gated_delta_step on q and k _prepare made (one value head each)."""
    v, g, beta = v.float(), g.float(), beta.float()
    s = state.float() * g.exp()[..., None, None]  # a new tensor: the caller's state is not written
    # NOTE: the reads of S as batched matrix-vector products and the write in place: S (1 MB a
    # sequence per layer for Qwen3.5-2B's 16 heads of 128 x 128) is read twice and written once
    # (the elementwise forms made a temporary of S's size for each; 4x slower with 8 sequences).
    predicted = (k[..., None, :] @ s).squeeze(-2)  # k @ S: [b, heads, value_dim]
    delta = (v - predicted) * beta[..., None]
    s.addcmul_(k[..., None], delta[..., None, :])
    return (q[..., None, :] @ s).squeeze(-2), s


# A sequence continuing its state with at most this many new tokens runs them in the recurrent
# form (recurrent_rows): a verify step's k + 1 tokens would otherwise be padded to a 64-token chunk.
MAX_RECURRENT_ROWS = 16


def recurrent_rows(
    mixed: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    weight: torch.Tensor,
    heads: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    windows: torch.Tensor,
    states: torch.Tensor,
    spans: list[tuple[int, int]],
    slots: list[int],
    out: torch.Tensor,
    keep: list[bool] | None = None,
) -> dict[int, list[torch.Tensor]]:
    """Sequences' new tokens in the recurrent form, position j of every sequence in one batched
    delta step: the arithmetic of as many single-token decode steps (causal_conv1d_step, then
    recurrent_gated_delta_step, the window stored in its pool's dtype between them), so a verify
    step's rows equal decoding its tokens one by one. The conv reads inputs, not the state, so it
    runs for every row at once (each row's window cut from its sequence's inputs, as the steps
    would have stored them), and so do the q/k normalisations (row by row); only the delta steps
    go position by position.

    mixed [num_tokens, conv_dim] (the conv's inputs); g, beta [num_tokens, num_v_heads]; weight
    [conv_dim, kernel]; heads: the conv's output -> q, k, v; windows, states: the pools [slots,
    ...], sequence i's read from slots[i] and its final ones written back there; spans: sequence
    i's rows [start, end) of the batch. Writes out [num_tokens, num_v_heads, value_dim] float32
    at the spans' rows. keep: per sequence, whether to return its states after each of its tokens
    -> {sequence i: [windows [n, conv_dim, kernel - 1], states [n, heads, key, value]]}."""
    index = torch.tensor(slots, dtype=torch.long, device=mixed.device)
    b, taps = len(spans), weight.shape[-1] - 1
    lengths = [end - start for start, end in spans]
    longest = max(lengths)
    # Each sequence's window, then its inputs as single steps store them (in the weight's dtype,
    # then the pool's), padded to the longest: [b, conv_dim, kernel - 1 + longest].
    full = torch.zeros(b, windows.shape[1], taps + longest, dtype=windows.dtype, device=mixed.device)
    full[..., :taps] = windows[index]
    for i, (start, end) in enumerate(spans):
        full[i, :, taps : taps + end - start] = mixed[start:end].t().to(weight.dtype)
    # Rows position-major: token j of every sequence that has one, for j = 0, 1, ...
    order = [(i, j) for j in range(longest) for i in range(b) if j < lengths[i]]
    rows = torch.tensor([spans[i][0] + j for i, j in order], device=mixed.device)
    seqs = torch.tensor([i for i, _ in order], device=mixed.device)
    positions = torch.tensor([j for _, j in order], device=mixed.device)
    row_windows = full.unfold(-1, taps, 1)[seqs, :, positions]  # [rows, conv_dim, kernel - 1]
    conv, _ = causal_conv1d_step(mixed[rows], row_windows, weight)
    q, k, v = heads(conv)
    q, k = _prepare(q, k, v.shape[1])
    g, beta = g[rows], beta[rows]
    state = states[index]  # [b, heads, key, value]
    kept = [i for i in range(b) if keep is not None and keep[i]]
    per_position = {i: state.new_empty(lengths[i], *state.shape[1:]) for i in kept}
    first = 0
    for j in range(longest):
        live = [i for i in range(b) if j < lengths[i]]
        at = slice(first, first + len(live))
        first += len(live)
        if len(live) == b:  # every sequence has a token j: no gathering
            out[rows[at]], state = _delta_step(q[at], k[at], v[at], g[at], beta[at], state)
        else:
            some = torch.tensor(live, device=mixed.device)
            out[rows[at]], state[some] = _delta_step(q[at], k[at], v[at], g[at], beta[at], state[some])
        for i in kept:
            if j < lengths[i]:
                per_position[i][j].copy_(state[i])
    windows.index_copy_(0, index, torch.stack([full[i, :, n : n + taps] for i, n in enumerate(lengths)]))
    states.index_copy_(0, index, state)
    # The window after token j: the taps inputs ending with it.
    return {
        i: [full[i].unfold(-1, taps, 1)[:, 1 : lengths[i] + 1].permute(1, 0, 2).contiguous(), per_position[i]]
        for i in kept
    }

"""Weighted combine (spec 0x03C3, 0x0AE). Pure.

The gate is applied exactly once, here, after the expert; accumulation is FP32; the scatter-add key is
the semantic (origin rank, token) pair, never the physical slot or destination rank.
"""

from __future__ import annotations

import torch

from ray_moe.core.routes import SemanticRoutes


def combine_routes(semantic_rows: torch.Tensor, routes: SemanticRoutes, out_dtype: torch.dtype) -> torch.Tensor:
    """Scatter-add gated expert rows onto their origin tokens.

    semantic_rows: [R, d] expert outputs in semantic route order (any float dtype)
    returns:       [T, d] ``out_dtype``
    """
    r, d = semantic_rows.shape
    if r != routes.num_routes:
        raise ValueError(f"semantic_rows: {r} rows but the handle holds {routes.num_routes} routes")
    acc = torch.zeros(routes.num_tokens, d, dtype=torch.float32, device=semantic_rows.device)
    if r:
        weighted = semantic_rows.to(torch.float32) * routes.gate.to(semantic_rows.device)[:, None]
        acc.index_add_(0, routes.origin_token.to(semantic_rows.device), weighted)
    return acc.to(out_dtype)


def combine_from_send(returned: torch.Tensor, source, routes: SemanticRoutes, out_dtype: torch.dtype) -> torch.Tensor:
    """Gated combine straight from rows in send order (pi_s^-1 fused into the gather).

    returned: [R, d] rows as they came back, in this rank's send order. For dense routes (r = t*k + j,
    the router's layout) each route slot j is one gather + FP32 multiply-add into the token rows, with no
    atomics; otherwise the general scatter-add path.
    """
    t, k = routes.num_tokens, routes.top_k
    if not routes.dense or t * k != routes.num_routes or returned.shape[0] != routes.num_routes:
        return combine_routes(returned[source.inverse_send], routes, out_dtype)
    d = returned.shape[1]
    acc = torch.zeros(t, d, dtype=torch.float32, device=returned.device)
    if t:
        pos = source.inverse_send.view(t, k)
        gate = routes.gate.to(returned.device).view(t, k)
        for j in range(k):
            acc.addcmul_(returned.index_select(0, pos[:, j]).to(torch.float32), gate[:, j:j + 1])
    return acc.to(out_dtype)


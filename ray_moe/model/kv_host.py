"""The host side of a paged KV step's plan (``model/kv.py``): the chunks' arrays and each chunk's context slots
(``HostChunks``), and ONE int64 buffer per step for every index vector it uploads (``staging`` / ``send``):
written in place (the contexts concatenated straight into it), pinned on CUDA, copied to the device once."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ray_moe.model.paged_varlen import work_tables


@dataclass(frozen=True, eq=False)
class HostChunks:
    """A step's chunks on the host: starts / lens / ends [S] int64 (ends = starts + lens) and ``reads``, each
    chunk's context slots (positions 0 .. end - 1: views of the cache's per-sequence slot arrays)."""

    starts: np.ndarray
    lens: np.ndarray
    ends: np.ndarray
    reads: list[np.ndarray]

    def part(self, a: int, b: int) -> "HostChunks":
        """Chunks ``a .. b - 1``."""
        return HostChunks(self.starts[a:b], self.lens[a:b], self.ends[a:b], self.reads[a:b])

    def read_into(self, out: np.ndarray) -> np.ndarray:
        """The contexts concatenated into ``out[:K]`` (K = the ends' sum); returns that view."""
        view = out[:int(self.ends.sum())]
        if self.reads:
            np.concatenate(self.reads, out=view)
        return view

    def rows_into(self, read: np.ndarray, write: np.ndarray, positions: np.ndarray) -> None:
        """Each new token's position and cache slot (looked up in ``read``, the concatenated contexts) into
        ``positions[:N]`` / ``write[:N]`` (N = the lens' sum, packed order)."""
        n = int(self.lens.sum())
        q_off = np.cumsum(self.lens) - self.lens
        k_off = np.cumsum(self.ends) - self.ends
        pos = np.repeat(self.starts - q_off, self.lens) + np.arange(n, dtype=np.int64)
        positions[:n] = pos
        np.take(read, pos + np.repeat(k_off, self.lens), out=write[:n])


def plan_decode_steps(c: HostChunks, steps: int, rows: int, keys: int, trash: int, device: torch.device,
                      extra: dict[str, np.ndarray] | None = None) -> list[dict[str, torch.Tensor]]:
    """A paged decode step of one token per sequence and the ``steps - 1`` sub-steps after it, planned at once
    (one upload). ``c``: the sequences' chunks with lens = ``steps`` (``starts``: each one's first input
    position; its context slots, ``reads``, cover positions 0 .. start + steps - 1: reserved beforehand).

      keys:  [seq 0: positions 0 .. start_0 + steps - 1 | seq 1: ... | one trash key per padding row | trash]
             sub-step j reads sequence i's segment up to position start_i + j (``k_end``): the segment's
             room past it is read by the later sub-steps; every sub-step shares one slot vector
      rows:  n sequences, then ``rows - n`` padding rows (one padding sequence each, its one trash key)
      1. the segments concatenated into ``read_index``, trash after them; ``cu_k`` [rows + 1]: segment starts
      2. per sub-step j [steps, rows]: write slot and position of start_i + j, ``k_end`` (padding: trash, 0,
         its key's end); ``token_ids`` [steps, rows] (``extra``'s ``token_ids`` for sub-step 0, zeros after:
         the caller fills them on the device from the sub-step before)
      3. one upload; returns one dict per sub-step (device views): write_index, read_index, positions,
         row_valid, cu_q, cu_k, k_end and ``extra``'s vectors (token_ids per sub-step)."""
    n = c.lens.size
    k = int(c.ends.sum())
    if n > rows or k + rows - n > keys or (n and int(c.lens.min()) != steps):
        raise ValueError(f"rows={rows}, keys={keys}, steps={steps}: {n} sequences of {k} context slots "
                         f"(+{rows - n} padding keys), each {steps} positions")
    extra = dict(extra or {})
    tokens0 = extra.pop("token_ids", None)
    sizes = {"read_index": keys, "cu_k": rows + 1, "cu_q": rows + 1, "write_index": steps * rows,
             "positions": steps * rows, "k_end": steps * rows, "token_ids": steps * rows,
             **{x: v.size for x, v in extra.items()}}
    buf, host = staging(sizes, device)
    read = c.read_into(host["read_index"])
    host["read_index"][k:] = trash
    off = np.cumsum(c.ends) - c.ends  # [n] segment starts
    cu_k = host["cu_k"]
    cu_k[:n] = off
    cu_k[n:] = k + np.arange(rows + 1 - n)  # padding rows: one key each
    host["cu_q"][:] = np.arange(rows + 1)
    j = np.arange(steps)[:, None]  # [steps, 1]
    pos, write, end = (host[x].reshape(steps, rows) for x in ("positions", "write_index", "k_end"))
    pos[:, :n] = c.starts[None, :] + j
    write[:, :n] = read[off[None, :] + pos[:, :n]]
    end[:, :n] = off[None, :] + pos[:, :n] + 1
    pos[:, n:], write[:, n:] = 0, trash
    end[:, n:] = cu_k[n:rows][None, :] + 1
    tok = host["token_ids"].reshape(steps, rows)
    tok[:] = 0
    if tokens0 is not None:
        tok[0] = tokens0
    for x, v in extra.items():
        host[x][:] = v
    up = send(buf, sizes, device)
    shared = {"read_index": up["read_index"], "row_valid": torch.arange(rows, device=device) < n,
              "cu_q": up["cu_q"].to(torch.int32), "cu_k": up["cu_k"].to(torch.int32),
              **{x: up[x] for x in extra}}
    k_end = up["k_end"].to(torch.int32).view(steps, rows)
    return [{"token_ids": up["token_ids"].view(steps, rows)[i], "write_index": up["write_index"].view(steps, rows)[i],
             "positions": up["positions"].view(steps, rows)[i], "k_end": k_end[i], **shared}
            for i in range(steps)]


def plan_token_step(c: HostChunks, token_ids: np.ndarray, rows: int, last_rows: int, tables: tuple[int, int, int],
                    trash: int, device: torch.device) -> dict[str, torch.Tensor]:
    """The static inputs of a whole-step graph of a token size (every row read in place: ``paged_varlen``),
    planned with one upload. ``c``: the step's chunks (any mix of decode rows and prefill chunks, packed order);
    ``token_ids`` [n]; ``tables``: (one-row entries, blocks, rows a block) of the size (``table_sizes``).

      rows:       token_ids, positions, write_index [rows]: the n real rows, then padding (token 0, position 0,
                  the trash slot); row_valid [rows] bool
      last:       [last_rows] each sequence's last row (padding entries row 0)
      read_index: [K] every sequence's context slots, packed (a prefix of the graph's slot vector)
      cu_q, cu_k: [last_rows + 1] query-row / key offsets (entries past the S sequences repeat the totals)
      one, seq, first: the work tables (``paged_varlen.work_tables``; empty entries -1)"""
    na, nb, block_q = tables
    s, n, k = int(c.lens.size), int(c.lens.sum()), int(c.ends.sum())
    if n > rows or s > last_rows or token_ids.size != n:
        raise ValueError(f"rows={rows}, last_rows={last_rows}: the step has {n} tokens ({token_ids.size} ids) "
                         f"of {s} sequences")
    sizes = {"token_ids": rows, "positions": rows, "write_index": rows, "last": last_rows, "read_index": k,
             "cu_q": last_rows + 1, "cu_k": last_rows + 1, "one": na, "seq": nb, "first": nb}
    buf, host = staging(sizes, device)
    read = c.read_into(host["read_index"])
    c.rows_into(read, host["write_index"], host["positions"])
    host["write_index"][n:], host["positions"][n:] = trash, 0
    host["token_ids"][:n], host["token_ids"][n:] = token_ids, 0
    host["last"][:s], host["last"][s:] = np.cumsum(c.lens) - 1, 0
    for name, lens, total in (("cu_q", c.lens, n), ("cu_k", c.ends, k)):
        cu = host[name]
        cu[0] = 0
        cu[1:s + 1] = np.cumsum(lens)
        cu[s + 1:] = total
    work_tables(c.lens, host["one"], host["seq"], host["first"], block_q)
    up = send(buf, sizes, device)
    up["row_valid"] = torch.arange(rows, device=device) < n
    return up


def pad(x: np.ndarray, size: int, fill: int) -> np.ndarray:
    """[size] int64: ``x`` [n <= size] then ``fill``."""
    out = np.full(size, fill, dtype=np.int64)
    out[: x.size] = x
    return out


def staging(sizes: dict[str, int], device: torch.device) -> tuple[torch.Tensor, dict[str, np.ndarray]]:
    """ONE int64 host buffer for a step's vectors of ``sizes`` (pinned on CUDA, so the upload reads it as it
    is) and a NumPy view of each one's segment, uninitialised: the caller writes every entry."""
    buf = torch.empty(sum(sizes.values()), dtype=torch.int64, pin_memory=device.type == "cuda")
    flat, views, o = buf.numpy(), {}, 0
    for name, size in sizes.items():
        views[name] = flat[o:o + size]
        o += size
    return buf, views


def send(buf: torch.Tensor, sizes: dict[str, int], device: torch.device) -> dict[str, torch.Tensor]:
    """A ``staging`` buffer on ``device`` (one copy, non-blocking from pinned memory), split by ``sizes``."""
    if device.type == "cuda":
        buf = buf.to(device, non_blocking=True)
    else:
        buf = buf.to(device)
    return dict(zip(sizes, torch.split(buf, list(sizes.values()))))


def upload(host: dict[str, np.ndarray], device: torch.device) -> dict[str, torch.Tensor]:
    """Int64 host vectors -> device tensors through ONE copy (pinned and non-blocking on CUDA)."""
    sizes = {k: int(np.size(x)) for k, x in host.items()}
    buf, views = staging(sizes, device)
    for k, x in host.items():
        views[k][:] = x
    return send(buf, sizes, device)


__all__ = ["HostChunks", "pad", "plan_decode_steps", "plan_token_step", "send", "staging", "upload"]

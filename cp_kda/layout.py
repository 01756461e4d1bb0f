"""Moving tensors between the public layout ``[B,T,H,X]`` and the chunked layout ``[N,H,NC,C,X]``.

Packed sequences (``cu_seqlens``) are placed one per row of a zero-padded batch, so the chunked algorithm never
sees a sequence boundary inside a chunk. Zero padding is exact for KDA: a padded token has k = 0 and beta = 0
(no write), g = 0 (no decay) and q = 0, so the state passes through it unchanged.
"""
from __future__ import annotations

import torch


class Layout:
    """Index bookkeeping for one (T, cu_seqlens, chunk_size) triple.

    Attributes:
        n_seq: N, rows of the chunked layout (B for dense input, the number of packed sequences otherwise).
        padded: Tp, tokens per row after padding to a multiple of the chunk size.
        n_chunks: NC = Tp // C.
    """

    def __init__(self, batch: int, T: int, bounds: list[int] | None, chunk_size: int, device):
        self.batch, self.T, self.bounds, self.C = batch, T, bounds, chunk_size
        longest = T if bounds is None else max(b - a for a, b in zip(bounds[:-1], bounds[1:]))
        self.padded = -(-longest // chunk_size) * chunk_size
        self.n_chunks = self.padded // chunk_size
        self.n_seq = batch if bounds is None else len(bounds) - 1
        self.flat_index = None
        if bounds is not None:
            # flat_index[t] = row * Tp + position-in-row of packed token t
            rows = [torch.arange(a, b, device=device) - a + i * self.padded
                    for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:]))]
            self.flat_index = torch.cat(rows)

    def to_chunks(self, x: torch.Tensor) -> torch.Tensor:
        """``[B,T,H,X]`` (or ``[B,T,H]``) -> ``[N,H,NC,C,X]`` (or ``[N,H,NC,C]``), zero padded."""
        squeeze = x.dim() == 3
        if squeeze:
            x = x.unsqueeze(-1)
        H, X = x.shape[2], x.shape[3]
        if self.bounds is None:
            rows = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, self.padded - self.T))
        else:
            rows = x.new_zeros(self.n_seq * self.padded, H, X).index_copy(0, self.flat_index, x[0])
        out = rows.reshape(self.n_seq, self.n_chunks, self.C, H, X).permute(0, 3, 1, 2, 4)
        return out.squeeze(-1) if squeeze else out

    def from_chunks(self, y: torch.Tensor) -> torch.Tensor:
        """``[N,H,NC,C,X]`` (or ``[N,H,NC,C]``) -> ``[B,T,H,X]`` (or ``[B,T,H]``), dropping the padding."""
        if y.dim() == 4:
            return self.from_chunks(y.unsqueeze(-1)).squeeze(-1)
        N, H = y.shape[0], y.shape[1]
        rows = y.permute(0, 2, 3, 1, 4).reshape(N, self.padded, H, y.shape[-1])
        if self.bounds is None:
            return rows[:, :self.T]
        return rows.reshape(N * self.padded, H, -1).index_select(0, self.flat_index).unsqueeze(0)

"""Moving tensors between the public layout ``[B,T,H,X]`` and the chunk-major layout ``[NC,N,H,C,X]``.

Packed sequences (``cu_seqlens``) are placed one per row of a zero-padded batch, so the chunked algorithm never
sees a sequence boundary inside a chunk. Zero padding is exact for KDA: a padded token has k = 0 and beta = 0
(no write), g = 0 (no decay) and q = 0, so the state passes through it unchanged.

Two steps, so the forward can move one group of chunks at a time: ``rows`` ``[N,Tp,H,X]`` (one sequence per
row, padded; the input itself for dense input whose T is a multiple of C), then ``chunk_slice`` (a contiguous
chunk-major ``[n,N,H,C,X]`` block: one chunk of every row and head is one ``[N*H, C, X]`` matmul batch).
A whole-sequence copy at 32k tokens (H=2, K=128) ran 14x slower than at 8k for 4x the data (glibc returns
buffers of 32 MiB and more as fresh pages, faulted in on every call); a cache-sized group's copy does not.
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
            rows = [
                torch.arange(a, b, device=device) - a + i * self.padded
                for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:]))
            ]
            self.flat_index = torch.cat(rows)

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """``[B,T,H,X]`` (or ``[B,T,H]``) -> ``[N,Tp,H,X]`` (or ``[N,Tp,H,1]``), zero padded; no copy when the
        input is dense and T a multiple of C."""
        if x.dim() == 3:
            x = x.unsqueeze(-1)
        if self.bounds is None:
            return x if self.padded == self.T else torch.nn.functional.pad(x, (0, 0, 0, 0, 0, self.padded - self.T))
        return (
            x.new_zeros(self.n_seq * self.padded, *x.shape[2:])
            .index_copy(0, self.flat_index, x[0])
            .view(self.n_seq, self.padded, *x.shape[2:])
        )

    def chunk_slice(self, rows: torch.Tensor, sl: slice) -> torch.Tensor:
        """Chunks ``sl`` of ``rows`` ``[N,Tp,H,X]`` as a contiguous ``[n,N,H,C,X]`` block."""
        N, _, H, X = rows.shape
        return rows.view(N, self.n_chunks, self.C, H, X)[:, sl].permute(1, 0, 3, 2, 4).contiguous()

    def chunk_view(self, rows: torch.Tensor, sl: slice) -> torch.Tensor:
        """Chunks ``sl`` of ``rows`` ``[N,Tp,H,X]`` as a writable (strided) ``[n,N,H,C,X]`` view."""
        N, _, H, X = rows.shape
        return rows.view(N, self.n_chunks, self.C, H, X)[:, sl].permute(1, 0, 3, 2, 4)

    def from_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """``[N,Tp,H,X]`` -> ``[B,T,H,X]``, dropping the padding."""
        if self.bounds is None:
            return rows[:, : self.T]
        return rows.reshape(self.n_seq * self.padded, *rows.shape[2:]).index_select(0, self.flat_index).unsqueeze(0)

    def to_chunks(self, x: torch.Tensor) -> torch.Tensor:
        """``[B,T,H,X]`` (or ``[B,T,H]``) -> contiguous ``[NC,N,H,C,X]`` (or ``[NC,N,H,C]``), zero padded."""
        out = self.chunk_slice(self.rows(x), slice(None))
        return out.squeeze(-1) if x.dim() == 3 else out

    def from_chunks(self, y: torch.Tensor) -> torch.Tensor:
        """``[NC,N,H,C,X]`` (or ``[NC,N,H,C]``) -> ``[B,T,H,X]`` (or ``[B,T,H]``), dropping the padding."""
        if y.dim() == 4:
            return self.from_chunks(y.unsqueeze(-1)).squeeze(-1)
        N, H = y.shape[1], y.shape[2]
        return self.from_rows(y.permute(1, 0, 3, 2, 4).reshape(N, self.padded, H, y.shape[-1]))

"""Bad input raises ValueError naming the offending argument."""

import pytest
import torch

from cp_kda import context_parallel_kda, kda_chunk, kda_recurrent
from tests.cp_kda.helpers import make_inputs

OPS = [kda_recurrent, kda_chunk]


def _inputs():
    return [x.detach() for x in make_inputs(1, 10, 2, 4, 3, with_state=False)[:5]]


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize(
    "index,name,bad",
    [
        (1, "k", lambda t: t[:, :, :1]),  # wrong heads
        (2, "v", lambda t: t[:, :5]),  # wrong length
        (3, "g", lambda t: t[..., :3]),  # wrong K
        (4, "beta", lambda t: t.unsqueeze(-1)),  # extra dim
        (1, "k", lambda t: t.float()),  # dtype mismatch with q
        (0, "q", lambda t: t[0]),  # not 4-D
        (0, "q", lambda t: t.long()),  # integer dtype
        (4, "beta", lambda t: t.to("meta")),  # device mismatch
    ],
)
def test_shape_dtype_device(op, index, name, bad):
    xs = _inputs()
    xs[index] = bad(xs[index])
    with pytest.raises(ValueError, match=f"^{name}:"):
        op(*xs)


@pytest.mark.parametrize("op", OPS)
def test_positive_log_decay_with_validate(op):
    xs = _inputs()
    xs[3] = xs[3].clone()
    xs[3][0, 3, 1, 2] = 0.5
    op(*xs)  # not checked by default (it costs a host sync)
    with pytest.raises(ValueError, match="^g:"):
        op(*xs, validate=True)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("cu", [[0, 5, 5, 10], [0, 6, 4, 10], [0, 5, 9], [1, 5, 10], [0, 5, 12]])
def test_bad_cu_seqlens(op, cu):
    with pytest.raises(ValueError, match="^cu_seqlens:"):
        op(*_inputs(), cu_seqlens=torch.tensor(cu))


@pytest.mark.parametrize("op", OPS)
def test_bad_initial_state(op):
    xs = _inputs()
    with pytest.raises(ValueError, match="^initial_state:"):
        op(*xs, initial_state=torch.zeros(1, 2, 4, 3, dtype=torch.float32))  # fp64 inputs need fp64 state
    with pytest.raises(ValueError, match="^initial_state:"):
        op(*xs, initial_state=torch.zeros(2, 2, 4, 3, dtype=torch.float64))


def test_bad_chunk_size_and_backend():
    with pytest.raises(ValueError, match="^chunk_size:"):
        kda_chunk(*_inputs(), chunk_size=0)
    with pytest.raises(ValueError, match="^backend:"):
        kda_chunk(*_inputs(), backend="triton")


class _OneRank:
    rank, world_size = 0, 1


def test_context_parallel_arguments():
    xs = _inputs()
    with pytest.raises(ValueError, match="^strategy:"):
        context_parallel_kda(*xs, _OneRank(), strategy="tree")
    with pytest.raises(ValueError, match="^cu_seqlens:"):
        context_parallel_kda(*xs, _OneRank(), cu_seqlens=torch.tensor([0, 4, 12]))
    with pytest.raises(ValueError, match="^v:"):
        context_parallel_kda(*xs[:2], xs[2][:, :4], *xs[3:], _OneRank())

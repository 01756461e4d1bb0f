"""``k3.parallelize`` on the world-size-1 gloo communicator (the same code path as many ranks): EP refuses a model
built for another EP group, the DP sync gives every parameter a gradient, the clip is torch's global-norm clip,
and the trainer does not import its command line."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from k3.config import K3Config
from k3.model import build_model, token_loss_sum
from k3.parallelize import ParallelDims, apply_dp, apply_ep, parallelize_k3, shard_batch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CFG = K3Config.preset("tiny")


def test_apply_ep_refuses_a_model_built_for_another_ep_group(comm1):
    model = build_model(CFG, seed=0, ep_size=2, ep_rank=0)
    with pytest.raises(ValueError, match="build it with ep_size=1"):
        apply_ep(model, comm1, tokens=8)
    assert all(moe.buffer is None for moe in model.moe_layers())  # nothing attached


def test_parallelize_attaches_ep_and_cp_and_splits_the_parameters(comm1):
    model = build_model(CFG, seed=0)
    dims = ParallelDims.build(comm1, 1)
    dp = parallelize_k3(model, dims, tokens=8)
    buffers = {id(moe.buffer) for moe in model.moe_layers()}
    assert len(buffers) == 1 and None not in {moe.buffer for moe in model.moe_layers()}  # one shared Buffer
    assert all(layer.self_attn.cp_comm is None for layer in model.layers)  # cp = 1: whole sequences
    assert set(dp.experts) | set(dp.replicated) == {n for n, _ in model.named_parameters()}
    assert dp.experts and all(".mlp.w" in n for n in dp.experts) and not set(dp.experts) & set(dp.replicated)
    assert dims.comms() == (comm1,) and (dims.dp, dims.dp_rank, dims.cp_rank) == (1, 0, 0)


def test_shard_batch_takes_the_ranks_rows_and_token_slice(comm1):
    full = torch.arange(4 * 9).view(4, 9)
    inputs, targets = shard_batch(full, ParallelDims.build(comm1, 1), rows=4, T_l=8)
    assert torch.equal(inputs, full[:, :8]) and torch.equal(targets, full[:, 1:])


def test_sync_fills_missing_grads_and_clip_is_the_global_norm_clip(comm1):
    torch.manual_seed(0)
    model = build_model(CFG, seed=0)
    tokens = torch.randint(0, CFG.vocab_size, (2, 17))
    loss_sum = token_loss_sum(model, tokens[:, :-1], tokens[:, 1:])
    (loss_sum / 32).backward()
    before = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
    dp = apply_dp(model, comm1)
    missing = [n for n, g in before.items() if g is None]
    assert missing  # layer 0's attention AttnRes query gets no gradient (it reads the embedding alone)
    assert dp.sync_grads(loss_sum) == float(loss_sum.detach())
    assert all(dp.params[n].grad is not None and not dp.params[n].grad.any() for n in missing)
    norm = dp.clip_grad_norm_(0.5)
    expected = torch.stack([g.double().norm() for g in before.values() if g is not None]).norm()
    assert abs(norm - float(expected)) <= 1e-9 * norm and norm > 0.5
    for n, p in model.named_parameters():
        want = torch.zeros_like(p) if before[n] is None else before[n] * (0.5 / norm)
        torch.testing.assert_close(p.grad, want, rtol=1e-6, atol=1e-9, msg=n)


@pytest.mark.spawns
def test_the_trainer_does_not_import_its_command_line():
    """k3.cli depends on k3.train (its handler), never the reverse: `python -m k3.train` parses its own flags."""
    code = "import sys, k3.train; print('k3.cli' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr[-2000:]

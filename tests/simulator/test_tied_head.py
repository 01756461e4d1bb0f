"""A tied LM head (``ModelSpec.tie_embeddings``, the Megatron GPT presets): a model in one chunk multiplies by the
word embedding itself; a split model's last chunk keeps its own copy (Megatron's last stage allocates
``output_layer.weight`` and all-reduces its gradient with the first stage's). Memory, ZeRO-2's walk and the
data-parallel reduction count a rank's parameters by the same rule (``memory.chunk_end_params``)."""

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simulator import network as net
from simulator.analytic import dp_seconds
from simulator.hardware import load_hardware
from simulator.memory import rank_memory
from simulator.parallel import ParallelConfig
from simulator.specs import load_model

HW = load_hardware("a100")
TIED = replace(load_model("gpt-22b"), num_layers=8)


@settings(max_examples=30, deadline=None)
@given(
    pp=st.sampled_from([1, 2, 4]),
    tp=st.sampled_from([1, 2, 8]),
    zero=st.sampled_from([0, 1, 2]),
    vocab=st.integers(1_000, 200_000),
)
def test_a_tied_head_is_one_copy_in_one_chunk_and_a_copy_of_its_own_on_a_split_model(pp, tp, zero, vocab):
    tied = replace(TIED, vocab=vocab)
    untied = replace(tied, tie_embeddings=False)
    par = ParallelConfig(tp=tp, pp=pp, dp=4, zero_stage=zero, micro_batch=1, seq_len=2048)
    tiers = net.cluster_tiers(tp * pp * 4, HW, net.ClusterSpec())
    for rank in range(pp):
        mem_t, mem_u = rank_memory(tied, HW, par, rank), rank_memory(untied, HW, par, rank)
        dp_t, dp_u = dp_seconds(tied, par, tiers, rank), dp_seconds(untied, par, tiers, rank)
        if pp == 1:  # one copy fewer than the untied model: bf16 weights, gradients, optimizer state all shrink
            weight_bytes = vocab * tied.hidden / tp * 2.0
            assert mem_u["params"] - mem_t["params"] == pytest.approx(weight_bytes)
            assert mem_t["grads"] < mem_u["grads"] and mem_t["optimizer"] < mem_u["optimizer"]
            assert dp_t < dp_u
        else:  # the last stage's copy weighs what an untied head does, in memory and in the gradient reduction
            for item in ("params", "grads", "optimizer", "activations"):
                assert mem_t[item] == pytest.approx(mem_u[item]), item
            assert dp_t == pytest.approx(dp_u)

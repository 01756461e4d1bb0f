"""load_hf_checkpoint on a tiny checkpoint written here in the released layout (sharded, MXFP4 experts)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from k3 import K3Config
from k3.hf import hf_names, load_hf_checkpoint, mxfp4_dequantize, mxfp4_quantize
from k3.model import build_model

CFG = K3Config.preset("tiny")


def test_mxfp4_round_trip_on_grid():
    """Values already on the E2M1 x 2^e grid survive quantise -> dequantise exactly."""
    torch.manual_seed(0)
    codes = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    w = codes[torch.randint(0, 8, (4, 64))] * torch.where(torch.rand(4, 64) < 0.5, -1.0, 1.0) * 0.25
    w[:, 0] = 6 * 0.25  # every group's max is 6 * scale
    w[:, 32] = -6 * 0.25
    assert torch.equal(mxfp4_dequantize(*mxfp4_quantize(w)), w)


def _write(model, path, *, mxfp4=True, n_shards=3):
    """The release layout: tensors spread over shards, experts packed, conv taps [D, 1, W], queries [1, d],
    A_log padded with unused entries (the release has 128 for 96 heads)."""
    names = hf_names(model)
    tensors = {}
    for name, (t, row) in names.items():
        value = (t[row] if row is not None else t).detach().clone()
        if row is not None and mxfp4:
            packed, scale = mxfp4_quantize(value)
            tensors[name.removesuffix(".weight") + ".weight_packed"] = packed
            tensors[name.removesuffix(".weight") + ".weight_scale"] = scale
            continue
        if name.endswith("conv1d.weight"):
            value = value[:, None, :]
        if name.endswith("_res_proj.weight"):
            value = value[None, :]
        if name.endswith("A_log"):
            value = torch.cat([value, torch.full((value.numel() // 3 + 1,), float("nan"))])
        tensors["language_model." + name] = value
    keys = sorted(tensors)
    weight_map = {}
    for s in range(n_shards):
        file = f"model-{s + 1:05d}-of-{n_shards:05d}.safetensors"
        part = {k: tensors[k].contiguous() for k in keys[s::n_shards]}
        save_file(part, str(path / file))
        weight_map.update(dict.fromkeys(part, file))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_load_round_trip_with_mxfp4_experts(tmp_path):
    src = build_model(CFG, seed=1)
    with torch.no_grad():  # put the experts on the MXFP4 grid so the round trip is exact
        for moe in src.moe_layers():
            for w in (moe.w1, moe.w2, moe.w3):
                w.copy_(torch.stack([mxfp4_dequantize(*mxfp4_quantize(e)) for e in w]))
        for moe in src.moe_layers():
            moe.gate.e_score_correction_bias.normal_()
    _write(src, tmp_path)
    dst = build_model(CFG, seed=2)
    loaded = load_hf_checkpoint(dst, str(tmp_path))
    assert len(loaded) == len(hf_names(dst))
    for (n, a), b in zip(src.state_dict().items(), dst.state_dict().values()):
        assert torch.equal(a, b), n
    half = build_model(CFG, seed=2, ep_size=2, ep_rank=1)  # an EP rank loads only its own experts
    load_hf_checkpoint(half, str(tmp_path))
    assert torch.equal(half.layers[1].mlp.w1, src.layers[1].mlp.w1[4:])


@pytest.mark.parametrize(
    "damage, message",
    [
        ("missing_shard", "shard files missing"),
        ("missing_tensor", "missing"),
        ("wrong_shape", "shape"),
        ("no_index", "index"),
        ("corrupt_shard", "unreadable|shard"),
    ],
)
def test_bad_checkpoint_raises_and_loads_nothing(tmp_path, damage, message):
    src = build_model(CFG, seed=1)
    _write(src, tmp_path, mxfp4=False)
    index = tmp_path / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    if damage == "missing_shard":
        (tmp_path / "model-00002-of-00003.safetensors").unlink()
    elif damage == "missing_tensor":
        data["weight_map"].pop("language_model.lm_head.weight")
        index.write_text(json.dumps(data))
    elif damage == "wrong_shape":
        file = data["weight_map"]["language_model.model.norm.weight"]
        from safetensors.torch import load_file

        part = load_file(str(tmp_path / file))
        part["language_model.model.norm.weight"] = torch.ones(3)
        save_file(part, str(tmp_path / file))
    elif damage == "no_index":
        index.unlink()
    else:
        (tmp_path / "model-00001-of-00003.safetensors").write_bytes(b"not a safetensors file")
    dst = build_model(CFG, seed=2)
    before = {k: v.clone() for k, v in dst.state_dict().items()}
    with pytest.raises(ValueError, match=message):
        load_hf_checkpoint(dst, str(tmp_path))
    assert all(torch.equal(before[k], v) for k, v in dst.state_dict().items())

"""The HF loader is strict: a checkpoint that does not fit the model exactly (layout, size, dtype, scale shape, an
index pointing outside its folder) raises ValueError naming the tensor or file, and the model is left untouched.
Each case loaded silently (and wrongly) before the loader became strict."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

from k3.hf import load_hf_checkpoint, mxfp4_dequantize, mxfp4_quantize
from k3.model import build_model
from tests.k3.test_hf import CFG, _write

SINGLE = "model.safetensors"


@pytest.fixture(scope="module")
def source():
    return build_model(CFG, seed=1)


def _released(source, folder, *, mxfp4=False) -> dict[str, torch.Tensor]:
    """``source`` in the release layout under ``folder``; returns every stored tensor by its stored name."""
    os.makedirs(folder, exist_ok=True)
    _write(source, folder, mxfp4=mxfp4, n_shards=1)
    return load_file(str(folder / "model-00001-of-00001.safetensors"))


def _save(folder, tensors: dict[str, torch.Tensor], weight_map: dict[str, str] | None = None) -> None:
    """``tensors`` as one shard with its index (``weight_map`` overrides where names point)."""
    for f in os.listdir(folder):
        os.remove(folder / f)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / SINGLE))
    index = {"metadata": {}, "weight_map": dict.fromkeys(tensors, SINGLE) | (weight_map or {})}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def _refused(folder, *words: str) -> str:
    """Loading ``folder`` raises ValueError containing ``words`` and changes nothing; returns the message."""
    dst = build_model(CFG, seed=2)
    before = {k: v.clone() for k, v in dst.state_dict().items()}
    with pytest.raises(ValueError) as info:
        load_hf_checkpoint(dst, str(folder))
    msg = str(info.value)
    assert all(w in msg for w in words) and "\n" not in msg, msg
    assert all(torch.equal(before[k], v) for k, v in dst.state_dict().items())
    return msg


CONV = "language_model.model.layers.0.self_attn.q_conv1d.weight"


@pytest.mark.parametrize("layout", ["[W, D]", "[W, 1, D]", "[D * W]"])
def test_conv_taps_in_another_layout_are_refused(source, tmp_path, layout):
    """Only the release's [D, 1, W] (and ours, [D, W]) load: taps stored transposed have the right element count
    and used to be reshaped into scrambled filters."""
    tensors = _released(source, tmp_path)
    taps = tensors[CONV][:, 0, :]  # [D, W]
    tensors[CONV] = {"[W, D]": taps.T, "[W, 1, D]": taps.T[:, None, :], "[D * W]": taps.reshape(-1)}[layout]
    _save(tmp_path, tensors)
    _refused(tmp_path, "q_conv1d.weight has shape", "expected (32, 4)")


def _larger(tensors: dict[str, torch.Tensor]) -> list[str]:
    """Add what a larger model has: a 10th layer (a copy of the 9th) and 8 more experts per MoE layer."""
    added = {}
    for k, v in tensors.items():
        if k.startswith("language_model.model.layers.8."):
            added[k.replace("layers.8.", "layers.9.")] = v.clone()
        if ".experts.7." in k:
            added.update({k.replace(".experts.7.", f".experts.{j}."): v.clone() for j in range(8, 16)})
    tensors.update(added)
    return sorted(k.removeprefix("language_model.") for k in added)


def test_checkpoint_of_a_larger_model_is_refused_naming_the_extra_tensors(source, tmp_path):
    tensors = _released(source, tmp_path)
    extra = _larger(tensors)
    _save(tmp_path, tensors)
    msg = _refused(tmp_path, f"{len(extra)} this model does not have", "allow_extra=True")
    assert extra[0] in msg and "0 tensor(s) missing" in msg


def test_allow_extra_loads_and_names_what_it_drops(source, tmp_path):
    tensors = _released(source, tmp_path)
    extra = _larger(tensors)
    _save(tmp_path, tensors)
    dst = build_model(CFG, seed=2)
    with pytest.warns(UserWarning, match=f"dropping {len(extra)} tensor") as seen:
        load_hf_checkpoint(dst, str(tmp_path), allow_extra=True)
    assert all(name in str(seen[0].message) for name in extra)
    for (n, a), b in zip(source.state_dict().items(), dst.state_dict().values()):
        assert torch.equal(a, b), n


def test_every_missing_tensor_is_named(source, tmp_path):
    tensors = _released(source, tmp_path)
    gone = ["model.norm.weight", "model.layers.2.self_attn.k_proj.weight"]
    for name in gone:
        del tensors["language_model." + name]
    _save(tmp_path, tensors)
    _refused(tmp_path, "2 tensor(s) missing", *gone)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.bool, torch.uint8])
def test_integer_tensor_for_a_float_parameter_is_refused(source, tmp_path, dtype):
    tensors = _released(source, tmp_path)
    tensors["language_model.model.norm.weight"] = torch.ones(CFG.hidden_size, dtype=dtype)
    _save(tmp_path, tensors)
    _refused(tmp_path, f"model.norm.weight is {dtype}, the model holds torch.float32", "an integer or bool")


def test_float_to_float_cast_loads_with_a_warning(tmp_path):
    """bf16 stored for an fp32 model (the release's dtype): values that bf16 holds exactly load exactly, and the
    cast is named in a warning."""
    src = build_model(CFG, seed=1)
    with torch.no_grad():
        src.norm.weight.copy_(src.norm.weight.bfloat16().float())
    tensors = _released(src, tmp_path)
    tensors["language_model.model.norm.weight"] = tensors["language_model.model.norm.weight"].bfloat16()
    _save(tmp_path, tensors)
    dst = build_model(CFG, seed=2)
    with pytest.warns(UserWarning, match=r"1 float tensor\(s\) cast .*model.norm.weight \(torch.bfloat16 -> "):
        load_hf_checkpoint(dst, str(tmp_path))
    assert torch.equal(dst.norm.weight, src.norm.weight)


def test_round_trip_warns_of_nothing(source, tmp_path):
    _released(source, tmp_path, mxfp4=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_hf_checkpoint(build_model(CFG, seed=2), str(tmp_path))


SCALE = "model.layers.1.block_sparse_moe.experts.0.w1.weight_scale"  # _write stores packed experts unprefixed


@pytest.mark.parametrize("shape", ["[1, in/32]", "[out * in/32]", "[out, in/16]"])
def test_mxfp4_scale_of_another_shape_is_refused(source, tmp_path, shape):
    """A scale of one row used to broadcast over every row of the expert."""
    tensors = _released(source, tmp_path, mxfp4=True)
    scale = tensors[SCALE]
    out, groups = scale.shape
    tensors[SCALE] = {
        "[1, in/32]": scale[:1],
        "[out * in/32]": scale.reshape(-1),
        "[out, in/16]": scale.repeat_interleave(2, dim=1),
    }[shape]
    _save(tmp_path, tensors)
    _refused(tmp_path, "experts.0.w1.weight_scale is torch.uint8", f"expected torch.uint8 ({out}, {groups})")


def test_mxfp4_dequantize_refuses_a_scale_that_would_broadcast():
    packed, scale = mxfp4_quantize(torch.randn(4, 64))
    with pytest.raises(ValueError, match=r"scale \(1, 2\) does not fit packed codes \(4, 32\)"):
        mxfp4_dequantize(packed, scale[:1])


@pytest.mark.parametrize("escape", ["../elsewhere/x.safetensors", "ABSOLUTE", "SYMLINK"])
def test_index_pointing_outside_its_folder_is_never_followed(source, tmp_path, escape):
    """A complete, valid shard outside the checkpoint folder (reached by ``..``, an absolute path, or a symlink
    inside the folder) is refused by name, not loaded."""
    folder, elsewhere = tmp_path / "ckpt", tmp_path / "elsewhere"
    tensors = _released(source, folder)
    _save(folder, tensors)
    elsewhere.mkdir()
    os.replace(folder / SINGLE, elsewhere / "x.safetensors")
    target = {"../elsewhere/x.safetensors": "../elsewhere/x.safetensors", "ABSOLUTE": str(elsewhere / "x.safetensors")}
    if escape == "SYMLINK":
        os.symlink(elsewhere / "x.safetensors", folder / "link.safetensors")
    where = target.get(escape, "link.safetensors")
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": dict.fromkeys(tensors, where)}))
    _refused(folder, f"points to {where!r}, outside", "never followed")

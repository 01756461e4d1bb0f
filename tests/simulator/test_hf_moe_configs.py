"""Hugging Face MoE configs read right or refused by name (issues 28 and 27): every family's published total and
active parameter counts (``hf_moe_config_data.PUBLISHED``), which layers are MoE / dense / Mamba, an MoE config
under names we do not know is an error naming its fields, never a dense model; expert fields we do not read are
warned about. Field values are those of the published ``config.json`` files."""

from __future__ import annotations

import json
import warnings

import pytest

from moonep.console import main
from simulator.layers import layer_stats, param_counts
from simulator.specs import from_hf_config, load_model
from tests.simulator.hf_moe_config_data import (
    DBRX,
    DEEPSEEK_V3,
    ERNIE_45_21B_A3B,
    JAMBA_V01,
    LLAMA4_MAVERICK,
    MIXTRAL_8X7B,
    PUBLISHED,
    QWEN2_57B_A14B,
)


def _load(cfg: dict, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return load_model(str(path))


def test_mixtral_reads_its_expert_width_from_intermediate_size(tmp_path):
    spec = _load(MIXTRAL_8X7B, tmp_path)
    assert (spec.num_experts, spec.top_k, spec.moe_ffn_hidden, spec.num_shared_experts) == (8, 2, 14336, 0)
    counts = param_counts(spec)  # Mistral's numbers: 46.7B total, 12.9B active
    assert 46.0e9 < counts.total < 47.5e9 and 12.5e9 < counts.active < 13.2e9, counts


def test_an_unknown_family_sized_by_intermediate_size_is_priced_so_and_says_it():
    """A family the loader does not know, with experts but no ``moe_intermediate_size``: priced as Mixtral is (the
    expert is ``intermediate_size`` wide), with a warning naming the model type and the width; Mixtral is quiet."""
    unknown = MIXTRAL_8X7B | {"model_type": "foo_moe", "architectures": ["FooMoeForCausalLM"]}
    for cfg, warns in ((unknown, True), (MIXTRAL_8X7B | {"model_type": "mixtral"}, False)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            spec = from_hf_config(cfg)
        said = [str(w.message) for w in caught if "moe_intermediate_size" in str(w.message)]
        assert spec.moe_ffn_hidden == 14336
        assert bool(said) == warns and (not warns or "'foo_moe'" in said[0] and "intermediate_size=14336" in said[0])


def test_the_cli_says_the_width_it_used_in_one_line(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(MIXTRAL_8X7B | {"model_type": "foo_moe", "moe_capacity_factor": 1.25}))
    # 0 or 1 (out of memory at this layout): either way the run is priced and the loader warnings come first
    assert main(["simulate", "run", "--model", str(path), "--hardware", "h100", "--gpus", "64", "--ep", "8"]) in (0, 1)
    warned = [x for x in capsys.readouterr().err.splitlines() if "warning" in x.lower()]
    assert len(warned) == 2 and all(x.startswith("warning: HF config: ") for x in warned), warned
    assert "'foo_moe'" in " ".join(warned) and "moe_capacity_factor" in " ".join(warned), warned


def test_an_hf_model_folder_is_read_through_its_config_json(tmp_path):
    """``--model`` may name the downloaded model's folder; a folder without config.json is one clear error."""
    (tmp_path / "mixtral").mkdir()
    (tmp_path / "mixtral" / "config.json").write_text(json.dumps(MIXTRAL_8X7B))
    assert load_model(str(tmp_path / "mixtral")) == load_model(str(tmp_path / "mixtral" / "config.json"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no config.json"):
        load_model(str(tmp_path / "empty"))


def test_qwen2_moe_keeps_its_shared_expert(tmp_path):
    spec = _load(QWEN2_57B_A14B, tmp_path)
    assert spec.num_shared_experts * spec.moe_ffn_hidden == 20480
    active = param_counts(spec).active  # Qwen's own: 14B active ("A14B"); without the shared expert 7.5B
    assert 13.5e9 < active < 14.8e9, active


def test_ernie_moe_names_are_read(tmp_path):
    spec = _load(ERNIE_45_21B_A3B, tmp_path)
    assert (spec.num_experts, spec.top_k, spec.num_shared_experts, spec.first_k_dense) == (64, 6, 2, 1)
    counts = param_counts(spec)  # Baidu's "21B-A3B" (rounded: 64 + 2 shared experts of 1536 over 27 layers)
    assert 20.0e9 < counts.total < 22.5e9 and 2.7e9 < counts.active < 3.6e9, counts


@pytest.mark.parametrize(
    "fields, named",
    [
        ({"num_routed_exps": 16, "exps_per_token": 2, "expert_ffn": 512}, "expert_ffn"),
        ({"moe_experts_total": 32, "moe_topk_n": 4}, "moe_experts_total"),
    ],
)
def test_an_moe_config_under_unknown_names_is_refused_not_read_as_dense(fields: dict, named: str):
    base = {k: MIXTRAL_8X7B[k] for k in ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size")}
    with pytest.raises(ValueError, match="no expert count under a known name") as err:
        from_hf_config(base | {"intermediate_size": 1024} | fields)
    assert named in str(err.value)


def test_unread_expert_fields_are_warned_about():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from_hf_config(MIXTRAL_8X7B | {"moe_capacity_factor": 1.25, "expert_dropout": 0.1, "expert_selection_fn": "x"})
    said = " ".join(str(w.message) for w in caught)
    assert "moe_capacity_factor" in said and "expert_dropout" in said and "router_aux_loss_coef" not in said, said
    assert "expert_selection_fn" in said  # a rule, not a size: read as a warning, not refused


@pytest.mark.parametrize(
    "change, named",
    [
        ({"share_expert_dim": 3000}, "share_expert_dim=3000"),
        ({"num_experts_per_tok": 0}, "without its top-k"),
        ({"num_experts_per_tok": 65}, "num_experts_per_tok=65"),
        ({"moe_intermediate_size": 0}, "moe_intermediate_size"),
        ({"num_local_experts": 32}, "num_local_experts=32"),
        ({"moe_intermediate_size": 2560.5}, "moe_intermediate_size"),
        ({"num_key_value_heads": 5}, "num_key_value_heads"),
        ({"mlp_only_layers": list(range(28))}, "mlp_only_layers"),
        ({"decoder_sparse_step": 2, "intermediate_size": 0}, "intermediate_size"),
    ],
)
def test_bad_or_ambiguous_moe_configs_are_refused_naming_the_hf_field(change: dict, named: str):
    with pytest.raises(ValueError) as err:
        from_hf_config(QWEN2_57B_A14B | change)
    msg = str(err.value)
    assert named in msg and "ModelSpec" not in msg and "moe_ffn_hidden" not in msg, msg
    assert "\n" not in msg


def test_qwen_sparse_step_and_mlp_only_layers_price_dense_layers():
    spec = from_hf_config(QWEN2_57B_A14B | {"decoder_sparse_step": 2, "mlp_only_layers": [3]})
    kinds = [k[1] for k in spec.layer_kinds()]
    assert [i for i, k in enumerate(kinds) if k == "moe"] == [i for i in range(1, 28, 2) if i != 3]
    every = param_counts(from_hf_config(QWEN2_57B_A14B))
    dense_width = 3 * 3584 * 18944  # the dense layers use intermediate_size, not the experts
    moe_layer = 64 * 3 * 3584 * 2560 + 3 * 3584 * 20480 + 64 * 3584 + 3584
    assert every.total - param_counts(spec).total == 15 * (moe_layer - dense_width)


@pytest.mark.parametrize("name", ["mlp_only_intermediate_size", "first_dense_intermediate_size"])
def test_the_dense_width_under_its_other_names_sizes_the_dense_layers(name: str):
    """Families that name the dense layers' width apart from ``intermediate_size`` (kolibri, Ergo): read, not
    refused as dense layers without a width and not priced at another field's width."""
    spec = from_hf_config(QWEN2_57B_A14B | {"mlp_only_layers": [0, 1], name: 4096})
    assert spec.ffn_hidden == 4096 and [k[1] for k in spec.layer_kinds()][:3] == ["dense", "dense", "moe"]
    without = {k: v for k, v in QWEN2_57B_A14B.items() if k != "intermediate_size"}
    assert from_hf_config(without | {"mlp_only_layers": [0], name: 4096}).ffn_hidden == 4096
    with pytest.raises(ValueError, match="intermediate_size > 0"):
        from_hf_config(without | {"mlp_only_layers": [0]})


def _tolerance(published: float) -> float:
    """2%, or half a unit of the card's last digit when it gives fewer digits (``2.4B``: 2.1%)."""
    digits = len(f"{published / 1e9:g}".replace(".", "").lstrip("0"))
    unit = 10 ** (len(str(int(published / 1e9))) - digits) if published >= 1e9 else 0
    return max(0.02, 0.5 * unit * 1e9 / published) if unit else 0.02


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_total_and_active_parameter_counts(name: str):
    cfg, total, active, convention, source = PUBLISHED[name]
    spec = from_hf_config(cfg)
    c = param_counts(spec)
    head_mat = spec.vocab * spec.hidden
    mine = {"emb+head": c.active + (0 if spec.tie_embeddings else c.embedding), "head": c.active}
    mine["layers"] = c.active - head_mat
    for got, want in ((c.total, total), (mine[convention], active)):
        if isinstance(want, tuple):  # a truncated count: the card's digits, then anything up to the next unit
            assert want[0] <= got < want[1], (name, got, want, source)
        else:
            assert abs(got / want - 1) <= _tolerance(want), (name, got, want, source)


def test_family_layouts_are_read_layer_by_layer():
    v3 = from_hf_config(DEEPSEEK_V3)
    assert (v3.first_k_dense, v3.num_shared_experts, v3.expert_groups, v3.groups_per_token) == (3, 1, 8, 4)
    assert v3.mtp_layers == 1 and v3.attention == "mla" and v3.router_bias
    mav = from_hf_config(LLAMA4_MAVERICK)
    assert [i for i, k in enumerate(mav.layer_kinds()) if k[1] == "moe"] == list(range(1, 48, 2))
    assert (mav.ffn_hidden, mav.moe_ffn_hidden, mav.num_shared_experts) == (16384, 8192, 1)
    jamba = from_hf_config(JAMBA_V01)
    kinds = jamba.layer_kinds()
    assert [i for i, k in enumerate(kinds) if k[0] == "mha"] == [4, 12, 20, 28]
    assert [i for i, k in enumerate(kinds) if k[1] == "moe"] == list(range(1, 32, 2))
    dbrx = from_hf_config(DBRX)
    assert (dbrx.hidden, dbrx.num_layers, dbrx.kv_heads, dbrx.num_experts, dbrx.top_k) == (6144, 40, 8, 16, 4)


def test_jamba_mamba_mixer_parameters_follow_the_hf_modeling_code():
    """in_proj, conv1d (+bias), x_proj, dt_proj (+bias), A_log, D, out_proj, dt/B/C norms (JambaMambaMixer)."""
    spec = from_hf_config(JAMBA_V01)
    mamba = next(i for i, k in enumerate(spec.layer_kinds()) if k == ("mamba", "dense"))
    attn = next(i for i, k in enumerate(spec.layer_kinds()) if k == ("mha", "dense"))
    h, di, n, r = 4096, 8192, 16, 256
    mixer = h * 2 * di + di * 4 + di + di * (r + 2 * n) + r * di + di + di * n + di + di * h + r + 2 * n
    gqa = 2 * h * h + 2 * h * 1024
    kinds = spec.layer_kinds()
    assert layer_stats(spec, kinds[mamba]).dense_params - layer_stats(spec, kinds[attn]).dense_params == mixer - gqa


def test_mtp_layers_are_read_and_kept_out_of_the_published_counts():
    with_mtp, without = from_hf_config(DEEPSEEK_V3), from_hf_config(DEEPSEEK_V3 | {"num_nextn_predict_layers": 0})
    assert with_mtp.mtp_layers == 1 and param_counts(with_mtp) == param_counts(without)


def test_hf_model_is_named_after_its_own_fields_not_its_folder(tmp_path):
    folder = tmp_path / "checkpoint-123"
    folder.mkdir()
    assert _load(MIXTRAL_8X7B, folder).name == "mistralai/Mixtral-8x7B-v0.1"
    no_path = {k: v for k, v in MIXTRAL_8X7B.items() if k != "_name_or_path"}
    assert _load(no_path, folder).name == "mixtral MixtralForCausalLM"


def test_shared_expert_and_latent_widths_under_other_names_are_read():
    step = QWEN2_57B_A14B | {"share_expert_dim": 2560, "shared_expert_intermediate_size": None}
    assert from_hf_config(step).num_shared_experts == 1  # Step-3.x: one shared MLP of share_expert_dim
    nemotron = QWEN2_57B_A14B | {"n_shared_experts": 2, "moe_shared_expert_intermediate_size": 5120}
    nemotron["shared_expert_intermediate_size"] = None
    assert from_hf_config(nemotron).num_shared_experts == 4  # two shared MLPs, each two expert widths
    granite = QWEN2_57B_A14B | {"shared_intermediate_size": 1024, "shared_expert_intermediate_size": None}
    spec = from_hf_config(granite)  # not a whole number of expert widths: the shared MLP keeps its own width
    assert (spec.num_shared_experts, spec.shared_ffn_hidden, spec.shared_width) == (0, 1024, 1024)
    muse = QWEN2_57B_A14B | {"moe_hidden_size": 1792}  # Muse Spark: experts behind a down/up projection
    assert from_hf_config(muse).moe_latent_dim == 1792 and from_hf_config(QWEN2_57B_A14B).moe_latent_dim == 0


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"expert_ffn_dim": 4096}, "expert_ffn_dim"),  # a size we do not read would misprice the experts
        ({"model_type": "doge"}, "'doge' is not expressible"),
        ({"model_type": "jetmoe"}, "'jetmoe' is not expressible"),
    ],
)
def test_expert_shapes_we_cannot_price_are_refused(change: dict, named: str):
    with pytest.raises(ValueError, match=named):
        from_hf_config(QWEN2_57B_A14B | change)

"""transformers' own config classes, swept (issue 27's "every HF MoE config read right", on configs we did not
write): every class that names experts, Mamba or per-layer kinds either loads with each layer priced as its
config says and with the parameter count of the transformers model built from it on the meta device, or is
refused with a ValueError (exit 2 at the CLI). transformers is the real package ``make test`` installs."""

from __future__ import annotations

import contextlib
import functools
import io
import json
import warnings

import pytest
import torch
import transformers  # the dev extra: make test installs it, so a missing install fails here instead of skipping

from simulator.hf_families import EXPERT_WIDTH_IS_INTERMEDIATE
from simulator.hf_layer_kinds import ATTENTION, MOE_MLP_KINDS, RECURRENT
from simulator.layers import param_counts
from simulator.specs import from_hf_config

pytestmark = pytest.mark.filterwarnings("ignore:HF config. expert fields not read")
WORDS = ("expert", "moe", "mamba", "layer_types", "hybrid_override", "block_type")


@functools.cache
def _configs() -> tuple:
    """(model_type, config object, text config dict, whether the config is multimodal) of every class whose
    default config names ``WORDS``."""
    return tuple(_each_config())


def _each_config():
    for model_type in sorted(transformers.CONFIG_MAPPING.keys()):
        try:
            with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
                warnings.simplefilter("ignore")
                obj = transformers.CONFIG_MAPPING[model_type]()
                cfg = obj.to_dict()
        except Exception:  # a config class that needs arguments is not a case here
            continue
        if any(w in json.dumps(cfg, default=str) for w in WORDS):
            multimodal = isinstance(cfg.get("text_config"), dict)
            yield model_type, obj, cfg["text_config"] if multimodal else cfg, multimodal


def _loads_as_priced(cfg: dict) -> bool:
    """Whether ``cfg`` loads; a load must price every layer as what the config says it is."""
    try:
        spec = from_hf_config(cfg)
    except ValueError:
        return False
    types = cfg.get("layer_types") or []
    assert set(types) <= set(ATTENTION) | set(RECURRENT), types
    assert set(cfg.get("block_types") or []) <= {"attention"}, cfg["block_types"]  # RecurrentGemma's cycle
    recurrent = tuple(sorted(spec.kda_layers + spec.mamba_layers))
    assert not types or tuple(i for i, t in enumerate(types) if t in RECURRENT) == recurrent
    kinds = cfg.get("mlp_layer_types")
    if kinds:
        assert [f == "moe" for _, f in spec.layer_kinds()] == [k in MOE_MLP_KINDS for k in kinds]
    blocks = cfg.get("layers_block_type") or []
    if "moe" in blocks or "mlp" in blocks:  # a single-block hybrid (Nemotron-H): one block per layer
        got = [(m == "mamba", m == "none", f == "moe", f == "none") for m, f in spec.layer_kinds()]
        ffn = ("moe", "mlp")
        assert got == [(b in RECURRENT, b in ffn, b == "moe", b not in ffn) for b in blocks], (blocks, got)
    return True


def test_every_moe_or_hybrid_config_loads_as_priced_or_is_refused():
    """Each loads with every layer priced as the config states, or raises ValueError: never another exception,
    never softmax attention in place of a recurrent layer."""
    results = [_loads_as_priced(text) for _, _, text, _ in _configs()]
    assert sum(results) >= 20 and results.count(False) >= 10, results


def _meta_params(obj) -> int | None:
    """Parameters of transformers' causal LM built from ``obj`` on the meta device (None: it does not build)."""
    try:
        with torch.device("meta"), warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            model = transformers.AutoModelForCausalLM.from_config(obj)
    except Exception:  # transformers' own default for some families does not build (a bug there, not a case here)
        return None
    return sum(p.numel() for p in model.parameters())


def test_every_loaded_config_has_the_parameters_of_its_transformers_model():
    """Total parameters within 1% of the transformers model (biases, norms and gate vectors are the rest); a
    dense multimodal config is left out, its causal LM holding the vision or audio tower too."""
    checked, off = 0, []
    for model_type, obj, text, multimodal in _configs():
        try:
            spec = from_hf_config(text)
        except ValueError:
            continue
        recurrent = spec.num_experts or spec.mamba_layers or spec.kda_layers
        hf = _meta_params(obj) if recurrent or not multimodal else None
        if hf:
            checked += 1
            ratio = param_counts(spec).total / hf
            if abs(ratio - 1) > 0.01:
                off.append((model_type, round(ratio, 4)))
    assert checked >= 25 and not off, (checked, off)


def test_only_families_not_known_to_size_experts_by_intermediate_size_warn():
    """Each loading MoE family of the installed transformers whose experts are ``intermediate_size`` wide is in
    ``EXPERT_WIDTH_IS_INTERMEDIATE`` and loads without the width warning; a family with ``moe_intermediate_size``
    is not in it. (A family newer than the list warns, and is still priced as its parameter count says above.)"""
    checked = 0
    for model_type, _, text, _ in _configs():
        with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("always")
            try:
                spec = from_hf_config(text)
            except ValueError:
                continue
        said = [str(w.message) for w in caught if "has no moe_intermediate_size" in str(w.message)]
        kind = text.get("model_type")
        if not spec.is_moe:
            continue
        if text.get("moe_intermediate_size") is not None:
            assert kind not in EXPERT_WIDTH_IS_INTERMEDIATE and not said, (model_type, said)
        elif kind in EXPERT_WIDTH_IS_INTERMEDIATE:
            assert not said, (model_type, said)
            checked += 1
        else:
            assert said and repr(kind) in said[0], (model_type, kind)
    assert checked >= 10, checked

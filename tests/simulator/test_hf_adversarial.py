"""A config.json we did not write, with any field broken: ``from_hf_config`` loads it or raises ``ValueError``
(one line at the CLI, exit 2), never another exception. The configs are transformers' own defaults of the families
the loader reads (the real package, installed by ``make test``); hypothesis picks up to three fields and a value
of the wrong sign, size or type for each."""

from __future__ import annotations

import contextlib
import functools
import io
import json
import warnings

import pytest
import transformers  # the dev extra: make test installs it, so a missing install fails here instead of skipping
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moonep.console import main
from simulator.specs import from_hf_config

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "olmoe", "dbrx", "jamba", "ernie4_5_moe", "gpt_oss")
FAMILIES += ("llama4_text", "granitemoe", "qwen3_next", "nemotron_h", "falcon_h1", "qwen2", "llama")
NOT_READ = ("model_type", "architectures", "transformers_version", "dtype", "torch_dtype")
BROKEN = st.sampled_from([0, -1, 1, 3, 10**15, 1.5, float("nan"), float("inf"), "x", "8", None, True, [], [1, 2], {}])


@functools.cache
def defaults() -> dict[str, dict]:
    """transformers' default config of each family, built by the first test that needs them (about 3 s: not at
    collection, where every worker would pay it)."""
    out = {}
    for kind in FAMILIES:
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            out[kind] = transformers.CONFIG_MAPPING[kind]().to_dict()
    return out


@st.composite
def broken_configs(draw) -> dict:
    cfg = dict(defaults()[draw(st.sampled_from(FAMILIES))])
    fields = sorted(k for k, v in cfg.items() if k not in NOT_READ and not isinstance(v, (dict, bool, str)))
    for key in draw(st.lists(st.sampled_from(fields), min_size=1, max_size=3, unique=True)):
        cfg[key] = draw(BROKEN)
    return cfg


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(broken_configs())
def test_a_broken_config_loads_or_is_a_value_error(cfg: dict):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the loader's one-line notes on fields it does not read
        try:
            spec = from_hf_config(cfg)
        except ValueError as exc:
            assert str(exc).startswith("HF config") and "\n" not in str(exc).strip(), exc
            return
    assert spec.hidden > 0 and spec.num_layers > 0 and spec.num_heads > 0


@pytest.mark.parametrize(
    "family, change, named",
    [
        ("qwen3_moe", {"num_attention_heads": 0, "head_dim": None}, "num_attention_heads"),
        ("olmoe", {"num_attention_heads": 0}, "num_attention_heads"),
        ("jamba", {"mamba_dt_rank": "8"}, "mamba_dt_rank"),
        ("jamba", {"mamba_dt_rank": {}}, "mamba_dt_rank"),
    ],
)
def test_fields_that_once_escaped_as_tracebacks_are_named_exit_2(tmp_path, capsys, family, change, named):
    """A zero head count divided the hidden size, a non-numeric ``mamba_dt_rank`` was compared with 1."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(defaults()[family] | change))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rc = main(["simulate", "run", "--model", str(path), "--gpus", "8"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("error: HF config") and "\n" not in err and named in err, err

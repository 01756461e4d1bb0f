"""``moonep simulate run`` / ``search`` print and write the assumptions they used (sequence length, global batch
in tokens and sequences, precision, FLOP convention, each from a flag or a default) and the model's own name; a bad
HF config is one line naming its HF field, exit 2 (issue 27)."""

from __future__ import annotations

import json

import pytest

from moonep.console import main
from tests.simulator.hf_moe_config_data import MIXTRAL_8X7B, QWEN2_57B_A14B


def _config(tmp_path, cfg: dict) -> str:
    folder = tmp_path / "checkpoint-42"  # a folder name the model must not be called after
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    return str(folder / "config.json")


def test_search_prints_its_defaults_and_the_hf_model_name(tmp_path, capsys):
    out = tmp_path / "s.json"
    argv = ["simulate", "search", "--model", _config(tmp_path, MIXTRAL_8X7B), "--gpus", "64", "--hardware", "h100"]
    rc = main(
        [
            *argv,
            "--top",
            "2",
            "--event-top",
            "0",
            "--schedules",
            "1f1b",
            "--recompute-modes",
            "full",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    said = capsys.readouterr().out
    assert "mistralai/Mixtral-8x7B-v0.1" in said and "checkpoint-42" not in said.split("FLOP")[0].split(";", 1)[1]
    assert "seq_len 8192 (default" in said and "16,777,216 tokens = 2048 sequences (default" in said
    assert "precision bf16 (default" in said and "full square" in said and "causal" in said
    data = json.loads(out.read_text())
    a = data["assumptions"]
    assert data["model"] == a["model"]["value"] == "mistralai/Mixtral-8x7B-v0.1"
    assert a["global_batch"]["tokens"] == a["global_batch"]["sequences"] * a["seq_len"]["value"] == 2**24
    assert a["precision"]["from"].startswith("default") and a["seq_len"]["from"].startswith("default")


def test_run_names_the_flags_it_was_given(tmp_path, capsys):
    out = tmp_path / "r.json"
    argv = ["simulate", "run", "--model", "llama3-8b", "--gpus", "8", "--hardware", "h100", "--precision", "fp8"]
    rc = main([*argv, "--seq-len", "4096", "--global-batch-tokens", str(2**21), "--json", str(out)])
    assert rc in (0, 1)
    said = capsys.readouterr().out
    assert "seq_len 4096 (flag --seq-len)" in said and "= 512 sequences (flag --global-batch-tokens)" in said
    assert "precision fp8 (flag --precision)" in said
    assert "gradients reduced once a step (default: with --zero 1, unsharded gradients)" in said
    a = json.loads(out.read_text())["assumptions"]
    assert (a["seq_len"]["value"], a["global_batch"]["sequences"], a["precision"]["value"]) == (4096, 512, "fp8")
    assert a["model"]["value"] == "llama3-8b"


@pytest.mark.parametrize(
    "flags, said_as",
    [
        (["--zero", "2"], "every micro-batch (default: with --zero 2, sharded gradients)"),
        (["--zero", "3", "--grad-reduce", "step"], "once a step (flag --grad-reduce step)"),
        (["--grad-reduce", "microbatch"], "every micro-batch (flag --grad-reduce microbatch)"),
    ],
)
def test_run_says_when_the_gradients_are_reduced(flags, said_as, tmp_path, capsys):
    """ZeRO >= 2 changes the default (sharded gradients are reduced after every backward), so the plan says it."""
    out = tmp_path / "r.json"
    argv = ["simulate", "run", "--model", "llama3-8b", "--gpus", "16", "--hardware", "h100", "--json", str(out)]
    assert main([*argv, *flags]) in (0, 1)
    assert f"gradients reduced {said_as}" in capsys.readouterr().out
    a = json.loads(out.read_text())["assumptions"]["gradient_reduction"]
    assert f"{a['value']} ({a['from']})" == said_as


@pytest.mark.parametrize(
    "hardware, flags, said_as",
    [
        ("h100", [], "grad reduce + param gather (default: both, as Megatron-Bridge's recipes set them)"),
        ("h100", ["--no-overlap-grad-reduce"], "param gather (flag --no-overlap-grad-reduce)"),
        ("h100", ["--no-overlap-grad-reduce", "--no-overlap-param-gather"], "none (flag --no-overlap-grad-reduce "
         "--no-overlap-param-gather)"),
        ("a100", [], "none (hardware a100-80g: its efficiency set (dp_overlap 0) hides no DP traffic)"),
    ],
)  # fmt: skip
def test_run_and_search_say_which_dp_collectives_overlap(hardware, flags, said_as, tmp_path, capsys):
    """Whether the DP collectives hide behind compute moves the step; the plan says what it assumed, and search
    keeps the flags in every layout it ranks."""
    out = tmp_path / "r.json"
    job = ["--model", "llama3-8b", "--gpus", "16", "--hardware", hardware, "--json", str(out), *flags]
    assert main(["simulate", "run", *job]) in (0, 1)
    assert f"DP overlap {said_as}" in capsys.readouterr().out
    a = json.loads(out.read_text())["assumptions"]["dp_overlap"]
    assert f"{a['value']} ({a['from']})" == said_as
    assert main(["simulate", "search", *job, "--top", "2"]) == 0
    report = json.loads(out.read_text())
    assert report["assumptions"]["dp_overlap"] == a
    for r in report["results"]:
        assert r["parallel"]["overlap_grad_reduce"] == ("--no-overlap-grad-reduce" not in flags)


@pytest.mark.parametrize(
    "change, named",
    [
        ({"num_experts_per_tok": 70}, "num_experts_per_tok=70"),
        ({"num_local_experts": 32}, "num_local_experts=32"),
        ({"moe_intermediate_size": 0}, "moe_intermediate_size"),
        ({"moe_intermediate_size": "big"}, "moe_intermediate_size"),
        ({"moe_experts_total": 4, "num_experts": None}, "moe_experts_total"),
    ],
)
def test_a_bad_hf_config_is_one_line_naming_the_field_exit_2(tmp_path, capsys, change: dict, named: str):
    rc = main(["simulate", "run", "--model", _config(tmp_path, QWEN2_57B_A14B | change), "--gpus", "8"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("error: ") and "\n" not in err and named in err, err
    assert "ModelSpec" not in err and "moe_ffn_hidden" not in err

"""The activation-memory recipe flags of `moonep simulate run` reach the model: `--moe-probs combine` keeps the
expert outputs, `--attn-out-cache e5m6` shrinks the attention-output copies of an fp8 run, `--attn-res-impl
release` prices K3's released AttnRes stacks; a bad value is one usage error naming the flag."""

import json

import pytest

from moonep.console import main

DSV3 = ["--model", "deepseek-v3", "--hardware", "h800", "--gpus", "2048", "--pp", "16", "--ep", "64", "--precision"]
DSV3 += ["fp8", "--seq-len", "4096", "--global-batch-tokens", str(15360 * 4096), "--dispatcher", "deepep"]
K3 = ["--model", "k3", "--hardware", "h200", "--gpus", "4096", "--pp", "16", "--ep", "64"]


def _activations(tmp_path, args: list[str]) -> float:
    out = tmp_path / "r.json"
    main(["simulate", "run", *args, "--recompute", "selective", "--json", str(out)])
    return json.loads(out.read_text())["memory_breakdown_gib"]["activations"]


@pytest.mark.parametrize(
    ("base", "flag", "value", "grows"),
    [
        (DSV3, "--moe-probs", "combine", True),
        (DSV3, "--attn-out-cache", "e5m6", False),
        (K3, "--attn-res-impl", "release", True),
    ],
)
def test_flag_moves_activation_memory(tmp_path, base, flag, value, grows):
    before, after = _activations(tmp_path, base), _activations(tmp_path, [*base, flag, value])
    assert (after > before) if grows else (after < before), (flag, before, after)


@pytest.mark.parametrize("flag", ["--moe-probs", "--attn-out-cache", "--attn-res-impl"])
def test_bad_value_is_a_usage_error(capsys, flag):
    with pytest.raises(SystemExit) as info:
        main(["simulate", "run", *K3, flag, "bogus"])
    assert info.value.code == 2 and flag in capsys.readouterr().err

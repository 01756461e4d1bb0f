"""``moonep simulate saved-bytes``: the simulator's saved bytes by module alone, and one-line refusals of a
measured report it cannot read (the side by side with a real bench report is in tests/k3/test_saved_memory.py)."""

from __future__ import annotations

import json

import pytest

from moonep.console import main
from simulator.layers import layer_stats
from simulator.saved_bytes import MODULES
from simulator.specs import load_model


def test_alone_it_prints_the_simulator_row(tmp_path, capsys):
    path = tmp_path / "t.json"
    assert main(["simulate", "saved-bytes", "--model", "deepseek-v3", "--json", str(path)], packages=["simulator"]) == 0
    table = json.loads(path.read_text())
    assert table["measured"] == [] and table["modules"] == list(MODULES)
    stats = layer_stats(load_model("deepseek-v3"), ("kda", "moe"))
    assert table["simulator"]["kda_layer"] == stats.act_rep + stats.act_par
    assert table["model"] == "deepseek-v3" and "simulator deepseek-v3" in capsys.readouterr().out


@pytest.mark.parametrize(
    "content,named",
    [
        (None, "cannot read"),
        ("{not json", "cannot read"),
        (json.dumps({"results": []}), "is not a 'moonep bench k3-memory --json' report"),
        (json.dumps({"k3": [{"mla": 1.0}]}), "is not a 'moonep bench k3-memory --json' report"),
    ],
)
def test_a_report_it_cannot_read_is_one_line(tmp_path, capsys, content, named):
    path = tmp_path / "m.json"
    if content is not None:
        path.write_text(content)
    assert main(["simulate", "saved-bytes", "--measured", str(path)], packages=["simulator"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("moonep simulate saved-bytes: ") and named in err and err.count("\n") == 1, err

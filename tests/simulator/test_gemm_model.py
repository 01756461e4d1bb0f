"""GEMM efficiency from shapes: roofline, tile padding, wave quantisation, fp8 casts (simulator.gemm_model)."""

import pathlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simulator.gemm_model import K_REF, TILES, efficiency, gemm_seconds, pass_seconds, speedup_fp8
from simulator.gemm_shapes import (
    dense_seconds,
    efficiency_table,
    format_efficiency_table,
    layer_gemms,
    roof_for,
)
from simulator.hardware import load_hardware
from simulator.layers import layer_stats
from simulator.specs import load_model

README = pathlib.Path(__file__).resolve().parents[2] / "simulator" / "README.md"
HW = ("a100", "h100", "h200", "b200")
sizes = st.integers(1, 40000)


def _roofs():
    for name in HW:
        hw = load_hardware(name)
        yield roof_for(hw, "bf16")
        if hw.fp8_tflops:
            yield roof_for(hw, "fp8")


ROOFS = tuple(_roofs())


@settings(max_examples=60, deadline=None)
@given(m=sizes, n=sizes, k=sizes, d=st.integers(1, 3000), axis=st.integers(0, 2), i=st.integers(0, len(ROOFS) - 1))
def test_more_work_never_takes_less_time(m, n, k, d, axis, i):
    roof = ROOFS[i]
    bigger = [m, n, k]
    bigger[axis] += d
    assert gemm_seconds(roof, *bigger) >= gemm_seconds(roof, m, n, k)


@settings(max_examples=60, deadline=None)
@given(m=sizes, n=sizes, k=sizes, g=st.integers(1, 64), i=st.integers(0, len(ROOFS) - 1))
def test_never_above_the_dtype_ceiling(m, n, k, g, i):
    assert 0 < efficiency(ROOFS[i], m, n, k, g) <= ROOFS[i].ceiling + 1e-12


@pytest.mark.parametrize("roof", ROOFS, ids=lambda r: f"{r.arch}-{r.sms}-{r.dtype}-{r.hbm:.3g}")
def test_whole_waves_reach_the_ceiling_and_efficiency_rises_with_k(roof):
    tm, tn, tk, _, per = TILES[(roof.arch, roof.dtype)][0]
    m, n = tm * roof.sms // per, tn * 4  # four whole waves of the largest tile
    assert efficiency(roof, m, n, K_REF) == pytest.approx(roof.ceiling)
    ks = [tk * j for j in (2, 4, 8, 16, 32)]
    effs = [efficiency(roof, m, n, k) for k in ks]
    assert effs == sorted(effs) and effs[0] < effs[-1]


@pytest.mark.parametrize("name", ["h100", "b200", "a100"])
def test_wave_quantisation_sawtooth(name):
    """One tile row more than a whole wave costs a second wave; the drop shrinks as waves add up."""
    roof = roof_for(load_hardware(name), "bf16")
    tm, tn, tk, _, per = TILES[(roof.arch, "bf16")][0]
    wave = tm * roof.sms // per
    drops = []
    for w in (1, 2, 4):
        full, over = efficiency(roof, w * wave, 4 * tn, 4096), efficiency(roof, w * wave + tm, 4 * tn, 4096)
        assert over < full
        drops.append(full - over)
    assert drops == sorted(drops, reverse=True)


@pytest.mark.parametrize("roof", ROOFS, ids=lambda r: f"{r.arch}-{r.sms}-{r.dtype}-{r.hbm:.3g}")
def test_one_row_is_memory_bound(roof):
    n = k = 8192
    a = 1.0 if roof.dtype == "fp8" else 2.0
    hbm_time = (k + k * n) * a / roof.hbm + n * 2.0 / roof.hbm
    assert gemm_seconds(roof, 1, n, k) == pytest.approx(hbm_time)
    assert efficiency(roof, 1, n, k) < 0.01


@pytest.mark.parametrize("name", ["h100", "h200", "b200"])
def test_fp8_speedup_between_one_and_two_and_rising_with_size(name):
    hw = load_hardware(name)
    bf16, fp8 = roof_for(hw, "bf16"), roof_for(hw, "fp8")
    ups = [speedup_fp8(bf16, fp8, s, s, s) for s in (2048, 4096, 8192, 16384)]
    assert all(1 < u < 2 for u in ups) and ups == sorted(ups)
    # MoE expert shapes (many small GEMMs) gain less than big dense GEMMs
    small = speedup_fp8(bf16, fp8, 2048, 2048, 768, 16)
    assert 1 < small < speedup_fp8(bf16, fp8, 8192, 4096, 7168, 4) < ups[-1]


def test_backward_costs_about_twice_the_forward_on_large_shapes():
    roof = roof_for(load_hardware("h100"), "bf16")
    fwd, bwd = pass_seconds(roof, 8192, 8192, 8192)
    assert bwd == pytest.approx(2 * fwd, rel=0.02)


@pytest.mark.parametrize("model", ["k3", "deepseek-v3", "llama3-70b", "qwen3-30b-a3b", "gpt-oss-120b", "kimi-k2"])
def test_shape_list_covers_every_dense_gemm_flop(model):
    spec = load_model(model)
    for kind in set(spec.layer_kinds()):
        listed = sum(2.0 * n * k for n, k, _ in layer_gemms(spec, kind))
        assert listed == pytest.approx(layer_stats(spec, kind).gemm_flops), kind


def test_higher_tp_runs_further_from_peak():
    spec, hw = load_model("llama3-70b"), load_hardware("h100")
    roof, kind, t = roof_for(hw, "bf16"), load_model("llama3-70b").layer_kinds()[0], 8192.0
    flops = layer_stats(spec, kind).gemm_flops * t
    eff = {tp: flops / tp / dense_seconds(spec, kind, roof, t, tp)[0] / roof.peak for tp in (1, 8)}
    assert eff[8] < eff[1] <= roof.ceiling * (1 + 1e-12)  # float rounding at the ceiling


def test_readme_table_is_the_model_output():
    assert format_efficiency_table(efficiency_table()) in README.read_text()

"""posenc.plot and ``posenc plot``: each figure's data against its formula, computed here from
first principles (mpmath, numpy float64), from a real server; and each figure rendered."""

from __future__ import annotations

import importlib.util
import math
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import mpmath
import numpy as np
import pytest
from conftest import ROOT
from reference import exact
from reference_tables import Rope, Sin, rope_frequencies, sinusoidal_exact

import posenc
from posenc import plot
from posenc.cli import main
from posenc_server.app import RunningServer

pytest.importorskip("matplotlib")


@pytest.fixture
def client(server: RunningServer) -> Any:
    with posenc.Client(server.target) as client:
        yield client


def png_size(path: Path) -> tuple[int, int]:
    """Width and height from a PNG's IHDR chunk."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", "not a PNG"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


EXPECTED_PIXELS = (900, 500)


def inv_freq(base: float, d_model: int) -> np.ndarray[Any, np.dtype[np.float64]]:
    """The paper's inverse frequencies, in float64."""
    return np.asarray(base ** (-np.arange(0, d_model, 2) / d_model), dtype=np.float64)


# -- precision drift ------------------------------------------------------------------------

DRIFT_POSITIONS = np.array([1, 3, 2**10, 10**6, 2**24 + 1, 2**31, 2**36 + 7, 2**42])


def test_drift_data_matches_the_exact_values(client: posenc.Client) -> None:
    d_model, base = 8, 10000.0
    data = plot.drift(client, posenc.Spec("sinusoidal", d_model=d_model), positions=DRIFT_POSITIONS)
    assert data.family is None  # no transformers module for the classic table
    # The naive table, computed here: float32(position) * float32(inv_freq), float32 sin/cos.
    naive, ours = [], []
    rows = client.get_positions(DRIFT_POSITIONS, d_model)  # float32, interleaved
    for row, position in enumerate(DRIFT_POSITIONS.tolist()):
        worst_naive = worst_ours = 0.0
        for column in range(d_model):
            i = column // 2
            div = np.float32(float(mpmath.mpf(base) ** (-mpmath.mpf(2 * i) / d_model)))
            angle = np.float32(position) * div
            value = np.sin(angle) if column % 2 == 0 else np.cos(angle)
            truth = exact(base, d_model, "interleaved", "paper", position, column)
            worst_naive = max(worst_naive, float(abs(mpmath.mpf(float(value)) - truth)))
            worst_ours = max(worst_ours, float(abs(mpmath.mpf(float(rows[row, column])) - truth)))
        naive.append(worst_naive)
        ours.append(worst_ours)
    np.testing.assert_allclose(data.naive, naive, rtol=1e-9, atol=1e-15)
    np.testing.assert_allclose(data.posenc, ours, rtol=1e-9, atol=1e-15)
    # posenc: within 1 ulp of float32 values in [-1, 1]; the naive table is not, far out.
    assert (data.posenc <= 2.0**-24).all()
    assert data.naive[DRIFT_POSITIONS >= 2**31].min() > 0.05
    assert data.naive[0] <= 2.0**-23


@pytest.mark.parametrize(
    "table",
    [
        Sin("whisper", 16, base=5000.0),
        Sin("fairseq", 16, padding_idx=3),
        Sin("tensor2tensor", 16, base=1e4, min_timescale=2.0, start_index=5),
        Sin("sinusoidal", 16, base=500.0, layout="interleaved"),
    ],
    ids=lambda table: table.kind,
)
def test_drift_of_each_sinusoidal_kind_matches_the_reference(
    client: posenc.Client, table: Sin
) -> None:
    spec = table.spec()
    if table.kind == "sinusoidal":  # the tensor2tensor schedule of the classic table
        spec = posenc.Spec("sinusoidal", **spec.parameters, schedule="tensor2tensor")
    positions = np.array([1, 3, 1000, 2**24 + 1, 2**31, 2**42 - 5])
    data = plot.drift(client, spec, positions=positions)
    kept = positions[positions != 3] if table.kind == "fairseq" else positions
    np.testing.assert_array_equal(data.positions, kept)  # fairseq's padding row is zero
    rows = client.get_positions(kept, spec)
    expected = []
    for row, position in enumerate(kept.tolist()):
        worst = 0.0
        for column in range(table.d_model):
            if table.kind == "sinusoidal":
                truth = exact(table.base, 16, "interleaved", "tensor2tensor", position, column)
            else:
                truth = sinusoidal_exact(table, position, column)
            worst = max(worst, float(abs(mpmath.mpf(float(rows[row, column])) - truth)))
        expected.append(worst)
    np.testing.assert_allclose(data.posenc, expected, rtol=1e-9, atol=1e-15)
    assert (data.posenc <= 2.0**-24).all()
    assert data.naive[0] <= 2.0**-22 and data.naive[kept >= 2**31].min() > 0.05


def test_drift_refuses_tables_it_has_no_exact_values_for(client: posenc.Client) -> None:
    with pytest.raises(ValueError, match="without scaling"):
        plot.drift(client, posenc.Spec("rotary", head_dim=8, scaling="linear", factor=2.0))
    for d_model in (7, 8192):
        with pytest.raises(ValueError, match="even d_model from 2 to 4096"):
            plot.drift(client, posenc.Spec("sinusoidal", d_model=d_model))
    with pytest.raises(ValueError, match="even d_model from 2 to 4096"):
        plot.heatmap(client, 65536)


@pytest.mark.slow  # imports torch and transformers
def test_drift_of_a_rotary_table_includes_transformers_own(client: posenc.Client) -> None:
    pytest.importorskip("transformers")
    import torch

    head_dim, theta = 16, 500000.0
    spec = posenc.Spec("rotary", head_dim=head_dim, rope_theta=theta)
    data = plot.drift(client, spec, positions=DRIFT_POSITIONS)
    assert data.family is not None
    # transformers' default rope in float32, written out: inv_freq, then position * inv_freq.
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    angle = torch.as_tensor(DRIFT_POSITIONS).float()[:, None] * inv[None, :]
    expected = []
    for row, position in enumerate(DRIFT_POSITIONS.tolist()):
        worst = 0.0
        for i in range(head_dim // 2):
            truth = position * theta ** (-mpmath.mpf(2 * i) / head_dim)
            for theirs, exact_value in (
                (torch.cos(angle[row, i]), mpmath.cos(truth)),
                (torch.sin(angle[row, i]), mpmath.sin(truth)),
            ):
                worst = max(worst, float(abs(mpmath.mpf(float(theirs)) - exact_value)))
        expected.append(worst)
    np.testing.assert_allclose(data.family, expected, rtol=1e-6, atol=1e-12)
    assert (data.posenc <= 2.0**-24).all()
    assert data.family[DRIFT_POSITIONS >= 2**31].min() > 0.05


# -- rotary scaling -------------------------------------------------------------------------


def test_rope_scalings_match_the_scaling_formulas(client: posenc.Client) -> None:
    head_dim, theta, factor, original = 32, 500000.0, 8.0, 8192
    data = plot.rope_scalings(client, head_dim, theta, factor=factor, original=original)
    half = head_dim // 2
    short = [1.0 + 0.05 * i / (half - 1) for i in range(half)]
    long = [1.0 + 60.0 * (i / (half - 1)) ** 2 for i in range(half)]
    shared: dict[str, Any] = {"head_dim": head_dim, "rope_theta": theta}
    longrope: dict[str, Any] = {
        **shared,
        "rope_type": "longrope",
        "original_max_position_embeddings": original,
        "max_position_embeddings": 65536,
        "short_factor": tuple(short),
        "long_factor": tuple(long),
    }
    expected = {
        "default": Rope(**shared),
        "linear x8": Rope(**shared, rope_type="linear", factor=factor),
        "dynamic, seq_len 32768": Rope(
            **shared, rope_type="dynamic", factor=factor, max_position_embeddings=original,
            seq_len=32768,
        ),
        "dynamic, seq_len 131072": Rope(
            **shared, rope_type="dynamic", factor=factor, max_position_embeddings=original,
            seq_len=131072,
        ),
        "yarn x8": Rope(
            **shared, rope_type="yarn", factor=factor, original_max_position_embeddings=original
        ),
        "llama3 x8": Rope(
            **shared, rope_type="llama3", factor=factor,
            original_max_position_embeddings=original, low_freq_factor=1.0, high_freq_factor=4.0,
        ),
        "longrope short": Rope(**longrope, seq_len=original),
        "longrope long": Rope(**longrope, seq_len=65536),
    }  # fmt: skip
    assert list(data.inv_freq) == list(expected)
    for label, rope in expected.items():
        frequencies, _ = rope_frequencies(rope)
        np.testing.assert_allclose(
            data.inv_freq[label], [float(f) for f in frequencies], rtol=1e-7, err_msg=label
        )
    default = data.inv_freq["default"]
    np.testing.assert_allclose(default, inv_freq(theta, head_dim), rtol=1e-9)
    # Llama 3 keeps the highest frequency and divides the lowest by the factor.
    llama3 = data.inv_freq["llama3 x8"]
    assert llama3[0] == pytest.approx(default[0], rel=1e-9)
    assert llama3[-1] == pytest.approx(default[-1] / factor, rel=1e-7)


# -- sinusoidal properties ------------------------------------------------------------------


def test_heatmap_rows_and_closest_distances_match_the_formulas(client: posenc.Client) -> None:
    d_model, base, span = 16, 100.0, 300
    data = plot.heatmap(client, d_model, base, rows=64, span=span)
    omega = inv_freq(base, d_model)
    angles = np.arange(64)[:, None] * omega[None, :]
    expected = np.empty((64, d_model))
    expected[:, 0::2], expected[:, 1::2] = np.sin(angles), np.cos(angles)
    np.testing.assert_allclose(data.table, expected, atol=1e-12)
    # |PE(p) - PE(p + k)|^2 = sum_i 4 sin^2(k omega_i / 2): it depends on k alone.
    ks = np.arange(1, span)
    by_shift = np.sqrt((4 * np.sin(ks[:, None] * omega[None, :] / 2) ** 2).sum(axis=1))
    np.testing.assert_allclose(data.closest, by_shift, atol=1e-6)
    assert data.min_distance == pytest.approx(by_shift.min(), abs=1e-6)
    assert data.min_distance > 0.1  # distinct rows stay apart


def test_rotation_residual_is_zero_to_the_contract(client: posenc.Client) -> None:
    positions = np.array([0, 5, 2**20, 2**33 + 3, 2**41])
    data = plot.rotation(client, 16, 10000.0, shifts=(1, 999, 2**40), positions=positions)
    assert list(data.residual) == [1, 999, 2**40]
    for k, residual in data.residual.items():
        # Three rows, each within 2**-50: a handful of 2**-50 at most.
        assert residual.max() <= 4 * 2.0**-50, (k, residual)
        # The naive float32 table is no rotation far out: the check can fail.
        naive = data.naive[k]
        assert naive[0] < 1e-5 and naive[positions >= 2**33].min() > 1e-2, (k, naive)


def test_similarity_matches_the_mean_cosine(client: posenc.Client) -> None:
    d_model, start = 32, 123_456_789
    shifts = np.array([0, 1, 2, 10, 100, 1000, 10**5])
    data = plot.similarity(client, d_model, (100.0, 10000.0), start=start, shifts=shifts)
    for base, values in data.similarity.items():
        # PE(p) . PE(p + k) = sum_i cos(k omega_i), and |PE| = sqrt(d_model / 2): p drops out.
        expected = np.cos(shifts[:, None] * inv_freq(base, d_model)[None, :]).mean(axis=1)
        np.testing.assert_allclose(values, expected, atol=1e-12, err_msg=str(base))
    assert data.similarity[100.0][0] == pytest.approx(1.0)


def test_wavelengths_run_from_two_pi_to_two_pi_base(client: posenc.Client) -> None:
    d_model = 64
    data = plot.wavelengths(client, d_model, plot.BASES)
    for base, values in data.wavelength.items():
        expected = 2 * math.pi * base ** (np.arange(0, d_model, 2) / d_model)
        np.testing.assert_allclose(values, expected, rtol=1e-9, err_msg=str(base))
        assert values[0] == pytest.approx(2 * math.pi) and values[-1] < 2 * math.pi * base


# -- rendering and the command --------------------------------------------------------------


@pytest.mark.slow  # seven figures drawn by matplotlib: about 3 s
def test_every_figure_renders_a_png_of_the_expected_size(
    client: posenc.Client, tmp_path: Path
) -> None:
    small = np.array([1, 2**20, 2**42])
    figures = {
        "drift": plot.draw_drift(
            plot.drift(client, posenc.Spec("sinusoidal", d_model=8), positions=small)
        ),
        "rope-scaling": plot.draw_scalings(plot.rope_scalings(client, 16)),
        "heatmap": plot.draw_heatmap(plot.heatmap(client, 8, rows=16, span=64)),
        "rotation": plot.draw_rotation(
            plot.rotation(client, 8, shifts=(1, 7), positions=small // 4)
        ),
        "similarity": plot.draw_similarity(plot.similarity(client, 8, shifts=np.arange(1, 50))),
        "wavelength": plot.draw_wavelengths(plot.wavelengths(client, 8)),
        "table": plot.draw_table(
            plot.table_rows(client, posenc.Spec("mrope", head_dim=16, mrope_section=[2, 3, 3]))
        ),
        "grid-drift": plot.draw_grid_drift(
            plot.grid_drift(client, plot.default_spec("grid-drift"), sides=np.array([32, 48]))
        ),
    }
    assert set(figures) == set(plot.FIGURES)
    for name, drawn in figures.items():
        path = tmp_path / f"{name}.png"
        plot.render(drawn, path)
        assert png_size(path) == EXPECTED_PIXELS, name
        assert path.stat().st_size > 10_000, name  # axes, lines and labels, not a blank


@pytest.mark.slow  # imports matplotlib and draws two figures: 2 to 5 s
def test_plot_command_writes_png_and_svg(server: RunningServer, tmp_path: Path) -> None:
    png, svg = tmp_path / "w.png", tmp_path / "w.svg"
    for output in (png, svg):
        argv = ["plot", "wavelength", "--d-model", "16", "--bases", "100,1e4", "-o", str(output)]
        assert main([*argv, "--target", server.target]) == 0
    assert png_size(png) == EXPECTED_PIXELS
    assert svg.read_text().lstrip().startswith("<?xml") and "<svg" in svg.read_text()


def test_plot_command_reports_bad_usage(
    server: RunningServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = ["--target", server.target]
    with pytest.raises(SystemExit) as exit_info:
        main(["plot", "heatmap", "-o", str(tmp_path / "x.npy"), *target])
    assert exit_info.value.code == 2
    assert "posenc plot: error" in capsys.readouterr().err
    argv = ["plot", "heatmap", "--table", "whisper", "--d-model", "8"]
    code = main([*argv, "-o", str(tmp_path / "x.png"), *target])
    assert code == 1
    assert "classic sinusoidal" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


def test_plot_command_without_matplotlib_says_how_to_install_it(
    server: RunningServer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib: ImportError
    output = tmp_path / "w.png"
    assert main(["plot", "wavelength", "--target", server.target, "-o", str(output)]) == 2
    err = capsys.readouterr().err
    assert "needs the module matplotlib" in err and "[plot]" in err
    assert not output.exists()


def test_the_sdk_and_the_cli_never_import_matplotlib() -> None:
    code = (
        "import sys, posenc, posenc.cli, posenc.plot; "
        "print(sorted({'matplotlib', 'mpmath'} & set(sys.modules)))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]"


def test_the_figures_page_shows_every_picture_make_plots_draws() -> None:
    spec = importlib.util.spec_from_file_location("make_plots", ROOT / "scripts" / "make_plots.py")
    assert spec is not None and spec.loader is not None
    make_plots = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_plots)
    page = (ROOT / "docs" / "figures.md").read_text()
    drawn = {arguments[0] for arguments in make_plots.PICTURES.values()}
    assert drawn == set(plot.FIGURES), "make plots draws every kind of figure"
    for name in make_plots.PICTURES:
        picture = ROOT / "pictures" / f"{name}.png"
        assert png_size(picture) == EXPECTED_PIXELS, "run make plots"
        assert f"](pictures/{name}.png)" in page, name


def _g(value: float, digits: int = 1) -> str:
    """``value`` as docs/figures.md writes it: 2.7e-05 -> 3e-5, 0.026 -> 0.03."""
    return f"{value:.{digits}g}".replace("e-0", "e-")


@pytest.mark.slow  # the figures at full size, transformers included: ~20 s
def test_the_figures_page_quotes_the_figures_data(client: posenc.Client) -> None:
    pytest.importorskip("transformers")
    # Quoted numbers may be wrapped onto the next line.
    section = " ".join((ROOT / "docs" / "figures.md").read_text().split())

    def at(data: Any, position: int) -> int:
        return int(np.searchsorted(data.positions, position))

    quoted: list[str] = []
    classic = plot.drift(client, posenc.Spec("sinusoidal", d_model=512))
    quoted.append(f"half an ulp ({_g(classic.posenc.max())})")
    naive = [classic.naive[at(classic, 2**n)] for n in (10, 20, 24)]
    quoted.append(f"{_g(naive[0])} at 2^10, {_g(naive[1])} at 2^20, {_g(naive[2], 2)} at 2^24")
    rotary = plot.drift(client, posenc.Spec("rotary", head_dim=128, rope_theta=500000.0))
    assert rotary.family is not None
    family = [rotary.family[at(rotary, 2**n)] for n in (20, 24)]
    quoted.append(f"{_g(family[0])} at 2^20, {_g(family[1], 2)} at 2^24")

    scalings = plot.rope_scalings(client)
    stretch = {label: scalings.inv_freq["default"] / v for label, v in scalings.inv_freq.items()}

    def first(label: str, above: float) -> int:
        return int(np.argmax(stretch[label] > above))

    quoted.append(f"index below {first('llama3 x8', 1.01)} and {first('yarn x8', 1.01)}")
    quoted.append(f"(index {first('llama3 x8', 7.99)} on")
    quoted.append(f"to {stretch['dynamic, seq_len 32768'][-1]:.0f}x")
    quoted.append(f"{stretch['dynamic, seq_len 131072'][-1]:.0f}x at the last index")
    quoted.append(f"(to {stretch['longrope long'][-1]:.0f}x)")
    quoted.append(f"(at most {stretch['longrope short'].max():.3g}x)")

    quoted.append(f"closer than {plot.heatmap(client).min_distance:.3g}")
    turned = plot.rotation(client)
    largest = max(values.max() for values in turned.residual.values())
    quoted.append(f"and {_g(largest, 2)}, under 2^-50")
    quoted.append(f"off by {_g(turned.naive[1][at(turned, 2**20)])} at p = 2^20")
    alike = plot.similarity(client)
    drops = [int(alike.shifts[np.argmax(v < 0.2)]) for v in alike.similarity.values()]
    quoted.append(
        f"at k = {drops[0]} for base 100, {drops[1]} for 10,000 and "
        f"{float(f'{drops[2]:.2g}'):,.0f} for 500,000"
    )
    longest = [v[-1] for v in plot.wavelengths(client).wavelength.values()]
    quoted.append(f"{longest[0]:,.0f}, {longest[1]:,.0f} and {longest[2] / 1e6:.3g} million")
    grids = plot.grid_drift(client, plot.default_spec("grid-drift"))
    quoted.append(f"float32's rounding ({_g(grids.posenc.max())})")
    quoted.append(f"off by up to {_g(grids.float32_positions.max())}, thirty")
    assert round(grids.float32_positions.max() / grids.posenc.max(), -1) == 30
    missing = [text for text in quoted if text not in section]
    assert not missing, f"docs/figures.md is stale (make plots, then update): {missing}"


@pytest.mark.parametrize(
    "spec",
    [
        posenc.Spec("sincos_grid_2d", embed_dim=8, grid_height=4, grid_width=4),
        posenc.Spec(
            "sincos_grid_2d",
            embed_dim=8,
            grid_height=4,
            grid_width=4,
            base_size=4.0,
            height_first=True,
        ),
        posenc.Spec("sinusoidal", d_model=8),
    ],
)
def test_the_grid_drift_figure_refuses_grids_it_would_not_rebuild(
    client: posenc.Client, spec: posenc.Spec
) -> None:
    # Without a base_size the served positions are i / scale, and other parameters change
    # the layout or frequencies: the float32-position grid would be another grid.
    with pytest.raises(ValueError, match="base_size"):
        plot.grid_drift(client, spec)


@pytest.mark.parametrize(
    ("spec", "label"),
    [
        (posenc.Spec("rotary_axes", axes_dim=[4, 6, 6]), "coordinate"),
        (posenc.Spec("sincos_grid_2d", embed_dim=8, grid_height=4, grid_width=5), "cell"),
        (posenc.Spec("rotary", head_dim=8), "position"),
    ],
)
def test_the_table_figure_takes_every_kind(
    client: posenc.Client, spec: posenc.Spec, label: str
) -> None:
    """Its rows are the server's rows at the coordinates, cells or positions it names."""
    data = plot.table_rows(client, spec, rows=16)
    assert data.label.startswith(label)
    if label == "coordinate":  # a 4 x 4 square of (h, w), frame 0
        square = [(0, h, w) for h in range(4) for w in range(4)]
        expected = client.get_positions(square, spec, dtype="float64")
    elif label == "cell":
        expected = client.get_grid(spec, dtype="float64").reshape(20, -1)[:16]
    else:
        expected = client.get_range(0, 16, spec, dtype="float64")
    np.testing.assert_array_equal(data.rows, expected)

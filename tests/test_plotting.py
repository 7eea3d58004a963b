"""Attention plots: the drawn image holds the weights, files are written, bad shapes are refused."""

import numpy as np
import pytest

from attnlab import plotting


def test_heatmap_draws_the_weights_and_saves_png(tmp_path):
  w = np.random.default_rng(0).dirichlet(np.ones(5), size=3)  # [3 queries, 5 keys]
  fig = plotting.attention_heatmap(w, x_labels=list("abcde"), y_labels=["x", "y", "z"],
                                   path=tmp_path / "sub" / "map.png")
  np.testing.assert_allclose(np.asarray(fig.axes[0].images[0].get_array()), w, rtol=1e-6)
  assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == list("abcde")
  assert (tmp_path / "sub" / "map.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_grid_has_one_panel_per_layer_and_head(tmp_path):
  w = np.random.default_rng(1).random((2, 3, 4, 4))  # [layers, heads, q, k]
  fig = plotting.attention_grid(w, x_labels=list("abcd"), y_labels=list("abcd"),
                                path=tmp_path / "grid.png")
  panels = [ax for ax in fig.axes if ax.images]
  assert len(panels) == 6
  np.testing.assert_allclose(np.asarray(panels[4].images[0].get_array()), w[1, 1], rtol=1e-6)
  assert (tmp_path / "grid.png").stat().st_size > 0


def test_bad_shapes_are_refused():
  with pytest.raises(ValueError, match=r"must be \[rows, cols\]"):
    plotting.attention_heatmap(np.zeros((2, 3, 4)))
  with pytest.raises(ValueError, match="x_labels has 2 entries but the weights have 3"):
    plotting.attention_heatmap(np.zeros((2, 3)), x_labels=["a", "b"])
  with pytest.raises(ValueError, match="attention_grid expects"):
    plotting.attention_grid(np.zeros((4, 4)))


def test_devanagari_labels_draw_with_the_packaged_font(tmp_path):
  """The Marathi study's labels: a font with Devanagari glyphs comes with the install (the
  fontpkg-noto-sans-devanagari dependency) and matplotlib draws every glyph (no missing-glyph
  warning, which is what turned the labels into boxes)."""
  import warnings  # pylint: disable=g-import-not-at-top
  import matplotlib  # pylint: disable=g-import-not-at-top
  from matplotlib import font_manager  # pylint: disable=g-import-not-at-top
  label = "मी घरी जातो"  # Marathi: "I am going home"
  family = plotting.font_family(label)
  assert "Noto Sans Devanagari" in family, (family, "pip install -e . (fontpkg-noto-sans-devanagari)")
  path = font_manager.findfont(font_manager.FontProperties(family="Noto Sans Devanagari"),
                               fallback_to_default=False)
  assert "NotoSansDevanagari" in path
  with warnings.catch_warnings(record=True) as caught, matplotlib.rc_context(
      {"font.family": family}):
    warnings.simplefilter("always")
    fig = plotting.attention_heatmap(np.eye(3), x_labels=label.split(), y_labels=["a", "b", "c"],
                                     title=label, path=tmp_path / "marathi.png")
  assert not [w for w in caught if "missing from font" in str(w.message)], \
      [str(w.message) for w in caught]
  assert (tmp_path / "marathi.png").stat().st_size > 0


def _np_sinusoidal(length, dim):
  """Vaswani et al. 2017: P[i, 2j] = sin(i / 10000^(2j/dim)), P[i, 2j+1] = cos(same)."""
  pos = np.arange(length)[:, None]  # [length, 1]
  col = np.arange(dim)  # [dim]
  angle = pos / 10000.0 ** (2 * (col // 2) / dim)  # [length, dim]
  return np.where(col % 2 == 0, np.sin(angle), np.cos(angle))


@pytest.mark.parametrize("length", [10, 10000])
def test_plot_positions_command_writes_the_heatmap(tmp_path, monkeypatch, capsys, length):
  import matplotlib.image  # pylint: disable=g-import-not-at-top
  from attnlab import cli  # pylint: disable=g-import-not-at-top
  monkeypatch.chdir(tmp_path)  # --out defaults to positions.png in the current folder
  assert cli.main(["attnlab", "plot", "positions", f"--length={length}", "--dim=512"]) == 0
  assert "positions.png" in capsys.readouterr().out
  image = matplotlib.image.imread(tmp_path / "positions.png")  # [400, 600, RGBA] in [0, 1]
  assert image.shape[:2] == (400, 600)
  inner = image[60:340, 100:420, :3]  # a region inside the heatmap's axes
  red, blue = inner[..., 0] - inner[..., 2] > 0.25, inner[..., 2] - inner[..., 0] > 0.25
  table = _np_sinusoidal(length, 512)
  # RdBu on [-1, 1]: clearly red pixels are values below about -0.4, clearly blue above 0.4.
  assert abs(red.mean() - (table < -0.4).mean()) < 0.15, (red.mean(), (table < -0.4).mean())
  assert abs(blue.mean() - (table > 0.4).mean()) < 0.15, (blue.mean(), (table > 0.4).mean())
  assert red.mean() > 0.01 and blue.mean() > 0.2  # not blank


@pytest.mark.parametrize("args,words", [
    (["--dim=511"], "--dim must be a positive even integer"),
    (["--dim=0"], "--dim must be a positive even integer"),
    (["--length=-3"], "--length must be a positive integer"),
    (["--length=1.5"], "--length must be a positive integer, got '1.5'"),
    (["--dim=abc"], "--dim must be a positive integer, got 'abc'"),
    (["--out=p.jpg"], "--out must name a .png file"),
])
def test_plot_positions_bad_values_get_one_line(tmp_path, monkeypatch, capsys, args, words):
  from attnlab import cli  # pylint: disable=g-import-not-at-top
  monkeypatch.chdir(tmp_path)
  assert cli.main(["attnlab", "plot", "positions", "--length=10"] + args) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("attnlab plot: error: ") and words in err[0], err
  assert not list(tmp_path.iterdir())
  assert cli.main(["attnlab", "plot", "rings"]) == 2
  assert "positions" in capsys.readouterr().err

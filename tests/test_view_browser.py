"""The HTML attention viewer (attnlab.analysis.view, `attnlab view`) in a real headless Chromium.

Needs Debian's `chromium` and `chromium-driver` and the `selenium` package (.ci/run installs them):
  apt-get update && apt-get install -y chromium chromium-driver && pip install selenium
Without them the browser tests fail in CI (CI=true), where a viewer nobody loaded would go
untested, and skip elsewhere with that install line.
Screenshots go to pytest's tmp dir (the path is printed; run with -s to see it).
"""

import json
import os
import pathlib
import re
import shutil

import numpy as np
import pytest

from attnlab import cli
from attnlab import config_utils
from attnlab import train
from attnlab.analysis import view
from attnlab.analysis.capture import Capture

REPO = pathlib.Path(__file__).resolve().parents[1]
INSTALL = ("apt-get update && apt-get install -y chromium chromium-driver && pip install selenium "
           "(see .ci/run)")
ENC0, ENC1 = "encoder/layer_0/attention", "encoder/layer_1/attention"
DEC_SELF, CROSS = "decoder/layer_0/self_attention", "decoder/layer_0/cross_attention"
SOURCE = ["<s>", "june", "3", ",", "1998", "</s>"]
TARGET = ["<s>", "1998", "-", "06", "-", "03", "</s>"]


def _missing(message: str) -> None:
  """Fails in CI (CI=true: .ci/run installs the browser, so its absence is a broken set-up);
  elsewhere skips with the line that installs it, so the README's test command holds on a
  machine without Chromium."""
  if os.environ.get("CI", "").lower() in ("1", "true"):
    pytest.fail(message)
  pytest.skip(message)


def _softmax(logits):
  e = np.exp(logits - logits.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def _capture(rng=None) -> Capture:
  """An encoder-decoder capture: 2 encoder layers, causal decoder self-attention, cross-attention."""
  rng = rng or np.random.default_rng(0)

  def weights(heads, q_len, k_len, causal=False):
    logits = rng.normal(size=(heads, q_len, k_len)) * 2.5
    if causal:
      logits = np.where(np.tril(np.ones((q_len, k_len), bool)), logits, -np.inf)
    return _softmax(logits).astype(np.float32)  # [heads, q_len, k_len]
  s, t = len(SOURCE), len(TARGET)
  return Capture(
      tokens={"source": list(SOURCE), "target": list(TARGET)},
      weights={ENC0: weights(4, s, s), ENC1: weights(4, s, s), DEC_SELF: weights(4, t, t, True),
               CROSS: weights(4, t, s)},
      sides={ENC0: ("source", "source"), ENC1: ("source", "source"),
             DEC_SELF: ("target", "target"), CROSS: ("target", "source")},
      kind={ENC0: "self", ENC1: "self", DEC_SELF: "causal", CROSS: "cross"})


def _metrics(capture):
  """Hand-made rows shaped like analysis.metrics.head_table's."""
  rows = []
  for path, w in capture.weights.items():
    for h in range(w.shape[0]):
      p = w[h].astype(np.float64)
      entropy = float(-(p * np.log(np.where(p > 0, p, 1))).sum(-1).mean())
      rows.append({"layer": path, "head": h, "entropy": entropy,
                   "normalised_entropy": entropy / np.log(w.shape[2]),
                   "mean_offset": float(h) - 1.5, "mean_abs_offset": float(h),
                   "special_mass": float(p[:, 0].mean())})
  return rows


def _rounded(w):
  return np.rint(np.asarray(w, np.float64) * 1e4) / 1e4


# ---- the page as text -------------------------------------------------------------------------


def test_page_is_self_contained_and_escapes_script_end():
  capture = _capture()
  capture.tokens["source"][1] = "</script><script>alert(1)</script>"
  page = view.render_html(capture, _metrics(capture), title="a <b>title</b> %DATA%")
  assert page.count("</script>") == 2 and "alert(1)</script>" not in page
  assert "<title>a &lt;b&gt;title&lt;/b&gt; %DATA% · attnlab</title>" in page
  # Nothing is fetched: no external URL in a src/href, no import, no fetch.
  assert not re.search(r"(src|href)\s*=\s*[\"']?(https?:)?//", page)
  assert "fetch(" not in page and "@import" not in page
  blob = re.search(r'<script type="application/json" id="attn-data">(.*?)</script>', page, re.S)
  data = json.loads(blob.group(1))
  assert data["tokens"]["source"][1] == "</script><script>alert(1)</script>"
  assert [l["group"] for l in data["layers"]] == [
      "encoder self-attention", "encoder self-attention", "decoder self-attention",
      "cross-attention"]
  cross = data["layers"][3]
  assert (cross["q_side"], cross["k_side"], cross["heads"]) == ("target", "source", 4)
  np.testing.assert_array_equal(
      np.array(cross["w"]).reshape(4, len(TARGET), len(SOURCE)) / 1e4,
      _rounded(capture.weights[CROSS]))


def test_page_rejects_weights_that_do_not_fit_the_tokens():
  capture = _capture()
  capture.weights[CROSS] = capture.weights[CROSS][:, :, :-1]
  with pytest.raises(ValueError, match="cross_attention.*5 source positions.*6 source tokens"):
    view.render_html(capture)
  capture.weights = {}
  with pytest.raises(ValueError, match="no attention layers"):
    view.render_html(capture)


def test_long_pages_stay_under_the_budget():
  rng = np.random.default_rng(1)
  n, paths = 128, [f"decoder/layer_{i}/attention" for i in range(6)]
  tokens = [chr(97 + i % 26) for i in range(n)]
  capture = Capture(tokens={"tokens": tokens},
                    weights={p: _softmax(rng.normal(size=(4, n, n))).astype(np.float32)
                             for p in paths},
                    sides={p: ("tokens", "tokens") for p in paths},
                    kind={p: "self" for p in paths})
  page = view.render_html(capture)
  assert len(page.encode()) <= view.PAGE_BUDGET
  assert len(view.render_html(capture, decimals=4).encode()) > view.PAGE_BUDGET


# ---- the page in Chromium ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
  """Headless Chromium driven by selenium through Debian's chromedriver (no download)."""
  try:
    from selenium import webdriver  # pylint: disable=g-import-not-at-top
    from selenium.webdriver.chrome.service import Service  # pylint: disable=g-import-not-at-top
  except ImportError:
    _missing(f"selenium is not installed; {INSTALL}")
  binary, driver_path = shutil.which("chromium"), shutil.which("chromedriver")
  if not binary or not driver_path:
    _missing(f"chromium / chromedriver not found on PATH; {INSTALL}")
  options = webdriver.ChromeOptions()
  options.binary_location = binary
  for arg in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
              "--disable-background-networking", "--disable-component-update", "--disable-sync",
              "--disable-dev-shm-usage", "--window-size=1400,1000",
              f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}"):
    options.add_argument(arg)
  options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
  driver = webdriver.Chrome(service=Service(driver_path), options=options)
  driver.set_page_load_timeout(60)
  yield driver
  driver.quit()


def _open(driver, path):
  driver.get(pathlib.Path(path).absolute().as_uri())
  driver.get_log("browser")  # drain messages of an earlier page
  driver.refresh()
  errors = [e for e in driver.get_log("browser") if e["level"] in ("SEVERE", "ERROR")]
  assert not errors, errors
  assert driver.execute_script("return typeof window.attnView") == "object"
  # Self-contained: the page fetched nothing (no script, style, font or image from anywhere).
  assert driver.execute_script("return performance.getEntriesByType('resource').length") == 0


def _js(driver, expr):
  return driver.execute_script(f"return {expr};")


def _layer_index(driver, path):
  return _js(driver, f"attnView.data.layers.findIndex(l => l.path === {json.dumps(path)})")


def test_pickers_lines_heatmap_hover_and_table(browser, tmp_path):
  from selenium.webdriver.common.action_chains import ActionChains  # pylint: disable=g-import-not-at-top
  from selenium.webdriver.common.by import By  # pylint: disable=g-import-not-at-top
  from selenium.webdriver.common.keys import Keys  # pylint: disable=g-import-not-at-top
  from selenium.webdriver.support.ui import Select  # pylint: disable=g-import-not-at-top
  capture = _capture()
  page = view.write_html(tmp_path / "view.html", capture, _metrics(capture), title="dates")
  _open(browser, page)
  body = browser.find_element(By.TAG_NAME, "body")

  def lines():
    return browser.find_elements(By.CSS_SELECTOR, "#lines line")

  # The page opens on the cross-attention (the alignment), mean of all heads.
  assert body.get_attribute("data-layer") == CROSS and body.get_attribute("data-head") == "-1"
  select = Select(browser.find_element(By.ID, "layer-select"))
  assert [o.text.split()[0] for o in select.options] == [ENC0, ENC1, DEC_SELF, CROSS]
  # The first layer through the picker: one line per nonzero (query, key) weight.
  select.select_by_value(str(_layer_index(browser, ENC0)))
  assert body.get_attribute("data-layer") == ENC0
  mean = _rounded(capture.weights[ENC0]).mean(0)
  assert len(lines()) == np.count_nonzero(mean) == 36
  groups = browser.find_elements(By.CSS_SELECTOR, "#layer-select optgroup")
  assert [g.get_attribute("label") for g in groups] == [
      "encoder self-attention", "decoder self-attention", "cross-attention"]

  # The causal decoder layer through the picker: only the lower triangle is drawn.
  select.select_by_value(str(_layer_index(browser, DEC_SELF)))
  assert body.get_attribute("data-layer") == DEC_SELF
  t = len(TARGET)
  assert len(lines()) == t * (t + 1) // 2
  # Head 2 through its button: a known line's opacity is the capture's weight.
  browser.find_element(By.CSS_SELECTOR, '#head-picker button[data-head="2"]').click()
  assert body.get_attribute("data-head") == "2"
  assert browser.find_element(By.CSS_SELECTOR, '#head-picker button.on').text == "2"
  line = browser.find_element(By.CSS_SELECTOR, '#lines line[data-q="4"][data-k="1"]')
  assert float(line.get_attribute("stroke-opacity")) == pytest.approx(
      capture.weights[DEC_SELF][2, 4, 1], abs=1e-4)
  before = [ln.get_attribute("stroke-opacity") for ln in lines()]
  body.send_keys(Keys.ARROW_RIGHT)  # the next head
  assert body.get_attribute("data-head") == "3"
  assert [ln.get_attribute("stroke-opacity") for ln in lines()] != before

  # Cross-attention, head 1: the heatmap is the alignment (target rows x source columns).
  select.select_by_value(str(_layer_index(browser, CROSS)))
  browser.find_element(By.CSS_SELECTOR, '#head-picker button[data-head="1"]').click()
  assert browser.find_element(By.ID, "heatmap-title").text.startswith(
      "Alignment: target (rows) × source (columns)")
  canvas = browser.find_element(By.ID, "heatmap")
  assert (canvas.get_attribute("data-layer"), canvas.get_attribute("data-head")) == (CROSS, "1")
  w = capture.weights[CROSS][1]
  assert len(lines()) == np.count_nonzero(_rounded(w))
  # Each heatmap cell's pixel has the colour of the capture's weight.
  q, k = np.unravel_index(np.argmax(w), w.shape)
  def pixel(qq, kk):
    return browser.execute_script("""
      const [q, k] = arguments, c = document.getElementById('heatmap'), ctx = c.getContext('2d');
      const geo = window.attnView._geometry(), r = window.devicePixelRatio || 1;
      const x = (geo.left + (k + 0.5) * geo.cell) * r, y = (geo.top + (q + 0.5) * geo.cell) * r;
      return Array.from(ctx.getImageData(Math.floor(x), Math.floor(y), 1, 1).data.slice(0, 3));
    """, int(qq), int(kk))

  for qq, kk in ((q, k), (0, 0), (t - 1, len(SOURCE) - 1)):
    assert pixel(qq, kk) == _js(browser, f"attnView.colour({float(_rounded(w[qq, kk]))})"), (qq, kk)
  assert _js(browser, "attnView.colour(1)") != _js(browser, "attnView.colour(0)")
  # "Scale each row to its maximum": every row's largest weight takes the top colour; lines keep
  # their true weight in data-w.
  browser.find_element(By.ID, "rowmax").click()
  row_top = np.argmax(w, 1)
  assert all(pixel(qq, row_top[qq]) == _js(browser, "attnView.colour(1)") for qq in range(t))
  line = browser.find_element(By.CSS_SELECTOR, f'#lines line[data-q="0"][data-k="{row_top[0]}"]')
  assert (line.get_attribute("stroke-opacity"), float(line.get_attribute("data-w"))) == (
      "1.0000", pytest.approx(w[0, row_top[0]], abs=1e-4))
  browser.find_element(By.ID, "rowmax").click()
  assert pixel(q, k) == _js(browser, f"attnView.colour({float(_rounded(w[q, k]))})")

  # Hover the heatmap's brightest cell: the tooltip names both tokens and the weight.
  geo = _js(browser, "attnView._geometry()")
  size = canvas.size
  ActionChains(browser).move_to_element_with_offset(
      canvas, int(geo["left"] + (k + 0.5) * geo["cell"] - size["width"] / 2),
      int(geo["top"] + (q + 0.5) * geo["cell"] - size["height"] / 2)).perform()
  tip = browser.find_element(By.ID, "tooltip")
  assert tip.is_displayed()
  assert (int(tip.get_attribute("data-q")), int(tip.get_attribute("data-k"))) == (q, k)
  assert float(tip.get_attribute("data-w")) == pytest.approx(w[q, k], abs=1e-4)
  assert f"{TARGET[q]} [{q}]" in tip.text and f"{SOURCE[k]} [{k}]" in tip.text

  # Hover a query token: its lines stay, the others dim.
  token = browser.find_element(By.CSS_SELECTOR, '#lines g.tok.q[data-index="3"]')
  ActionChains(browser).move_to_element(token).perform()
  assert "focusing" in browser.find_element(By.ID, "lines").get_attribute("class")
  on = browser.find_elements(By.CSS_SELECTOR, "#lines line.on")
  assert len(on) == np.count_nonzero(_rounded(w[3]))
  assert {ln.get_attribute("data-q") for ln in on} == {"3"}
  off = browser.find_element(By.CSS_SELECTOR, "#lines line:not(.on)")
  assert float(off.value_of_css_property("opacity")) < 0.1
  assert float(on[0].value_of_css_property("opacity")) == 1
  shot = tmp_path / "view_cross_head1_hover.png"
  assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
  print(f"screenshot: {shot}")

  # Metrics table: the selected head's row is marked; sorting; a click on a row selects its head.
  marked = browser.find_elements(By.CSS_SELECTOR, "#metrics tbody tr.head-on")
  assert [(r.get_attribute("data-layer"), r.get_attribute("data-head")) for r in marked] == [
      (CROSS, "1")]
  assert len(browser.find_elements(By.CSS_SELECTOR, "#metrics tbody tr.layer-on")) == 4
  browser.find_element(By.CSS_SELECTOR, '#metrics th[data-key="entropy"]').click()
  shown = [float(r.find_elements(By.TAG_NAME, "td")[2].text)
           for r in browser.find_elements(By.CSS_SELECTOR, "#metrics tbody tr")]
  assert shown == sorted(shown) and len(shown) == 16
  row = browser.find_element(By.CSS_SELECTOR, f'#metrics tbody tr[data-layer="{ENC1}"][data-head="0"]')
  row.click()
  assert (body.get_attribute("data-layer"), body.get_attribute("data-head")) == (ENC1, "0")
  assert select.first_selected_option.text.startswith(ENC1)
  errors = [e for e in browser.get_log("browser") if e["level"] in ("SEVERE", "ERROR")]
  assert not errors, errors


def _train(config_path, arg, workdir):
  config = config_utils.load_config_file(f"{REPO / 'configs' / config_path}:{arg}")
  train.train_and_evaluate(config, workdir)


@pytest.mark.slow
def test_attnlab_view_end_to_end_on_a_trained_transformer(browser, tmp_path, capsys):
  """configs/transformer.py runlocal (dates) for 2 steps, then `attnlab view` and the browser."""
  workdir = tmp_path / "dates"
  _train("transformer.py", "runlocal=True,num_train_steps=2,eval_every=0,write_plots=False",
         workdir)
  capsys.readouterr()
  assert cli.main(["attnlab", "view", f"--workdir={workdir}", "--text=9 october 1993"]) == 0
  page = pathlib.Path(capsys.readouterr().out.strip())
  assert page == workdir / "view.html" and page.is_file()
  assert page.stat().st_size < view.PAGE_BUDGET
  _open(browser, page)
  layers = _js(browser, "attnView.data.layers")
  kinds = {l["kind"] for l in layers}
  assert kinds == {"self", "causal", "cross"}, kinds
  cross = [i for i, l in enumerate(layers) if l["kind"] == "cross"]
  browser.execute_script(f"attnView.select({cross[-1]}, 0)")
  assert _js(browser, "document.getElementById('heatmap-title').textContent").startswith(
      "Alignment")
  assert _js(browser, "document.querySelectorAll('#metrics tbody tr').length") > 0
  browser.save_screenshot(str(tmp_path / "view_dates.png"))
  errors = [e for e in browser.get_log("browser") if e["level"] in ("SEVERE", "ERROR")]
  assert not errors, errors


def test_attnlab_view_errors_are_one_line(tmp_path, capsys):
  assert cli.main(["attnlab", "view", "--text=hi"]) == 2
  assert capsys.readouterr().err.strip().endswith("--workdir is required: the run directory of a "
                                                  "trained run (attnlab train ...)")
  assert cli.main(["attnlab", "view", f"--workdir={tmp_path / 'nope'}", "--text=hi"]) == 2
  err = capsys.readouterr().err.strip()
  assert "is not a directory" in err and len(err.splitlines()) == 1
  assert cli.main(["attnlab", "view", f"--workdir={tmp_path}", "--text=  "]) == 2
  assert "--text is required and must not be empty" in capsys.readouterr().err
  assert cli.main(["attnlab", "view", f"--workdir={tmp_path}", "--text=hi"]) == 2
  err = capsys.readouterr().err.strip()
  assert err.startswith("attnlab view: error: ") and len(err.splitlines()) == 1


@pytest.mark.slow
def test_attnlab_view_refuses_a_run_without_attention(tmp_path, capsys):
  """An RNN encoder-decoder with model.attention=none has no attention to view: one line, exit 2."""
  workdir = tmp_path / "none"
  _train("seq2seq.py", "runlocal=True,model.attention=none,num_train_steps=1,eval_every=0,"
         "write_plots=False", workdir)
  capsys.readouterr()
  assert cli.main(["attnlab", "view", f"--workdir={workdir}", "--text=9 october 1993"]) == 2
  err = capsys.readouterr().err.strip()
  assert err.startswith("attnlab view: error: ") and len(err.splitlines()) == 1, err
  assert "attention" in err and not (workdir / "view.html").exists()

"""The attention mechanisms of attnlab.attention in the model families: position biases that
extrapolate, KV-cache decoding, sown (implicit) weights, config keys and their one-line errors,
and end-to-end sweeps (slow)."""

import dataclasses
import importlib.util
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from attnlab import config_utils

from attnlab import run_config
from attnlab.attention import registry
from attnlab.attention.config import AttentionConfig
from attnlab.errors import ConfigError
from attnlab.layers import MultiHeadAttention
from attnlab.models import bert
from attnlab.models import gpt
from attnlab.models import transformer

VOCAB = 11
RNG = np.random.default_rng(0)


def _config(name, arg=None):
  spec = importlib.util.spec_from_file_location(f"{name}_config", f"configs/{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg)


def _gpt(position, **kw):
  """A tiny GPT; `kw`: keys of model.attention ("mechanism", "sliding_window.window", ...)."""
  cfg = _config("gpt", f"runlocal=True,model.position={position},model.block_size=64,"
                       "model.num_layers=2,model.num_heads=2,model.d_model=16")
  config_utils.apply_overrides(cfg, {f"model.attention.{key}": value for key, value in kw.items()})
  config_utils.validate(cfg)
  return gpt.from_config(cfg.model, VOCAB)


# ------------------------------------------------------------------------------ ALiBi (NumPy)


def test_alibi_in_the_layer_matches_numpy():
  """Scores q·k/sqrt(d) - m_h |i - j| with m_h = 2^(-8h/H) (Press et al. 2022), causal."""
  heads, d, t = 4, 16, 7
  layer = MultiHeadAttention(num_heads=heads, causal=True, position_bias="alibi",
                             use_bias=False)
  x = jnp.asarray(RNG.normal(size=(2, t, d)), jnp.float32)
  p = layer.init(jax.random.key(0), x)["params"]
  out = np.asarray(layer.apply({"params": p}, x))
  xn = np.asarray(x, np.float64)
  hd = d // heads
  split = lambda y: y.reshape(2, t, heads, hd).transpose(0, 2, 1, 3)
  q, k, v = (split(xn @ np.asarray(p[f"{n}_kernel"])) for n in ("query", "key", "value"))
  slopes = np.array([2.0 ** (-8.0 * (h + 1) / heads) for h in range(heads)])
  i, j = np.arange(t)[:, None], np.arange(t)[None, :]
  logits = q @ k.transpose(0, 1, 3, 2) / math.sqrt(hd) - slopes[:, None, None] * np.abs(i - j)
  logits = np.where(j <= i, logits, -np.inf)
  w = np.exp(logits - logits.max(-1, keepdims=True))
  w /= w.sum(-1, keepdims=True)
  ctx = (w @ v).transpose(0, 2, 1, 3).reshape(2, t, d)
  np.testing.assert_allclose(out, ctx @ np.asarray(p["out"]["kernel"]), atol=1e-5)


def test_t5_bias_table_per_layer_or_shared():
  """Without a shared table the layer owns one ([32 buckets, heads]); passing the same values as
  the shared table gives the same output; the bias depends on the table (zero table = none)."""
  layer = MultiHeadAttention(num_heads=2, causal=True, position_bias="t5_bias")
  plain = MultiHeadAttention(num_heads=2, causal=True)
  x = jnp.asarray(RNG.normal(size=(2, 6, 8)), jnp.float32)
  p = layer.init(jax.random.key(0), x)["params"]
  assert p["t5_bias"].shape == (32, 2)
  table = jax.random.normal(jax.random.key(5), (32, 2))
  own = layer.apply({"params": {**p, "t5_bias": table}}, x)
  rest = {k: v for k, v in p.items() if k != "t5_bias"}
  shared = layer.apply({"params": rest}, x, t5_table=table)
  np.testing.assert_allclose(np.asarray(own), np.asarray(shared), atol=1e-6)
  zero = layer.apply({"params": rest}, x, t5_table=jnp.zeros((32, 2)))
  np.testing.assert_allclose(np.asarray(zero), np.asarray(plain.apply({"params": rest}, x)),
                             atol=1e-6)
  # The table moves the attention weights (by ~0.44 here). The outputs of the small init moved by
  # only 0.002-0.004 (their scale ~0.005-0.01, the input depending on the tests run before), too
  # near the old 1e-3 threshold.
  weights = lambda table: np.asarray(layer.apply(
      {"params": rest}, x, t5_table=table,
      mutable=["intermediates"])[1]["intermediates"]["attention_weights"][0])  # [b, h, q, k]
  assert np.abs(weights(table) - weights(jnp.zeros((32, 2)))).max() > 0.1


# ------------------------------------------------------------------------------ extrapolation


@pytest.mark.slow
@pytest.mark.parametrize("position", ["alibi", "t5_bias"])
def test_gpt_trained_at_block_64_evaluates_at_128(position):
  model = _gpt(position)
  tokens = jnp.asarray(RNG.integers(0, VOCAB, (4, 129)), jnp.int32)
  params = model.init(jax.random.key(0), tokens[:, :64])["params"]
  if position == "t5_bias":  # one table shared by the layers, as in T5
    assert params["t5_bias"].shape == (32, 2)
    assert not any("t5_bias" in str(path) for path, _ in
                   jax.tree_util.tree_flatten_with_path(params["block_0"])[0])
  opt = optax.adam(1e-2)

  def loss_fn(p, x):
    logits = model.apply({"params": p}, x[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, x[:, 1:]).mean()

  @jax.jit
  def step(p, s, x):
    loss, g = jax.value_and_grad(loss_fn)(p, x)
    u, s = opt.update(g, s, p)
    return optax.apply_updates(p, u), s, loss

  state = opt.init(params)
  for _ in range(2):  # trained at 64
    params, state, _ = step(params, state, tokens[:, :65])
  forward = jax.jit(lambda p, x: model.apply({"params": p}, x))
  long = np.asarray(forward(params, tokens[:, :128]))  # evaluated at 128
  short = np.asarray(forward(params, tokens[:, :64]))
  assert long.shape == (4, 128, VOCAB) and np.all(np.isfinite(long))
  # causal and relative: the first 64 positions see exactly what they saw at length 64
  np.testing.assert_allclose(long[:, :64], short, atol=1e-4)


def test_learned_positions_refuse_lengths_past_the_table():
  model = _gpt("learned")
  params = model.init(jax.random.key(0), jnp.zeros((1, 64), jnp.int32))["params"]
  with pytest.raises(ValueError, match="longer than max_len=64"):
    model.apply({"params": params}, jnp.zeros((1, 128), jnp.int32))


# ------------------------------------------------------------------------------ KV cache


@pytest.mark.parametrize("kw", [
    dict(position="alibi", num_kv_heads=1),
    dict(position="t5_bias"),
    {"position": "rotary", "mechanism": "sliding_window", "sliding_window.window": 5,
     "num_kv_heads": 1},
    dict(position="alibi", normalizer="softmax_sink", talking_heads=True),
    {"position": "rotary", "mechanism": "performer", "performer.num_features": 16,
     "num_kv_heads": 1},
], ids=["alibi-mqa", "t5", "sliding-mqa", "sink-talking", "performer-mqa"])
@pytest.mark.slow
def test_gpt_cached_decoding_equals_the_full_forward(kw):
  position = kw.pop("position")
  model = _gpt(position, **kw)
  model = model.clone(block_size=16)
  tokens = jnp.asarray(RNG.integers(0, VOCAB, (2, 16)), jnp.int32)
  params = model.init(jax.random.key(0), tokens)["params"]
  params = jax.tree.map(lambda a: a + 0.2 * jax.random.normal(jax.random.key(1), a.shape), params)
  full = np.asarray(jax.jit(lambda p, x: model.apply({"params": p}, x))(params, tokens))
  cache = gpt.init_cache(model, 2)
  if kw.get("num_kv_heads") == 1:
    assert cache["block_0"]["self_attention"]["cached_key"].shape == (2, 1, 16, 8)
  chunk = jax.jit(lambda p, c, x: gpt.decode_chunk(model, p, c, x))
  logits, cache = chunk(params, cache, tokens[:, :6])
  outs = [np.asarray(logits)]
  for t in range(6, 16):
    logits, cache = chunk(params, cache, tokens[:, t:t + 1])
    outs.append(np.asarray(logits))
  # Performer's key stabiliser is the max over the keys a query's pass sees: all 16 in the full
  # forward, the cached prefix in decoding. FAVOR+'s 1e-6 feature floor does not scale with it, so
  # the two differ slightly (efficient.performer_feature_map); every other mechanism is exact.
  atol = 1e-3 if kw.get("mechanism") == "performer" else 1e-4
  np.testing.assert_allclose(np.concatenate(outs, axis=1), full, atol=atol)


@pytest.mark.slow
def test_generation_without_a_kv_cache_where_the_mechanism_has_none():
  model = _gpt("rotary", mechanism="bigbird").clone(block_size=16)
  assert not registry.get_mechanism("bigbird").supports.cache
  params = model.init(jax.random.key(0), jnp.zeros((1, 16), jnp.int32))["params"]
  out = gpt.generate(model, params, [[1, 2, 3]], jax.random.key(0), num_tokens=4,
                     temperature=0.0)  # use_cache=None: the uncached path
  assert out.tokens.shape == (1, 4)
  with pytest.raises(ConfigError, match="does not support KV-cache decoding"):
    gpt.generate(model, params, [[1, 2, 3]], jax.random.key(0), num_tokens=2, use_cache=True)


# ------------------------------------------------------------------------------ weights for analysis


@pytest.mark.slow
@pytest.mark.parametrize("mechanism", ["linear", "performer"])
def test_implicit_weights_are_sown_for_analysis(mechanism):
  model = _gpt("rotary", mechanism=mechanism).clone(block_size=12)
  tokens = jnp.asarray(RNG.integers(0, VOCAB, (2, 12)), jnp.int32)
  params = model.init(jax.random.key(0), tokens)["params"]
  plain = model.apply({"params": params}, tokens)
  logits, state = model.apply({"params": params}, tokens, mutable=["intermediates"])
  np.testing.assert_allclose(np.asarray(logits), np.asarray(plain), atol=1e-5)
  w = np.asarray(state["intermediates"]["block_1"]["self_attention"]["attention_weights"][0])
  assert w.shape == (2, 2, 12, 12)
  np.testing.assert_allclose(w.sum(-1), 1.0, atol=1e-4)  # normalised rows
  assert np.all(np.triu(w, 1) == 0) and np.all(w >= 0)  # causal, positive features


@pytest.mark.slow
def test_fixed_random_draws_of_a_mechanism_are_not_parameters(monkeypatch):
  """A mechanism naming init outputs as `fixed` (Performer's random features) gets them drawn
  from the layer's seed on every call: not in the parameters, so never trained or decayed."""
  real = registry.get_mechanism("performer")
  fake = dataclasses.replace(real, fixed=("features",))
  monkeypatch.setitem(registry.MECHANISMS, "performer", fake)
  layer = MultiHeadAttention(num_heads=2, attention=AttentionConfig(
      mechanism="performer", options={"num_features": 8}))
  x = jnp.asarray(RNG.normal(size=(1, 5, 8)), jnp.float32)
  params = layer.init(jax.random.key(0), x)["params"]
  assert "mechanism_params" not in params
  for seed in (3,):
    feats = real.init(jax.random.key(seed), 2, 4, 5, num_features=8)["features"]
    split = lambda y: y.reshape(1, 5, 2, 4).transpose(0, 2, 1, 3)
    q, k, v = (split(x @ params[f"{n}_kernel"] + params[f"{n}_bias"])
               for n in ("query", "key", "value"))
    ctx, _ = real.fn(q, k, v, params={"features": feats})  # [1, heads, 5, 4]
    want = ctx.transpose(0, 2, 1, 3).reshape(1, 5, 8) @ params["out"]["kernel"] + \
        params["out"]["bias"]
    got = layer.clone(mechanism_seed=seed).apply({"params": params}, x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)
  grads = jax.grad(lambda p: jnp.sum(layer.apply({"params": p}, x)))(params)
  assert set(grads) == set(params)  # nothing else to train


# ------------------------------------------------------------------------------ BERT, Transformer


@pytest.mark.slow
@pytest.mark.parametrize("mechanism", list(registry.MECHANISMS))
def test_bert_runs_every_mechanism_with_padding(mechanism):
  cfg = _config("bert", f"runlocal=True,model.attention.mechanism={mechanism},"
                        "model.attention.sliding_window.window=4,"
                        "model.attention.linformer.projected_len=8,"
                        "model.attention.performer.num_features=16,model.attention.num_kv_heads=1")
  config_utils.validate(cfg)
  model = bert.from_config(cfg, 50)
  tokens = jnp.asarray(RNG.integers(1, 50, (2, 32)), jnp.int32).at[1, 20:].set(0)
  params = model.init(jax.random.key(0), tokens)["params"]
  # larger weights than the init's: a padded token that leaked would move the logits by ~0.1
  params = jax.tree.map(lambda a: a + 0.2 * jax.random.normal(jax.random.key(1), a.shape), params)
  mlm, nsp = model.apply({"params": params}, tokens)
  assert mlm.shape == (2, 32, 50) and np.all(np.isfinite(np.asarray(mlm)))
  # padded keys get no attention: changing the ids under the padding (still padded: the mask is
  # passed) changes nothing. (This used to "change" them to 0, which they already were.)
  valid = tokens != 0  # [2, 32]
  other = tokens.at[1, 20].set(7).at[1, 21].set(8)
  mlm2, _ = model.apply({"params": params}, other, None, valid)
  np.testing.assert_allclose(np.asarray(mlm2[1, :20]), np.asarray(mlm[1, :20]), atol=1e-4)
  # the same ids unpadded do reach the earlier rows (0.08 to 0.7 here): the check can fail
  unpadded, _ = model.apply({"params": params}, other)
  assert np.abs(np.asarray(unpadded[1, :20]) - np.asarray(mlm[1, :20])).max() > 0.01


@pytest.mark.parametrize("arg", [
    "model.position=t5_bias,model.attention.num_kv_heads=1,"
    "model.attention.mechanism=sliding_window,model.attention.sliding_window.window=3",
    "model.position=alibi,model.attention.mechanism=bigbird",
])
@pytest.mark.slow
def test_transformer_greedy_decoding_equals_its_uncached_reference(arg):
  cfg = _config("transformer", f"runlocal=True,{arg}")
  config_utils.validate(cfg)
  model = transformer.from_config(cfg.model, 12, 13, 8)
  src = jnp.asarray(RNG.integers(1, 12, (2, 8)), jnp.int32)
  lengths = jnp.asarray([8, 5], jnp.int32)
  params = model.init(jax.random.key(0), src, lengths, src[:, :6])["params"]
  params = jax.tree.map(lambda a: a + 0.3 * jax.random.normal(jax.random.key(2), a.shape), params)
  from attnlab import decoding
  start = jnp.ones((2,), jnp.int32)

  @jax.jit
  def uncached(params):
    state = transformer.init_decode_state(model, params, src, lengths, use_cache=False)
    step = transformer.make_step_fn(model, params, use_cache=False)
    return decoding.greedy(step, state, start, max_len=8).tokens

  @jax.jit
  def default(params):  # the translation task's call: cached where the mechanism allows
    step = lambda s, t: model.apply({"params": params}, s, t, method="decode_step")
    state = model.apply({"params": params}, src, lengths, method="encode")
    return decoding.greedy(step, state, start, max_len=8).tokens

  np.testing.assert_array_equal(np.asarray(default(params)), np.asarray(uncached(params)))
  assert ("cache" in model.apply({"params": params}, src, lengths, method="encode")) == \
      registry.get_mechanism(model.attention.mechanism).supports.cache


# ------------------------------------------------------------------------------ config errors


@pytest.mark.parametrize("name,arg,message", [
    ("gpt", "model.attention.mechanism=linformer",
     "model.attention.mechanism=linformer is not defined for causal attention, which GPT"),
    ("transformer", "model.attention.mechanism=linformer", "is not defined for causal attention"),
    ("gpt", "model.attention.mechanism=nope",
     "unknown model.attention.mechanism 'nope'; valid mechanisms: full, "),
    ("gpt", "model.attention.normalizer=nope", "valid normalizers: softmax, softmax_sink"),
    ("gpt", "model.position=nope", "valid positions: learned, sinusoidal, rotary, none, alibi"),
    ("bert", "model.position=nope", "valid positions: "),
    ("bert", "model.attention.mechanism=linear,model.attention.talking_heads=True",
     "talking heads mix the score"),
    ("gpt", "model.attention.mechanism=performer,model.position=alibi",
     "model.attention.mechanism=performer never forms the scores that position alibi/t5_bias "
     "adds a bias to"),
    ("gpt", "model.attention.mechanism=linear,model.attention.normalizer=sigmoid",
     "use model.attention.normalizer=softmax"),
    ("gpt", "model.attention.mechanism=performer,model.attention.score=cosine",
     "use model.attention.score=scaled_dot"),
    ("bert", "model.num_heads=4,model.attention.num_kv_heads=3",
     "model.attention.num_kv_heads=3 must divide num_heads=4"),
    ("gpt", "model.attention.normalizer=sigmoid,model.attention.implementation=blocked",
     "runs on the reference path; set model.attention.implementation=auto or reference "
     "(not blocked)"),
    ("gpt", "model.attention.topk=0", "model.attention.topk must be >= 1"),
])
def test_attention_options_are_validated_with_one_line(name, arg, message):
  cfg = _config(name, f"runlocal=True,{arg}")
  with pytest.raises(ConfigError, match=re.escape(message)) as e:
    config_utils.validate(cfg)
  assert "\n" not in str(e.value)


def test_gpt_num_kv_heads_must_divide_the_size_s_heads():
  cfg = _config("gpt", "runlocal=True,model.attention.num_kv_heads=3")  # tiny: 2 heads
  with pytest.raises(ConfigError, match="num_kv_heads=3 must divide num_heads=2"):
    gpt.from_config(cfg.model, VOCAB)


def _before_attention_options(model):
  """A `config.model` (as JSON) as runs wrote it before the attention options existed: the flat
  model.score and model.implementation, no model.attention (nor the other options' keys)."""
  attention = model["attention"]
  old = {k: v for k, v in model.items() if k != "attention"}
  return {**old, "score": attention["score"], "implementation": attention["implementation"]}


def test_an_older_bert_run_resumes_without_a_config_change():
  cfg = run_config.to_jsonable(_config("bert", "runlocal=True"))
  old = {**cfg, "model": {k: v for k, v in _before_attention_options(cfg["model"]).items()
                          if k != "position"}}
  assert run_config.config_diff(old, cfg) == []


def test_older_configs_without_the_keys_build_the_same_models():
  cfg = _config("gpt", "runlocal=True")
  data = run_config.to_jsonable(cfg)
  old = run_config.from_jsonable({**data, "model": _before_attention_options(data["model"])})
  assert gpt.from_config(old.model, VOCAB) == gpt.from_config(cfg.model, VOCAB)
  # a model group without the attention subtree at all builds the default attention too
  bare = config_utils.ConfigDict({k: v for k, v in cfg.model.items() if k != "attention"})
  assert gpt.from_config(bare, VOCAB) == gpt.from_config(cfg.model, VOCAB)
  assert run_config.config_diff(run_config.to_jsonable(old), data) == []


# ------------------------------------------------------------------------------ end to end (slow)

FAST = "runlocal=True,write_plots=False,num_train_steps=2,log_every=1,eval_every=0,checkpoint_every=0"


def _summary_rows(workdir):
  import csv  # pylint: disable=g-import-not-at-top
  with open(workdir / "summary.csv", encoding="utf-8") as f:
    return list(csv.DictReader(f))


@pytest.mark.slow
def test_gpt_sweep_over_positions_and_normalizers(tmp_path, shared_data):
  from attnlab.cli import sweep as sweep_cli  # pylint: disable=g-import-not-at-top
  spec = f"configs/gpt.py:{FAST},data.manual_dir={shared_data}"
  status = sweep_cli.main(["attnlab sweep", f"--config={spec}", f"--workdir={tmp_path}",
                           "--sweep=model.position=alibi,t5_bias,rotary",
                           "--sweep=model.attention.normalizer=softmax,sigmoid"])
  assert status == 0
  assert len(_summary_rows(tmp_path)) == 6


@pytest.mark.slow
def test_bert_sweep_over_the_efficient_mechanisms(tmp_path, shared_data):
  from attnlab.cli import sweep as sweep_cli  # pylint: disable=g-import-not-at-top
  spec = f"configs/bert.py:mode=pretrain,{FAST},data.manual_dir={shared_data}"
  efficient = [n for n in registry.MECHANISMS if n != "full"]
  status = sweep_cli.main(["attnlab sweep", f"--config={spec}", f"--workdir={tmp_path}",
                           "--sweep=model.attention.mechanism=" + ",".join(efficient)])
  assert status == 0
  assert len(_summary_rows(tmp_path)) == len(efficient)


@pytest.mark.slow
def test_transformer_sweep_over_the_efficient_causal_mechanisms(tmp_path):
  from attnlab.cli import sweep as sweep_cli  # pylint: disable=g-import-not-at-top
  both = [n for n, m in registry.MECHANISMS.items()
          if m.supports.causal and m.supports.bidirectional and n != "full"]
  status = sweep_cli.main(["attnlab sweep", f"--config=configs/transformer.py:{FAST}",
                           f"--workdir={tmp_path}",
                           "--sweep=model.attention.mechanism=" + ",".join(both)])
  assert status == 0
  assert len(_summary_rows(tmp_path)) == len(both)


@pytest.mark.slow
def test_vmapped_seeds_on_a_two_device_mesh(tmp_path, shared_data):
  """num_seeds=2 on mesh.cpu_devices=2 (a fresh process: the device count is set before JAX
  starts) with a mechanism whose parameters are its own (Linformer in BERT) and GQA."""
  import json  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  arg = (f"mode=pretrain,{FAST},data.manual_dir={shared_data},num_seeds=2,mesh.cpu_devices=2,"
         "model.attention.mechanism=linformer,model.attention.num_kv_heads=1,"
         "model.position=rotary")
  proc = subprocess.run([sys.executable, "-m", "attnlab.cli.train",
                         f"--config=configs/bert.py:{arg}", f"--workdir={tmp_path}"],
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  train = [r for r in records if r.get("split") == "train"]
  assert train and all(len(r["per_seed"]["loss"]) == 2 for r in train)
  assert all(np.all(np.isfinite(r["per_seed"]["loss"])) for r in train)
  # two inits: the seeds' losses 3e-2 and 4e-3 apart at steps 1 and 2 (float32 rounding ~1e-6)
  losses = np.array([r["per_seed"]["loss"] for r in train])  # [steps, seeds]
  assert np.all(np.abs(losses[:, 0] - losses[:, 1]) > 1e-4), losses
  assert "mesh.cpu_devices=2: 2 CPU devices" in proc.stderr  # data axis over both (batch 8)


def test_bigbird_block_reaches_bigbird():
  """model.attention.bigbird.block is BigBird's block size: with blocks of 4 tokens out of 32,
  the global first block's queries still see every key (= full softmax attention, computed here
  in NumPy) while later queries see only their window, global and random blocks, at most 5 of
  the 8 (differ from it)."""
  x = RNG.normal(size=(1, 32, 8)).astype(np.float32)
  layer = MultiHeadAttention(num_heads=2, attention=AttentionConfig(mechanism="bigbird",
                                                                    options={"block": 4}))
  params = layer.init(jax.random.key(0), jnp.asarray(x))["params"]
  params = jax.tree.map(lambda a: a + jax.random.normal(jax.random.key(1), a.shape), params)
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
  split = lambda y: y.reshape(1, 32, 2, 4).transpose(0, 2, 1, 3)
  q, k, v = (split(x @ p[f"{n}_kernel"] + p[f"{n}_bias"]) for n in ("query", "key", "value"))
  s = q @ k.transpose(0, 1, 3, 2) / np.sqrt(4)
  w = np.exp(s - s.max(-1, keepdims=True))
  ctx = (w / w.sum(-1, keepdims=True)) @ v
  full = ctx.transpose(0, 2, 1, 3).reshape(1, 32, 8) @ p["out"]["kernel"] + p["out"]["bias"]
  got = np.asarray(layer.apply({"params": params}, jnp.asarray(x)))
  np.testing.assert_allclose(got[0, :4], full[0, :4], rtol=1e-4, atol=1e-4)
  # every later query block hides keys (about 1 to 20 here, far from rounding)
  assert (np.abs(got[0, 4:] - full[0, 4:]).reshape(7, 4 * 8).max(-1) > 0.1).all()
  # a block as long as the sequence hides nothing: full attention everywhere
  whole = np.asarray(layer.clone(attention=AttentionConfig(
      mechanism="bigbird", options={"block": 32})).apply({"params": params}, jnp.asarray(x)))
  np.testing.assert_allclose(whole, full, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arg,message", [
    ("mechanism=bigbird,model.attention.bigbird.block=-1",
     "model.attention.mechanism=bigbird: bigbird.block must be an int >= 1, got -1"),
    # 0 no longer means "the default" (64): the options' defaults are their values
    ("mechanism=bigbird,model.attention.bigbird.block=0",
     "model.attention.mechanism=bigbird: bigbird.block must be an int >= 1, got 0"),
    ("mechanism=sliding_window,model.attention.sliding_window.window=0",
     "model.attention.mechanism=sliding_window: sliding_window.window must be an int >= 1, got 0"),
    ("mechanism=sliding_window,model.attention.sliding_window.window=-2",
     "sliding_window.window must be an int >= 1, got -2"),
    ("mechanism=sliding_window,model.attention.sliding_window.block=-1",
     "sliding_window.block must be an int >= 0 (0: from the window), got -1"),
    ("mechanism=performer,model.attention.performer.num_features=0",
     "model.attention.mechanism=performer: performer.num_features must be an int >= 1, got 0"),
    ("mechanism=linformer,model.attention.linformer.projected_len=-1",
     "model.attention.mechanism=linformer: linformer.projected_len must be an int >= 1, got -1"),
    ("model.attention.num_kv_heads=-1", "model.attention.num_kv_heads must be >= 0"),
])
def test_mechanism_option_values_are_checked(arg, message):
  """Each mechanism's option below its least value is refused in one line naming the key (the
  flat keys' "0: the default" is gone: 0 is a value, refused where it means nothing)."""
  cfg = _config("bert", f"runlocal=True,{arg}")
  with pytest.raises(ConfigError, match=re.escape(message)) as e:
    config_utils.validate(cfg)
  assert "\n" not in str(e.value)

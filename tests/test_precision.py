"""Mixed precision (attnlab/precision.py, config.model.dtype): float32 parameters, float32
softmax/layer norm/losses, bfloat16 and float16 compute, dynamic loss scaling; the GPU-scale
configs (GPT size=gpt2, BERT size=base) and the synthetic-token data set."""

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from attnlab import analysis
from attnlab import checkpoint
from attnlab import config_utils
from attnlab import run_config
from attnlab import precision
from attnlab import rundir
from attnlab import tasks
from attnlab import train
from attnlab.errors import ConfigError

REPO = pathlib.Path(__file__).resolve().parents[1]
GPT = str(REPO / "configs" / "gpt.py")


def _gpt(arg: str):
  return config_utils.load_config_file(f"{GPT}:{arg}")


def _jaxpr_eqns(jaxpr):
  """Every equation of a jaxpr, those of its sub-jaxprs (jit, custom_vjp, cond, scan) included."""
  for eqn in jaxpr.eqns:
    yield eqn
    for value in eqn.params.values():
      for sub in (value if isinstance(value, (tuple, list)) else (value,)):
        inner = getattr(sub, "jaxpr", sub)
        if isinstance(inner, jax.extend.core.Jaxpr):
          yield from _jaxpr_eqns(inner)


# ------------------------------------------------------------------------------ config


def test_dtype_is_validated_once_with_one_line():
  config = _gpt("runlocal=True,model.dtype=float8")
  with pytest.raises(ConfigError) as e:
    config_utils.validate(config)
  assert str(e.value) == ("unknown model.dtype 'float8'; valid dtypes: float32, bfloat16, "
                          "float16")
  # Families that compute in float32 only say so in one line.
  s2s = config_utils.load_config_file(f"{REPO / 'configs' / 'seq2seq.py'}:runlocal=True,"
                                      f"model.dtype=bfloat16")
  config_utils.validate(s2s)
  with pytest.raises(ConfigError, match=r"not supported by the seq2seq model.*model.dtype=float32"):
    tasks.build_task(s2s)


def test_old_run_configs_read_as_float32():
  """A config.json written before model.dtype existed is the same config as a float32 one."""
  new = run_config.to_jsonable(_gpt("runlocal=True"))
  old = json.loads(json.dumps(new))
  del old["model"]["dtype"]
  assert run_config.config_diff(old, new) == []
  assert precision.dtype_name(config_utils.ConfigDict(old["model"])) == "float32"


# ------------------------------------------------------------------------------ the model


@pytest.fixture(scope="module")
def synthetic_tasks():
  """Tiny GPT tasks on synthetic tokens, one per compute dtype (no files needed)."""
  return {name: tasks.build_task(_gpt(f"runlocal=True,dataset=synthetic_tokens,"
                                      f"data.vocab_size=50,model.dtype={name}"))
          for name in precision.DTYPES}


def test_parameters_are_float32_and_logits_float32(synthetic_tasks):
  task32, task16 = synthetic_tasks["float32"], synthetic_tasks["bfloat16"]
  params = task16.init(jax.random.key(0))
  assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(jnp.float32)}
  # The same parameter tree whatever the compute dtype: a checkpoint of one fits the other.
  assert checkpoint.tree_signature(params) == checkpoint.tree_signature(
      jax.eval_shape(task32.init, jax.random.key(0)))
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 50, (2, 32)), jnp.int32)
  logits16 = jax.jit(task16.model.apply)({"params": params}, tokens)  # [2, 32, vocab]
  logits32 = jax.jit(task32.model.apply)({"params": params}, tokens)
  assert logits16.dtype == jnp.float32 and logits32.dtype == jnp.float32
  # bfloat16 keeps 8 significant bits (relative rounding 2^-9 per operation): the logits of a
  # 2-layer model agree with float32's to a few hundredths of their spread.
  spread = float(jnp.std(logits32))
  assert float(jnp.max(jnp.abs(logits16 - logits32))) < 0.1 * spread
  # it did compute in bfloat16: differences of bfloat16's size (2e-2 of the spread here), far
  # above float32 rounding (~1e-6 of it), where the old `not allclose(atol=1e-6)` sat
  assert float(jnp.max(jnp.abs(logits16 - logits32))) > 1e-3 * spread


def test_matmuls_in_compute_dtype_softmax_norm_loss_in_float32(synthetic_tasks):
  """In the jaxpr of the bfloat16 GPT's training loss (the task's own loss_fn)."""
  task = synthetic_tasks["bfloat16"]
  batch = next(task.train_iterator())
  _assert_precision_policy(lambda p: task.loss_fn(p, batch, None)[0],
                           task.init(jax.random.key(0)), vocab=50, k_len=32)


def _assert_precision_policy(loss_fn, params, vocab: int, k_len: int):
  """In the jaxpr of grad(loss_fn): every matmul takes bfloat16 operands; the exps of the
  softmaxes (over the vocabulary in the loss, over the keys in attention), every log
  (cross-entropy) and rsqrt (layer norm) run on float32; the gradients are float32. (Other exps,
  e.g. in exact GELU's derivative, are elementwise activations and may stay in bfloat16.)"""
  jaxpr = jax.make_jaxpr(jax.grad(loss_fn))(params)
  eqns = list(_jaxpr_eqns(jaxpr.jaxpr))
  dots = [e for e in eqns if e.primitive.name == "dot_general"]
  assert dots and all(v.aval.dtype == jnp.bfloat16 for e in dots for v in e.invars)
  softmax_exps = [e for e in eqns if e.primitive.name == "exp"
                  and e.invars[0].aval.shape[-1:] in ((vocab,), (k_len,))]
  assert {e.invars[0].aval.shape[-1] for e in softmax_exps} == {vocab, k_len}
  f32_ops = softmax_exps + [e for e in eqns if e.primitive.name in ("log", "rsqrt")]
  assert {e.primitive.name for e in f32_ops} == {"exp", "log", "rsqrt"}
  assert all(v.aval.dtype == jnp.float32 for e in f32_ops for v in e.invars)
  assert {v.aval.dtype for v in jaxpr.jaxpr.outvars} == {jnp.dtype(jnp.float32)}


@pytest.mark.parametrize("family", ["bert", "transformer"])
def test_bert_and_transformer_follow_the_policy(family):
  """The other two families with model.dtype, built directly at a tiny size."""
  from attnlab.models import bert as bert_lib  # pylint: disable=g-import-not-at-top
  from attnlab.models import transformer as transformer_lib  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(1, 50, (2, 12)), jnp.int32)  # [batch, len]
  targets = jnp.asarray(rng.integers(1, 50, (2, 12)), jnp.int32)
  dims = dict(num_layers=1, num_heads=2, d_model=32, mlp_dim=64, max_len=16)
  if family == "bert":
    models = [bert_lib.BertForPretraining(vocab_size=50, dropout_rate=0.0,
                                          attention_dropout_rate=0.0, dtype=d, **dims)
              for d in (jnp.bfloat16, None)]
    run = lambda m, p: m.apply({"params": p}, tokens)[0]  # MLM logits [batch, len, vocab]
  else:
    models = [transformer_lib.Transformer(50, 50, dtype=d, **dims) for d in (jnp.bfloat16, None)]
    lengths = jnp.array([12, 7])
    run = lambda m, p: m.apply({"params": p}, tokens, lengths, targets)[0]  # [batch, len, vocab]
  args = (tokens,) if family == "bert" else (tokens, lengths, targets)
  params = jax.jit(models[0].init)(jax.random.key(0), *args)["params"]
  assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(jnp.float32)}
  logits16, logits32 = (jax.jit(lambda p, m=m: run(m, p))(params) for m in models)
  assert logits16.dtype == jnp.float32
  assert float(jnp.max(jnp.abs(logits16 - logits32))) < 0.1 * float(jnp.std(logits32))
  loss = lambda p: jnp.mean(optax.softmax_cross_entropy_with_integer_labels(
      run(models[0], p), targets))
  _assert_precision_policy(loss, params, vocab=50, k_len=12)


def test_gpt2_size_parameter_count():
  """GPT-2 small from the config, shapes only (jax.eval_shape: nothing allocated)."""
  config = _gpt("size=gpt2,dataset=synthetic_tokens")
  assert (config.model.position, config.model.vocab_multiple, config.data.vocab_size) == (
      "learned", 64, 50257)
  task = tasks.build_task(config)
  m = task.model
  assert (m.num_layers, m.num_heads, m.d_model, m.block_size, m.vocab_size) == (
      12, 12, 768, 1024, 50304)
  shapes = jax.eval_shape(task.init, jax.random.key(0))
  count = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes))
  # Tied token table V*d, position table T*d; per block q/k/v/out 4d^2, MLP 8d^2, two LayerNorm
  # scales 2d (no biases, nanoGPT's bias=False); final LayerNorm d.
  v, t, d, layers = 50304, 1024, 768, 12
  assert count == v * d + t * d + layers * (12 * d * d + 2 * d) + d == 124_373_760


def test_bert_base_size():
  config = config_utils.load_config_file(f"{REPO / 'configs' / 'bert.py'}:size=base")
  m = config.model
  assert (m.num_layers, m.d_model, m.num_heads, m.mlp_dim, m.max_len) == (12, 768, 12, 3072, 512)


def test_synthetic_tokens_batches(synthetic_tasks):
  task = synthetic_tasks["float32"]
  batch = next(task.train_iterator())
  assert batch["inputs"].shape == (8, 32) and batch["targets"].shape == (8, 32)
  assert batch["inputs"].max() < 50 and batch["inputs"].min() >= 0
  np.testing.assert_array_equal(batch["inputs"][:, 1:], batch["targets"][:, :-1])


# ------------------------------------------------------------------------------ loss scaling


def test_loss_scaling_recovers_float16_gradients_that_underflow():
  """d/dx sum(x * c * c) with c = 1e-4 in float16: the backward pass multiplies the cotangent 1
  by c twice in float16, and 1e-8 is below float16's smallest subnormal (6e-8), so the unscaled
  gradient is 0; with the loss scaled by 2^15 before differentiation and the gradient divided
  after (in float32) it is c^2 to float16's precision."""
  c = jnp.float16(1e-4)

  def loss_fn(x):
    return jnp.sum(x.astype(jnp.float16) * c * c).astype(jnp.float32), {}
  x = jnp.ones((4,), jnp.float32)
  (_, _), plain = jax.value_and_grad(loss_fn, has_aux=True)(x)
  assert float(jnp.max(jnp.abs(plain))) == 0.0
  state = precision.dynamic_loss_scale(optax.sgd(1.0)).init(x)
  (loss, _), grads = precision.value_and_grad(loss_fn, state)(x)
  np.testing.assert_allclose(grads, np.full(4, float(c) ** 2), rtol=1e-2)
  assert grads.dtype == jnp.float32 and abs(float(loss)) < 1e-6


def test_dynamic_loss_scale_skips_grows_and_shrinks():
  """Against the rule written out: finite -> update, count+1, doubled after `period`;
  not finite -> no update, the inner state kept, the scale halved (not below min_scale)."""
  tx = precision.dynamic_loss_scale(optax.adam(0.1), init_scale=8.0, period=2, min_scale=2.0)
  params = {"w": jnp.ones(3)}
  state = tx.init(params)
  finite, bad = {"w": jnp.full(3, 0.5)}, {"w": jnp.array([1.0, jnp.nan, 0.0])}
  updates, s1 = tx.update(finite, state, params)
  assert float(jnp.abs(updates["w"]).min()) > 0 and (float(s1.scale), int(s1.good_steps)) == (8, 1)
  _, s2 = tx.update(finite, s1, params)
  assert (float(s2.scale), int(s2.good_steps)) == (16, 0)  # doubled after period=2 finite steps
  updates, s3 = tx.update(bad, s2, params)
  assert float(jnp.abs(updates["w"]).max()) == 0.0
  assert (float(s3.scale), int(s3.good_steps)) == (8, 0)
  same = jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), s3.inner, s2.inner)
  assert all(jax.tree.leaves(same))  # Adam's moments and count untouched by the skipped step
  s = s3
  for _ in range(4):
    _, s = tx.update(bad, s, params)
  assert float(s.scale) == 2.0
  # A plain optimizer for every dtype but float16.
  assert precision.wrap_optimizer(optax.sgd(1.0), _gpt("model.dtype=bfloat16")).init(
      params) == optax.sgd(1.0).init(params)
  assert precision.loss_scale(tx.init(params)) is not None


# ------------------------------------------------------------------------------ matmul precision


def _bf16(a):
  """float32 rounded to the nearest bfloat16 (ties to even), as float64: the reference's own
  rounding, on the bits."""
  bits = np.ascontiguousarray(a, np.float32).view(np.uint32)
  bits = (bits + np.uint32(0x7FFF) + ((bits >> 16) & 1)) & np.uint32(0xFFFF0000)
  return bits.view(np.float32).astype(np.float64)


def test_bfloat16_products_round_each_operand_once():
  """Under jax.default_matmul_precision("bfloat16") Dense's matmul multiplies bfloat16 operands
  and accumulates in float32: value `bf16(x) @ bf16(w)`, gradients `bf16(g) @ bf16(w)ᵀ` and
  `bf16(x)ᵀ @ bf16(g)`, checked against NumPy on the rounded operands in float64. The rounding is
  seen (the exact product is ~1e-3 away, relative), and outside that setting nothing is rounded."""
  from attnlab import layers  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(3)
  x, w, g = (jnp.asarray(rng.normal(size=s), jnp.float32)
             for s in ((3, 5, 40), (40, 24), (3, 5, 24)))
  loss = lambda x, w: jnp.sum(layers.matmul(x, w) * g)
  fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
  with jax.default_matmul_precision("bfloat16"):  # part of jit's cache key: a trace of its own
    val, (dx, dw) = fn(x, w)
  xr, wr, gr = _bf16(x), _bf16(w), _bf16(g)
  assert val.dtype == dx.dtype == dw.dtype == jnp.float32
  np.testing.assert_allclose(val, np.sum((xr @ wr) * np.asarray(g, np.float64)), rtol=1e-5)
  np.testing.assert_allclose(dx, gr @ wr.T, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(dw, np.einsum("btd,bte->de", xr, gr), rtol=1e-5, atol=1e-5)
  exact = np.einsum("btd,bte->de", *(np.asarray(a, np.float64) for a in (x, g)))
  assert np.max(np.abs(np.asarray(dw) - exact)) > 1e-4 * np.max(np.abs(exact))
  _, (_, dw32) = fn(x, w)  # no setting: the float32 product
  np.testing.assert_allclose(dw32, exact, rtol=1e-5, atol=1e-5)


def test_bfloat16_products_under_vmap_round_the_same_way(tmp_path):
  """Under vmap (a run's seeds) the products are taken from float32 copies of the rounded
  operands: the same numbers as above, for each mapped slice, and a run of two seeds trains.
  (XLA:CPU of jaxlib 0.10 left batched bfloat16 products to a runtime without them: the step
  failed with "Unsupported element type for DotThunk::Execute: BF16 x BF16 = F32".)"""
  from attnlab import layers  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(4)
  x, w, g = (jnp.asarray(rng.normal(size=s), jnp.float32)
             for s in ((2, 12, 40), (2, 40, 24), (2, 12, 24)))
  loss = lambda x, w, g: jnp.sum(layers.matmul(x, w) * g)
  with jax.default_matmul_precision("bfloat16"):
    val, (dx, dw) = jax.jit(jax.vmap(jax.value_and_grad(loss, argnums=(0, 1))))(x, w, g)
  for i in range(2):
    xr, wr, gr = _bf16(x[i]), _bf16(w[i]), _bf16(g[i])
    np.testing.assert_allclose(val[i], np.sum((xr @ wr) * np.asarray(g[i], np.float64)),
                               rtol=1e-5)
    np.testing.assert_allclose(dx[i], gr @ wr.T, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dw[i], xr.T @ gr, rtol=1e-5, atol=1e-5)
  state = train.train_and_evaluate(
      _gpt("runlocal=True,write_plots=False,dataset=synthetic_tokens,data.vocab_size=50,"
           "num_train_steps=2,log_every=1,eval_every=0,checkpoint_every=0,num_seeds=2,"
           "matmul_precision=bfloat16"), tmp_path / "seeds")
  assert int(state.step) == 2
  losses = [r["per_seed"]["loss"] for r in rundir.read_metrics(tmp_path / "seeds")
            if r["split"] == "train"]
  assert len(losses) == 2 and np.all(np.isfinite(losses))


def test_matmul_precision_auto_asks_for_bfloat16_on_a_bfloat16_cpu(monkeypatch):
  """auto: bfloat16 products for a float32 model of one seed where the CPU multiplies bfloat16
  natively (AVX512_BF16 or AMX), JAX's default elsewhere, for a bfloat16 model and for vmapped
  seeds; explicit values stand;
  a run written before the field trained in float32; a wrong name is one ConfigError line."""
  from attnlab.backends.cpu import matmul  # pylint: disable=g-import-not-at-top
  assert matmul.native_bf16(frozenset({"avx512f", "avx512_bf16"}))
  assert matmul.native_bf16(frozenset({"amx_bf16", "amx_tile"}))
  assert not matmul.native_bf16(frozenset({"avx2", "avx512f", "avx512bw"}))
  for native, want in ((True, "bfloat16"), (False, None)):
    monkeypatch.setattr(matmul, "native_bf16", lambda native=native: native)
    assert precision.matmul_precision(_gpt("runlocal=True")) == want
    assert precision.matmul_precision(_gpt("runlocal=True,model.dtype=bfloat16")) is None
    assert precision.matmul_precision(_gpt("runlocal=True,num_seeds=2")) is None  # vmapped
    assert precision.matmul_precision(_gpt("runlocal=True,matmul_precision=float32")) == "float32"
    assert precision.matmul_precision(_gpt("runlocal=True,matmul_precision=bfloat16")) == \
        "bfloat16"
  old = _gpt("runlocal=True")
  del old["matmul_precision"]
  assert precision.matmul_precision(old) == "float32"
  with pytest.raises(ConfigError) as e:
    config_utils.validate(_gpt("runlocal=True,matmul_precision=tf32"))
  assert str(e.value) == "unknown matmul_precision 'tf32'; valid: auto, float32, bfloat16"


def _dot_dtypes(fn, *args):
  """The operand dtypes of every dot in the jaxpr of fn(*args)."""
  jaxpr = jax.make_jaxpr(fn)(*args)
  return {str(v.aval.dtype) for e in _jaxpr_eqns(jaxpr.jaxpr) if e.primitive.name == "dot_general"
          for v in e.invars}


@pytest.mark.parametrize("name", ["bfloat16", "float32"])
def test_the_train_step_alone_takes_the_matmul_precision(name):
  """The trainer's step traces Dense's products in the config's precision; the evaluation's
  loss of the same config stays float32 (a run's evaluation records measure the float32 model)."""
  from attnlab import state as state_lib  # pylint: disable=g-import-not-at-top
  config = _gpt(f"runlocal=True,dataset=synthetic_tokens,data.vocab_size=50,"
                f"matmul_precision={name}")
  task = tasks.build_task(config)
  parts = state_lib.training(task, config, None)
  state = state_lib.initial_state(task, parts.tx, parts.init_rng, 1, None, parts.shardings)
  step = train.make_train_step(task, parts.tx, parts.schedule)
  batch = next(task.train_iterator())
  dots = _dot_dtypes(step, state, batch, parts.train_rng)
  assert "float32" in dots  # the attention's products are never rounded
  assert ("bfloat16" in dots) == (name == "bfloat16")
  assert _dot_dtypes(lambda p: task.loss_fn(p, batch, None)[0], state.params) == {"float32"}


def test_bfloat16_steps_resume_bit_identically(tmp_path):
  """A run of bfloat16 products stopped after 3 steps and resumed to 6 ends with the parameters
  and losses of one run of 6 steps; a float32 run goes on in bfloat16 without a config change."""
  base = ("runlocal=True,write_plots=False,dataset=synthetic_tokens,data.vocab_size=50,"
          "eval_every=0,checkpoint_every=0,log_every=1,optimizer.schedule=constant,"
          "optimizer.warmup_steps=0,matmul_precision=bfloat16")
  whole = train.train_and_evaluate(_gpt(f"{base},num_train_steps=6"), tmp_path / "whole")
  train.train_and_evaluate(_gpt(f"{base},num_train_steps=3"), tmp_path / "split")
  split = train.train_and_evaluate(_gpt(f"{base},num_train_steps=6,allow_config_change=True"),
                                   tmp_path / "split")
  for a, b in zip(jax.tree.leaves(whole.params), jax.tree.leaves(split.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  losses = lambda d: [r["loss"] for r in rundir.read_metrics(d) if r["split"] == "train"]
  assert losses(tmp_path / "whole") == losses(tmp_path / "split")
  assert len(losses(tmp_path / "whole")) == 6
  f32 = base.replace("matmul_precision=bfloat16", "matmul_precision=float32")
  train.train_and_evaluate(_gpt(f"{f32},num_train_steps=3"), tmp_path / "mixed")
  state = train.train_and_evaluate(_gpt(f"{base},num_train_steps=3"), tmp_path / "mixed")
  assert int(state.step) == 3  # resumed as it was: the precision is not a config change
  assert rundir.read_config(tmp_path / "mixed").matmul_precision == "bfloat16"


# ------------------------------------------------------------------------------ training


@pytest.fixture(scope="module")
def nano_runs(tmp_path_factory):
  """The runlocal nano GPT on Tiny Shakespeare for 200 steps in float32 and in bfloat16."""
  shared = REPO.parent / "shared" / "data"
  if not shared.is_dir():
    pytest.skip(f"{shared} not found")
  root = tmp_path_factory.mktemp("precision")
  runs = {}
  for name in ("float32", "bfloat16"):
    config = _gpt(f"runlocal=True,write_plots=False,num_train_steps=200,log_every=10,"
                  f"eval_every=200,checkpoint_every=200,data.manual_dir={shared},"
                  f"data.data_dir={root / 'tfds'},data.eval_windows=16,model.dtype={name},"
                  f"matmul_precision=float32")  # the float32 run: float32 products throughout
    train.train_and_evaluate(config, root / name)
    runs[name] = root / name
  return runs


def _train_losses(workdir):
  records = rundir.read_metrics(workdir)
  return np.array([r["loss"] for r in records if r["split"] == "train"])


@pytest.mark.slow
def test_bfloat16_follows_the_float32_loss_curve(nano_runs):
  """Same seed, data and initial parameters; the two curves (mean train loss over each 10
  steps, falling from 4.2 to 3.0 nats) may differ only by bfloat16's rounding. Measured: at most
  2e-4 nats apart (after 200 steps the parameters differ by ~1% relative, the logits of one batch
  by < 0.02 against a spread of 1.2). Rounding errors of the per-token losses (8 significant
  bits) average out over the 256 tokens of a batch and the 10 steps of a point, and Adam's
  normalised steps do not amplify them over 200 steps; the tolerance, 0.01 nats (0.3% of the
  loss), leaves a 50x margin for other CPUs and library versions, and is crossed by a run that
  learns differently (a lost gradient, a bfloat16 parameter update)."""
  f32, bf16 = _train_losses(nano_runs["float32"]), _train_losses(nano_runs["bfloat16"])
  assert len(f32) == len(bf16) == 20
  assert f32[-1] < f32[0] - 1.0  # it learned
  np.testing.assert_array_less(np.abs(f32 - bf16), 0.01)


@pytest.mark.slow
def test_checkpoints_are_float32_and_load_across_dtypes(nano_runs, tmp_path):
  bf16_run = nano_runs["bfloat16"]
  meta = json.loads((bf16_run / "checkpoints" / "200" / "meta" / "metadata").read_text())
  dtypes = {sig.split("[")[0] for sig in meta["tree"].values()}
  assert dtypes <= {"float32", "int32"}  # parameters and Adam moments float32; counters int32
  # load_run: float32 parameters; the float32 model runs them like the bfloat16 one.
  run = analysis.load_run(bf16_run)
  assert {x.dtype for x in jax.tree.leaves(run.params)} == {jnp.dtype(jnp.float32)}
  tokens = next(run.task.train_iterator())["inputs"]
  as_f32 = jax.jit(run.model.clone(dtype=None).apply)({"params": run.params}, tokens)
  as_bf16 = jax.jit(run.model.apply)({"params": run.params}, tokens)
  assert float(jnp.max(jnp.abs(as_f32 - as_bf16))) < 0.1 * float(jnp.std(as_f32))
  # Resume in the other dtype (a config change, so allow_config_change): 10 more steps each.
  for source, other in (("bfloat16", "float32"), ("float32", "bfloat16")):
    workdir = tmp_path / source
    import shutil  # pylint: disable=g-import-not-at-top
    shutil.copytree(nano_runs[source], workdir)
    config = config_utils.load_config_file(f"{GPT}:{_arg_of(workdir)},num_train_steps=210,"
                                           f"model.dtype={other},allow_config_change=True")
    state = train.train_and_evaluate(config, workdir)
    assert int(state.step) == 210
    losses = _train_losses(workdir)
    assert len(losses) == 21 and np.all(np.isfinite(losses))
    assert abs(losses[-1] - losses[-2]) < 0.3  # goes on from where it was


def _arg_of(workdir):
  """The arg that rebuilds a run's config (the keys the fixture set)."""
  c = rundir.read_config(workdir)
  return (f"runlocal=True,write_plots=False,log_every=10,eval_every=200,checkpoint_every=200,"
          f"data.manual_dir={c.data.manual_dir},data.data_dir={c.data.data_dir},"
          f"data.eval_windows=16")


@pytest.mark.slow
def test_float16_with_loss_scaling_trains_and_resumes_across_dtypes(tmp_path):
  """float32 for 10 steps, resumed in float16 (a loss scale starts) to 30, then in bfloat16 (the
  scale dropped) to 40: no NaN, float32 parameters, the optimizer's own state carried over."""
  workdir = tmp_path / "run"
  base = ("runlocal=True,write_plots=False,dataset=synthetic_tokens,data.vocab_size=50,"
          "eval_every=0,checkpoint_every=0,allow_config_change=True")
  train.train_and_evaluate(_gpt(f"{base},num_train_steps=10"), workdir)
  state = train.train_and_evaluate(_gpt(f"{base},num_train_steps=30,model.dtype=float16"),
                                   workdir)
  assert float(precision.loss_scale(state.opt_state)) >= 1.0
  # Adam's step count went on from 10 (restored, not started afresh); a float16 step whose
  # gradients overflowed is skipped and not counted.
  counts = [int(x) for x in jax.tree.leaves(state.opt_state.inner) if x.dtype == jnp.int32]
  assert counts and all(20 < c <= 30 for c in counts)
  records = rundir.read_metrics(workdir)
  f16 = [r for r in records if r["split"] == "train" and 10 < r["step"] <= 30]
  assert f16 and all(r["loss_scale"] >= 1.0 and np.isfinite(r["loss"]) for r in f16)
  assert {x.dtype for x in jax.tree.leaves(state.params)} == {jnp.dtype(jnp.float32)}
  state = train.train_and_evaluate(_gpt(f"{base},num_train_steps=40,model.dtype=bfloat16"),
                                   workdir)
  assert precision.loss_scale(state.opt_state) is None and int(state.step) == 40
  assert all(np.isfinite(r["loss"]) for r in rundir.read_metrics(workdir))
  assert analysis.load_run(workdir).step == 40

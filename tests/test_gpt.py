"""Tests for the GPT model, KV-cache generation, the causal_lm task, its config and CLI."""

import importlib.util
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from attnlab import analysis
from attnlab import config_utils
from attnlab import train
from attnlab.attention.config import AttentionConfig
from attnlab.cli import generate as generate_cli
from attnlab.config_utils import ConfigError
from attnlab.models import gpt

VOCAB = 13
TINY = dict(num_layers=2, num_heads=2, d_model=16, block_size=16)


def _load_config(arg=None):
  spec = importlib.util.spec_from_file_location("gpt_config", "configs/gpt.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg)


@pytest.fixture(scope="module")
def model_and_params():
  """A tiny GPT whose parameters are random enough to give varied greedy tokens."""
  model = gpt.GPT(vocab_size=VOCAB, **TINY)
  params = jax.jit(model.init)(jax.random.key(0),
                               jnp.zeros((1, TINY["block_size"]), jnp.int32))["params"]
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(1), len(leaves))
  params = jax.tree.unflatten(tree, [l + 0.3 * jax.random.normal(k, l.shape)
                                     for k, l in zip(keys, leaves)])
  return model, params


@pytest.fixture(scope="module")
def forward(model_and_params):
  model, _ = model_and_params
  return jax.jit(lambda p, x: model.apply({"params": p}, x))


def test_changing_a_future_token_never_changes_earlier_logits(model_and_params, forward):
  _, params = model_and_params
  x = np.random.default_rng(0).integers(0, VOCAB, (2, 16))
  base = np.asarray(forward(params, jnp.asarray(x)))
  for j in (3, 15):
    y = x.copy()
    y[:, j] = (y[:, j] + 1) % VOCAB
    changed = np.asarray(forward(params, jnp.asarray(y)))
    np.testing.assert_array_equal(changed[:, :j], base[:, :j])
    assert np.abs(changed[:, j:] - base[:, j:]).max() > 1e-3  # the token itself does matter


def test_lm_head_is_tied_to_the_token_embedding(model_and_params):
  model, params = model_and_params
  x = jnp.asarray(np.random.default_rng(1).integers(0, VOCAB, (1, 6)))
  logits, state = model.apply({"params": params}, x, capture_intermediates=True,
                              mutable=["intermediates"])
  hidden = np.asarray(state["intermediates"]["ln_f"]["__call__"][0])  # [1, 6, d]
  table = np.asarray(params["embed"]["token"]["embedding"])  # [vocab, d]
  np.testing.assert_allclose(logits, hidden @ table.T, rtol=1e-5, atol=1e-5)
  # The only [vocab, d] (or [d, vocab]) array is the embedding: no separate head.
  shaped = [l.shape for l in jax.tree.leaves(params) if set(l.shape) == {VOCAB, TINY["d_model"]}]
  assert shaped == [(VOCAB, TINY["d_model"])]


def test_decode_chunks_give_the_full_forward_logits(model_and_params, forward):
  model, params = model_and_params
  x = jnp.asarray(np.random.default_rng(2).integers(0, VOCAB, (2, 9)))
  full = forward(params, jnp.pad(x, ((0, 0), (0, 7))))[:, :9]
  cache = gpt.init_cache(model, 2)
  decode = jax.jit(lambda p, c, t: gpt.decode_chunk(model, p, c, t))
  first, cache = decode(params, cache, x[:, :5])  # a 5-token prompt
  rest = []
  for i in range(5, 9):
    logits, cache = decode(params, cache, x[:, i:i + 1])
    rest.append(logits)
  np.testing.assert_allclose(jnp.concatenate([first] + rest, axis=1), full, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("prefill_in_step", [True, False])
def test_kv_cache_greedy_equals_uncached_greedy(model_and_params, forward, prefill_in_step,
                                                 monkeypatch):
  """Both ways of filling the prompt's cache: in the refill's pass at the first step (a small
  model's) and in a pass of its own before the loop (a model whose keep tokens cost more)."""
  model, params = model_and_params
  monkeypatch.setattr(gpt, "PREFILL_IN_STEP_FLOPS", float("inf") if prefill_in_step else 0.0)
  assert gpt._prefill_in_step(params, 8, 3) == prefill_in_step  # keep = block_size 16 // 2
  prompt = np.random.default_rng(3).integers(0, VOCAB, (2, 4))
  steps = 12  # prompt + steps fit in block_size 16; 30 tokens go past it
  cached = gpt.generate(model, params, prompt, jax.random.key(0), num_tokens=30,
                        temperature=0.0)
  uncached = gpt.generate(model, params, prompt, jax.random.key(0), num_tokens=30,
                          temperature=0.0, use_cache=False)
  # An independent greedy loop: full forward pass on the padded sequence, argmax at its end.
  seq = [list(r) for r in prompt]
  for _ in range(steps):
    window = jnp.asarray([r + [0] * (16 - len(r)) for r in seq])
    logits = np.asarray(forward(params, window))
    for b, r in enumerate(seq):
      r.append(int(np.argmax(logits[b, len(r) - 1])))
  want = np.asarray([r[4:] for r in seq])
  np.testing.assert_array_equal(cached.tokens[:, :steps], want)
  np.testing.assert_array_equal(uncached.tokens[:, :steps], want)
  assert len(set(want.ravel().tolist())) > 2  # varied tokens, not one repeated
  # Past the block size both keep going (the cache re-encodes its last `keep` tokens).
  assert cached.tokens.shape == uncached.tokens.shape == (2, 30)
  assert int(cached.tokens.max()) < VOCAB and int(cached.lengths.min()) == 30


@pytest.mark.slow
def test_ragged_prompts_are_continued_as_if_alone(model_and_params, forward):
  # Prompts of 1, 3 and 7 tokens in one batch. Greedy tokens must equal the independent loop
  # (full forward pass, argmax at each row's own end) while they fit in block_size 16, and
  # equal each prompt generated alone all the way, past the block size (the rows' caches fill
  # and restart from their last `keep` tokens at different steps).
  model, params = model_and_params
  rng = np.random.default_rng(4)
  prompts = [rng.integers(0, VOCAB, n).tolist() for n in (1, 3, 7)]
  steps = 16 - 7
  seq = [list(p) for p in prompts]
  for _ in range(steps):
    logits = np.asarray(forward(params, jnp.asarray([r + [0] * (16 - len(r)) for r in seq])))
    for b, r in enumerate(seq):
      r.append(int(np.argmax(logits[b, len(r) - 1])))
  want = np.asarray([r[len(p):] for r, p in zip(seq, prompts)])
  for use_cache in (True, False):
    together = gpt.generate(model, params, prompts, jax.random.key(0), num_tokens=30,
                            temperature=0.0, use_cache=use_cache).tokens
    np.testing.assert_array_equal(together[:, :steps], want)
    for b, prompt in enumerate(prompts):
      alone = gpt.generate(model, params, prompt, jax.random.key(0), num_tokens=30,
                           temperature=0.0, use_cache=use_cache).tokens
      np.testing.assert_array_equal(together[b], alone[0])
  assert len(set(want.ravel().tolist())) > 2


def test_sampling_options_and_bad_prompts(model_and_params):
  model, params = model_and_params
  out = gpt.generate(model, params, [1, 2, 3], jax.random.key(5), num_tokens=8,
                     temperature=0.8, top_k=3, top_p=0.9)
  assert out.tokens.shape == (1, 8) and int(out.tokens.max()) < VOCAB
  for bad in (np.zeros((1, 0), np.int32), [[1, 2], []]):
    with pytest.raises(ValueError, match="non-empty list of token ids"):
      gpt.generate(model, params, bad, jax.random.key(0), num_tokens=2)
  with pytest.raises(ValueError, match=r"\[batch, len\] or \[len\]"):
    gpt.generate(model, params, np.zeros((1, 2, 3), np.int32), jax.random.key(0), num_tokens=2)
  with pytest.raises(ValueError, match="keep"):
    gpt.generate(model, params, [1], jax.random.key(0), num_tokens=2, keep=16)
  with pytest.raises(ValueError, match="valid sizes"):
    gpt.size_config("huge")


def test_generate_cli_rejects_a_nan_temperature(tmp_path, capsys):
  # Checked with the other flags, before the run is read: one line, status 2.
  argv = ["attnlab generate", f"--workdir={tmp_path / 'run'}", "--temperature=nan"]
  assert generate_cli.main(argv) == 2
  err = capsys.readouterr().err.strip()
  assert err == "attnlab generate: error: --temperature must be >= 0 (0 = greedy), got nan"


def test_generate_with_huge_temperature_never_samples_banned_ids(model_and_params):
  model, params = model_and_params
  banned = (0, 1, 2, 3, 4)
  out = gpt.generate(model, params, [[5, 6], [7]], jax.random.key(0), num_tokens=40,
                     temperature=1e12, banned_ids=banned)
  tokens = np.asarray(out.tokens)
  assert not np.isin(tokens, banned).any()
  assert len(set(tokens.ravel().tolist())) > 4  # near-uniform over the other ids


@pytest.mark.slow
@pytest.mark.parametrize("score", ["scaled_dot", "dot", "cosine", "general", "additive",
                                   "location"])
def test_each_score_trains(score):
  model = gpt.GPT(vocab_size=VOCAB, num_layers=1, num_heads=2, d_model=8, block_size=8,
                  attention=AttentionConfig(score=score))
  x = jnp.asarray(np.tile(np.arange(9) % 5, (4, 1)))  # a repeating pattern
  inputs, targets = x[:, :-1], x[:, 1:]
  params = model.init(jax.random.key(0), inputs)["params"]
  tx = optax.adam(1e-2)
  loss_fn = lambda p: optax.softmax_cross_entropy_with_integer_labels(
      model.apply({"params": p}, inputs), targets).mean()

  @jax.jit
  def steps(params):
    def body(carry, _):
      p, s = carry
      loss, g = jax.value_and_grad(loss_fn)(p)
      u, s = tx.update(g, s, p)
      return (optax.apply_updates(p, u), s), loss
    _, losses = jax.lax.scan(body, (params, tx.init(params)), None, length=15)
    return losses
  losses = np.asarray(steps(params))
  assert np.all(np.isfinite(losses))
  assert losses[-1] < 0.7 * losses[0], losses


# ----------------------------------------------------------------------------- config + task


def test_config_aliases_sizes_and_errors():
  config = _load_config("size=small,score=cosine,dataset=addition")
  assert (config.model.size, config.model.attention.score, config.data.name) == (
      "small", "cosine", "addition")
  assert config.batch_size == 12 and config.optimizer.b2 == 0.99
  assert config.optimizer.end_learning_rate == 1e-4 and config.optimizer.grad_clip == 1.0
  local = _load_config("runlocal=True")
  assert local.model.size == "tiny" and local.num_train_steps <= 20
  with pytest.raises(ConfigError, match="valid keys"):
    _load_config("sise=nano")


@pytest.mark.slow
def test_runlocal_shakespeare_trains_reloads_and_generates(tmp_path, shared_data, capsys):
  """The runlocal config end to end (plots included); then the checkpoint feeds the CLI."""
  config = _load_config(f"runlocal=True,num_train_steps=4,eval_every=2,checkpoint_every=2,"
                        f"data.manual_dir={shared_data},data.data_dir={tmp_path / 'tfds'},"
                        f"data.eval_windows=8,generate.num_tokens=10")
  run = tmp_path / "run"
  train.train_and_evaluate(config, run)
  records = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
  evals = [r for r in records if r["split"] == "eval"]
  assert [r["step"] for r in evals] == [2, 4]
  assert np.isfinite(evals[-1]["loss"]) and evals[-1]["perplexity"] > 1
  assert (run / "attention.png").stat().st_size > 0
  assert (run / "sample.txt").read_text().startswith("ROMEO:")
  capsys.readouterr()  # drop what training printed

  # Same prompt length and num_tokens as the sample above: the compiled sampler is reused.
  argv = ["attnlab generate", f"--workdir={run}", "--prompt=JULIET", "--num_tokens=10",
          "--temperature=0"]
  assert generate_cli.main(argv) == 0
  assert capsys.readouterr().out.startswith("JULIET")
  assert generate_cli.main(argv + ["--step=2"]) == 0  # an earlier checkpoint
  assert capsys.readouterr().out.startswith("JULIET")
  assert generate_cli.main(["attnlab generate", "--workdir=/nonexistent/run"]) == 2
  # Exactly --num_tokens characters: a barely trained model, sampled at temperature 1, would pick
  # special tokens (<end>, padding, [MASK], ...) among its ~70 ids unless they are never sampled;
  # and a warning that the run trained for a few steps only.
  assert generate_cli.main(["attnlab generate", f"--workdir={run}", "--prompt=ROMEO:",
                            "--num_tokens=100", "--temperature=1"]) == 0
  out, err = capsys.readouterr()
  assert out.startswith("ROMEO:") and len(out) == len("ROMEO:") + 100 + len("\n")
  assert "trained for only 4 steps (runlocal=True" in err
  assert generate_cli.main(["attnlab generate", f"--workdir={run}", "--temperature=-1"]) == 2

  # A reloaded run reads its validation text on request: the characters of the last 10% of
  # input.txt, through the run's own vocabulary (experiments/shakespeare/run.py uses it).
  reloaded = analysis.load_run(run)
  text = (pathlib.Path(shared_data) / "tinyshakespeare" / "input.txt").read_text()
  val_text = text[int(0.9 * len(text)):]
  ids = reloaded.task.validation_ids()
  assert ids.dtype == np.int32 and len(ids) == len(val_text)
  assert reloaded.task.tokenizer.decode(ids) == val_text
  # Prompts of different lengths in one batch: each continued as when sampled alone.
  prompts, options = ["ROMEO:", "To be, or not", "O"], dict(num_tokens=12, temperature=0.0)
  assert reloaded.task.sample_texts(reloaded.params, prompts, **options) == [
      reloaded.task.sample_text(reloaded.params, p, **options) for p in prompts]
  # The same through the command line: --prompt given twice, one text per prompt in order.
  argv = ["attnlab generate", f"--workdir={run}", "--num_tokens=12", "--temperature=0"]
  assert generate_cli.main(argv + [f"--prompt={p}" for p in prompts[:2]]) == 0
  alone = [p + reloaded.task.sample_text(reloaded.params, p, **options) for p in prompts[:2]]
  assert capsys.readouterr().out == "\n\n".join(alone) + "\n"


@pytest.mark.slow
def test_runlocal_addition_end_to_end(tmp_path):
  config = _load_config("runlocal=True,dataset=addition,num_train_steps=4,write_plots=False")
  state = train.train_and_evaluate(config, tmp_path)
  records = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  final = [r for r in records if r["split"] == "eval"][-1]
  assert 0.0 <= final["exact_match"] <= 1.0 and np.isfinite(final["loss"])
  assert int(state.step) == 4


def test_addition_exact_match_counts_only_correct_answers(tmp_path):
  from attnlab import tasks  # pylint: disable=g-import-not-at-top
  config = _load_config("runlocal=True,dataset=addition,data.num_eval=4")
  task = tasks.build_task(config)
  batch = task.eval_batches()[0]
  # A "model" that predicts the targets exactly: logits one-hot on the targets.
  one_hot = jax.nn.one_hot(batch["targets"], len(task.tokenizer)) * 10.0
  task.model = type("Oracle", (), {"apply": lambda self, v, x: one_hot})()
  exact, answers = task.metric_sums(None, batch)["exact_match"]
  assert float(exact) == float(answers) == 4
  wrong = batch["targets"].copy()
  row, col = 1, int(np.flatnonzero(batch["answer_mask"][1])[0])
  wrong[row, col] = (wrong[row, col] + 1) % len(task.tokenizer)
  one_hot = jax.nn.one_hot(wrong, len(task.tokenizer)) * 10.0
  task.model = type("Oracle", (), {"apply": lambda self, v, x: one_hot})()
  assert float(task.metric_sums(None, batch)["exact_match"][0]) == 3
  text = task.tokenizer.decode(batch["inputs"][0].tolist())
  assert "+" in text and "=" in text


def test_bad_config_values_raise_clear_errors(tmp_path):
  from attnlab import tasks  # pylint: disable=g-import-not-at-top
  for arg, pattern in [("size=huge", "valid sizes"),
                       ("dataset=wiki", "valid: tiny_shakespeare, text, addition"),
                       ("model.position=fourier", "valid: learned")]:
    with pytest.raises(ConfigError, match=pattern):
      tasks.build_task(_load_config(f"runlocal=True,dataset=addition,{arg}"))
  # The score name is checked once, where the config is read (config_utils.validate).
  with pytest.raises(ConfigError,
                     match="unknown model.attention.score 'fancy'; valid scores: dot, "):
    config_utils.validate(_load_config("runlocal=True,dataset=addition,score=fancy"))


@pytest.mark.slow
def test_rotary_gpt_is_causal_and_its_cache_matches_the_full_forward():
  model = gpt.GPT(vocab_size=VOCAB, position="rotary", **TINY)
  x = jnp.asarray(np.random.default_rng(4).integers(0, VOCAB, (2, 9)))
  params = jax.jit(model.init)(jax.random.key(2), x)["params"]
  assert "position" not in params["embed"]  # no table: queries and keys are rotated instead
  full = model.apply({"params": params}, x)  # [2, 9, vocab]
  changed = model.apply({"params": params}, x.at[:, 6].set((x[:, 6] + 1) % VOCAB))
  np.testing.assert_array_equal(changed[:, :6], full[:, :6])
  cache = gpt.init_cache(model, 2)
  first, cache = gpt.decode_chunk(model, params, cache, x[:, :4])
  rest = []
  for i in range(4, 9):
    logits, cache = gpt.decode_chunk(model, params, cache, x[:, i:i + 1])
    rest.append(logits)
  np.testing.assert_allclose(jnp.concatenate([first] + rest, axis=1), full, rtol=1e-4, atol=1e-4)

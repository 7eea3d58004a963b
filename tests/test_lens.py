"""Tests for the logit lens, direct logit attribution, attribution patching and the
duplicate-token detector (#52), against a NumPy GPT with biases written here."""

import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attnlab import config_utils
from attnlab import tasks
from attnlab.analysis import detectors
from attnlab.analysis import hooks
from attnlab.analysis import lens
from attnlab.models import gpt

REPO = pathlib.Path(__file__).resolve().parents[1]

# Clean tokens are ids below BASE; the ids from BASE on are per-(row, position) tokens whose
# embeddings the attribution-patching test sets to a clean token's plus a small perturbation.
BASE = 8
BATCH, LEN, LAYERS, HEADS, D = 2, 8, 2, 2, 16
VOCAB = BASE + BATCH * LEN


@pytest.fixture(scope="module")
def run():
  """(model, params) of a tiny GPT with biases, random enough to give varied activations."""
  model = gpt.GPT(vocab_size=VOCAB, num_layers=LAYERS, num_heads=HEADS, d_model=D, block_size=16,
                  use_bias=True)
  params = model.init(jax.random.key(0), jnp.zeros((1, LEN), jnp.int32))["params"]
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(1), len(leaves))
  params = jax.tree.unflatten(tree, [l + 0.3 * jax.random.normal(k, l.shape)
                                     for k, l in zip(keys, leaves)])
  return model, params


@pytest.fixture(scope="module")
def tokens():
  return np.random.default_rng(0).integers(0, BASE, (BATCH, LEN)).astype(np.int32)


def _layer_norm(x, scale, bias, eps=1e-5):
  centred = x - x.mean(-1, keepdims=True)
  r = 1 / np.sqrt((centred * centred).mean(-1, keepdims=True) + eps)
  return centred * r * scale + bias, r


def numpy_gpt(params, ids):
  """(logits, {name: value}) of attnlab's GPT with biases (learned positions, pre-LN, tied
  head, gelu_tanh) in float64: the residual stream, each head's output z_h @ W_O[h] `[heads,
  batch, len, d]`, the out bias, the MLP outputs and the final norm's 1 / std."""
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
  batch, length = ids.shape
  table = p["embed"]["token"]["embedding"]
  x = table[ids] + p["embed"]["position"][:length]
  acts = {"embed": x, "resid": [x]}
  causal = np.tril(np.ones((length, length), bool))
  split = lambda t: t.reshape(batch, length, HEADS, -1).transpose(0, 2, 1, 3)
  for i in range(LAYERS):
    b = p[f"block_{i}"]
    a = b["self_attention"]
    h, _ = _layer_norm(x, b["ln_1"]["scale"], b["ln_1"]["bias"])
    q, k, v = (split(h @ a[f"{n}_kernel"] + a[f"{n}_bias"]) for n in ("query", "key", "value"))
    scores = np.where(causal, q @ k.transpose(0, 1, 3, 2) / math.sqrt(q.shape[-1]), -np.inf)
    w = np.exp(scores - scores.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)  # [batch, heads, q, k]
    z = (w @ v).transpose(0, 2, 1, 3)  # [batch, len, heads, head_dim]
    w_o = a["out"]["kernel"].reshape(HEADS, -1, D)  # [heads, head_dim, d]
    acts[f"heads.{i}"] = np.einsum("blhk,hkd->hbld", z, w_o)
    acts[f"out_bias.{i}"] = a["out"]["bias"]
    attn = acts[f"heads.{i}"].sum(0) + a["out"]["bias"]
    acts[f"blocks.{i}.attn_out"] = attn
    x = x + attn
    h, _ = _layer_norm(x, b["ln_2"]["scale"], b["ln_2"]["bias"])
    fc = h @ b["mlp"]["fc"]["kernel"] + b["mlp"]["fc"]["bias"]
    gelu = 0.5 * fc * (1 + np.tanh(math.sqrt(2 / math.pi) * (fc + 0.044715 * fc ** 3)))
    mlp = gelu @ b["mlp"]["proj"]["kernel"] + b["mlp"]["proj"]["bias"]
    acts[f"blocks.{i}.mlp_out"] = mlp
    x = x + mlp
    acts["resid"].append(x)
  final, acts["r"] = _layer_norm(x, p["ln_f"]["scale"], p["ln_f"]["bias"])
  return final @ table.T, acts


# ---------------------------------------------------------------------- logit lens, attribution


def test_logit_lens_is_each_residual_through_a_fresh_final_norm(run, tokens):
  model, params = run
  got = lens.logit_lens(run, tokens)
  assert got.shape == (LAYERS + 1, BATCH, LEN, VOCAB)
  logits, acts = numpy_gpt(params, tokens)
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
  for layer, resid in enumerate(acts["resid"]):
    normed, _ = _layer_norm(resid, p["ln_f"]["scale"], p["ln_f"]["bias"])
    np.testing.assert_allclose(got[layer], normed @ p["embed"]["token"]["embedding"].T,
                               rtol=1e-4, atol=1e-4, err_msg=str(layer))
  np.testing.assert_allclose(got[-1], logits, rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(got[-1], model.apply({"params": params}, tokens), atol=1e-5)
  assert np.abs(got[0] - got[-1]).max() > 1.0  # the layers read differently
  ids = np.array([3, 4])
  np.testing.assert_allclose(lens.logit_lens(run, tokens, ids=ids), got[..., ids], atol=1e-6)


def test_logit_attribution_matches_numpy_and_sums_to_the_logits(run, tokens):
  _, params = run
  dla = lens.logit_attribution(run, tokens)
  logits, acts = numpy_gpt(params, tokens)
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
  gamma, beta, table = p["ln_f"]["scale"], p["ln_f"]["bias"], p["embed"]["token"]["embedding"]
  # Each component centred, times the forward pass's 1 / std and gamma, then unembedded.
  through = lambda c: ((c - c.mean(-1, keepdims=True)) * acts["r"] * gamma) @ table.T
  names = ["embed"] + [f"blocks.{i}.{part}" for i in range(LAYERS)
                       for part in ("attn_out", "mlp_out")]
  assert list(dla.components) == names
  for name in names:
    np.testing.assert_allclose(dla.components[name], through(acts[name]), rtol=1e-4, atol=1e-4,
                               err_msg=name)
  for i in range(LAYERS):
    np.testing.assert_allclose(dla.heads[i], through(acts[f"heads.{i}"]), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(dla.head_bias[i],
                               through(np.broadcast_to(acts[f"out_bias.{i}"], (BATCH, LEN, D))),
                               rtol=1e-4, atol=1e-4)
    # The heads and the bias make up the block's attention output.
    np.testing.assert_allclose(dla.heads[i].sum(0) + dla.head_bias[i],
                               dla.components[f"blocks.{i}.attn_out"], rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(dla.bias, table @ beta, rtol=1e-5, atol=1e-5)
  # The components and the final norm's bias term sum to the logits.
  total = sum(through(acts[n]) for n in names) + table @ beta
  np.testing.assert_allclose(total, logits, rtol=1e-9, atol=1e-9)  # the identity, in float64
  np.testing.assert_allclose(sum(dla.components.values()) + dla.bias, logits, rtol=1e-4,
                             atol=1e-4)
  np.testing.assert_allclose(dla.logits, logits, rtol=1e-4, atol=1e-4)
  # Margins far above rounding: every part is large, and none alone is the logits.
  for name in names:
    assert np.abs(dla.components[name]).max() > 0.5, name
    assert np.abs(dla.components[name] - logits).max() > 0.5, name
  assert np.abs(dla.heads).reshape(LAYERS * HEADS, -1).max(1).min() > 0.1
  ids = np.array([3, 4])
  few = lens.logit_attribution(run, tokens, ids=ids)
  np.testing.assert_allclose(few.heads, dla.heads[..., ids], atol=1e-6)
  np.testing.assert_allclose(few.logits, dla.logits[..., ids], atol=1e-6)


def test_attention_only_attribution_has_no_mlp_components():
  model = gpt.GPT(vocab_size=VOCAB, num_layers=LAYERS, num_heads=HEADS, d_model=D,
                  block_size=16, mlp_ratio=0)
  x = jnp.zeros((1, LEN), jnp.int32)
  params = model.init(jax.random.key(2), x)["params"]
  dla = lens.logit_attribution((model, params), x)
  assert list(dla.components) == ["embed", "blocks.0.attn_out", "blocks.1.attn_out"]
  np.testing.assert_allclose(sum(dla.components.values()) + dla.bias, dla.logits, atol=1e-5)


# ---------------------------------------------------------------------- attribution patching


def _metric(logits):
  """Logit difference of tokens 3 and 4 at the last position."""
  return jnp.mean(logits[:, -1, 3] - logits[:, -1, 4])


def _perturbed(params, clean, eps, noise):
  """Params whose token (BASE + row * LEN + position) embeds as the clean token there plus
  eps * noise[row, position]; and those corrupted ids."""
  table = np.array(params["embed"]["token"]["embedding"])
  ids = BASE + np.arange(BATCH * LEN).reshape(BATCH, LEN)
  table[ids] = table[clean] + eps * noise
  new = jax.tree.map(lambda a: a, params)
  new["embed"] = dict(new["embed"], token={"embedding": jnp.asarray(table)})
  return new, ids.astype(np.int32)


@pytest.mark.parametrize("site,over", [("resid_pre", "position"), ("attn.z", "head")])
def test_attribution_patching_agrees_with_exact_patching_as_the_perturbation_shrinks(
    run, tokens, site, over):
  model, params = run
  noise = np.random.default_rng(5).normal(size=(BATCH, LEN, D))
  errors = []
  for eps in (1e-1, 1e-2, 1e-3):
    perturbed, corrupted = _perturbed(params, tokens, eps, noise)
    pair = (model, perturbed)
    base = float(_metric(hooks.run_with_hooks(pair, corrupted, [])))
    exact = hooks.patch_sweep(pair, tokens, corrupted, _metric, site=site, over=over)
    approx = lens.attribution_patch(pair, tokens, corrupted, _metric, site=site, over=over)
    assert approx.shape == exact.shape == ((LAYERS, LEN) if over == "position"
                                           else (LAYERS, HEADS))
    effect = np.abs(exact - base).max()
    assert effect > 0.1 * eps  # the patch moves the metric, in proportion to eps
    errors.append(np.abs(approx - exact).max() / effect)
  # First order: the relative error shrinks with eps, by about eps's factor once eps is small
  # (measured: resid_pre 0.14, 0.016, 0.0018; attn.z 0.14, 0.067, 0.0067, whose second-order
  # terms partly cancel at 0.1); float32 rounding is ~1e-4 of the effect at eps = 1e-3.
  assert errors[0] < 0.5, errors
  assert errors[1] < errors[0] and errors[2] < errors[1] / 4, errors
  assert errors[2] < 0.02, errors


def test_attribution_patching_at_the_clean_run_is_the_clean_metric(run, tokens):
  exact = hooks.patch_sweep(run, tokens, tokens, _metric, site="attn.z", over="position_head")
  approx = lens.attribution_patch(run, tokens, tokens, _metric, site="attn.z",
                                  over="position_head")
  assert approx.shape == (LAYERS, LEN, HEADS)
  np.testing.assert_allclose(approx, exact, atol=1e-5)


# ---------------------------------------------------------------------- duplicate-token detector

T = 6


def test_duplicate_token_score_is_one_on_a_perfect_pattern_and_chance_on_random_ones():
  w = np.zeros((3, 2, 2 * T, 2 * T))
  for q in range(2 * T):
    if q >= T:
      w[:, :, q, q - T] = 0.4  # a row summing to 0.4 (sigmoid-like): its share counts
    else:
      w[:, :, q, :q + 1] = 1 / (q + 1)
  np.testing.assert_allclose(detectors.duplicate_token_score(w, T), 1.0, rtol=1e-6)
  assert np.all(np.asarray(detectors.induction_score(w, T)) < 0.3)
  rng = np.random.default_rng(0)
  w = rng.exponential(size=(400, 2, 2 * T, 2 * T)) * np.tril(np.ones((2 * T, 2 * T)))
  w /= w.sum(-1, keepdims=True)
  chance = np.mean(1 / (np.arange(T, 2 * T) + 1))
  np.testing.assert_allclose(detectors.chance_scores(T)["duplicate_token"], chance)
  np.testing.assert_allclose(detectors.duplicate_token_score(w, T), chance, rtol=0.05)
  with pytest.raises(ValueError, match="2 \\* seq_len"):
    detectors.duplicate_token_score(w[:, :, :-1], T)


# ---------------------------------------------------------------------- induction task


def test_induction_task_batches_and_copy_loss():
  config = config_utils.load_config_file(
      f"{REPO / 'configs' / 'gpt.py'}:dataset=induction,runlocal=True,model.mlp_ratio=0,"
      "data.vocab_size=20,data.max_span=6,data.num_eval=24,data.eval_batch_size=16,batch_size=4")
  task = tasks.build_task(config)
  block = task.block_size
  batches = task.eval_batches()
  batch = {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}
  assert batch["inputs"].shape == (24, block)
  np.testing.assert_array_equal(batch["inputs"][:, 1:], batch["targets"][:, :-1])
  for row in range(24):
    ids = np.concatenate([batch["inputs"][row], batch["targets"][row, -1:]])  # [block + 1]
    copied = np.flatnonzero(batch["copy_mask"][row]) + 1  # ids the masked targets are
    assert 1 <= len(copied) <= 5 and np.all(np.diff(copied) == 1)
    # Each masked target repeats the id after an earlier occurrence of its input's id, at one
    # offset for the whole segment, the first copied id included (copied[0] - 1).
    offsets = [o for o in range(1, copied[0]) if np.array_equal(
        ids[copied[0] - 1 - o:copied[-1] + 1 - o], ids[copied[0] - 1:copied[-1] + 1])]
    assert offsets, row
  # The same sequences, and the training batches, are drawn again from the data seed.
  again = tasks.build_task(config)
  np.testing.assert_array_equal(again.eval_batches()[0]["inputs"], batches[0]["inputs"])
  first = next(iter(task.train_iterator()))
  np.testing.assert_array_equal(next(iter(again.train_iterator()))["inputs"], first["inputs"])
  assert first["inputs"].shape == (4, block)
  # copy_loss: the mean cross-entropy over the masked targets only.
  params = task.init(jax.random.key(0))
  sums = task.metric_sums(params, batches[0])
  logits = np.asarray(task.model.apply({"params": params}, batches[0]["inputs"]), np.float64)
  logp = logits - logits.max(-1, keepdims=True)
  logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
  nll = -np.take_along_axis(logp, batches[0]["targets"][..., None], -1)[..., 0]
  mask = batches[0]["copy_mask"]
  total, count = (float(v) for v in sums["copy_loss"])
  np.testing.assert_allclose(count, mask.sum())
  np.testing.assert_allclose(total / count, (nll * mask).sum() / mask.sum(), rtol=1e-5)
  assert abs(total / count - nll.mean()) > 1e-4  # not the plain loss


def test_induction_training_order_is_a_permutation_per_epoch_drawn_from_the_seed():
  # Each epoch walks the training sequences in the permutation of (seed, epoch), so the
  # replicas of a num_seeds run (seeds 0, 1, ...) see the same sequences in different orders.
  arg = (f"{REPO / 'configs' / 'gpt.py'}:dataset=induction,runlocal=True,model.mlp_ratio=0,"
         "data.vocab_size=20,data.max_span=6,data.num_train=10,data.seed=3,batch_size=4")
  orders = {}
  for seed in (0, 1):
    task = tasks.build_task(config_utils.load_config_file(f"{arg},seed={seed}"))
    rows = np.asarray([ex["ids"][:-1] for ex in task.induction_train])  # [10, block]
    it = iter(task.train_iterator())
    got = np.concatenate([next(it)["inputs"] for _ in range(5)])  # 20 rows: two epochs
    expected = np.concatenate([np.random.default_rng([seed, epoch]).permutation(10)
                               for epoch in (0, 1)])
    np.testing.assert_array_equal(got, rows[expected])
    orders[seed] = expected
  assert not np.array_equal(orders[0], orders[1])

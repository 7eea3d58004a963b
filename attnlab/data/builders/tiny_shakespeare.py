"""`tiny_shakespeare`: character-level language-model text, nanoGPT's 90/10 split.

Examples: one per split, `{"text": str}` holding the whole split (train = the first 90% of the
characters of input.txt, validation = the last 10%). `split_documents` cuts a split's text into
documents of sentences for BERT pretraining (one speech = one document).
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
from typing import Any, Mapping

import tensorflow_datasets as tfds

from attnlab.data.builders import base


@dataclasses.dataclass(eq=False)
class TinyShakespeareConfig(tfds.core.BuilderConfig):
  """How the text is split."""

  # Fraction of the characters (from the start) that form the train split; the rest is validation.
  train_fraction: float = 0.9


class TinyShakespeare(base.RawFileBuilder, skip_registration=True):
  """Tiny Shakespeare as one text per split (nanoGPT's split: first 90% train, last 10% validation).

  The config name ("nanogpt") keeps the prepared files apart from TFDS's own `tiny_shakespeare`
  (90/5/5 split) when both share a data dir.
  """

  name = "tiny_shakespeare"
  BUILDER_CONFIGS = [TinyShakespeareConfig(
      name="nanogpt", description="first 90% of the characters train, last 10% validation")]
  SOURCE = base.RawSource(
      folder="tinyshakespeare",
      files=("input.txt",),
      url=("https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/"
           "input.txt"),
      # Size and sha256 of ../shared/data/tinyshakespeare/input.txt, the same file as the URL's.
      size=1_115_394,
      sha256="86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed",
  )
  SPLITS = ("train", "validation")
  DESCRIPTION = "40,000 lines of Shakespeare plays (char-rnn's tinyshakespeare), for character LMs."
  HOMEPAGE = "https://github.com/karpathy/char-rnn"
  CITATION = "@misc{karpathy2015charrnn, author={Andrej Karpathy}, title={char-rnn}, year={2015}}"

  def _features(self) -> tfds.features.FeaturesDict:
    return tfds.features.FeaturesDict({"text": tfds.features.Text()})

  def _parse(self, paths: dict[str, pathlib.Path]) -> tuple[dict[str, list[dict]], dict]:
    text = base.read_text(paths["input.txt"])
    cut = int(len(text) * self.builder_config.train_fraction)
    splits = {"train": [{"text": text[:cut]}], "validation": [{"text": text[cut:]}]}
    # A split with no characters would be an empty training or evaluation run.
    splits = {k: v if v[0]["text"] else [] for k, v in splits.items()}
    return splits, {"num_chars": {"train": cut, "validation": len(text) - cut}}

  @classmethod
  def to_example(cls, record: Mapping[str, Any], **options: Any) -> dict[str, Any]:
    return {"text": base.as_str(record["text"])}


# A speech is a block of lines between blank lines; its first line names the speaker ("KING:").
_BLOCK_SEP = re.compile(r"\n\s*\n")
# A sentence ends at '.', '!' or '?' followed by white space.
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def split_documents(text: str) -> list[list[str]]:
  """Cuts play text into documents of sentences: one document per speech.

  Speaker lines (the first line of a block when it ends with ':') are dropped, the speech's
  lines joined with spaces and split after '.', '!' or '?'. Speeches of one sentence are kept
  (a next-sentence-prediction sampler decides what to do with them).
  """
  documents = []
  for block in _BLOCK_SEP.split(text):
    lines = [line.strip() for line in block.split("\n") if line.strip()]
    if lines and lines[0].endswith(":"):
      lines = lines[1:]
    if not lines:
      continue
    sentences = [s for s in _SENTENCE_END.split(" ".join(lines)) if s]
    documents.append(sentences)
  return documents

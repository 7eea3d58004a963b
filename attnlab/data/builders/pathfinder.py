"""`pathfinder`: the Pathfinder task (Linsley et al. 2018) at 32x32, as in the Long Range Arena.

An image shows a few dashed curved paths on a black background and two marked end points (small
white squares); the label says whether the two markers lie at the two ends of one path (1) or on
two different paths (0). A model reads the image as a sequence of 1,024 pixels (row by row), so it
must trace a path over long distances.

Generator (written from the published description; the settings are `PathfinderConfig` fields):
- A path is a smooth random curve: it starts at a random point with a random heading, advances
  one pixel per step, and turns by an angle uniform in [-max_turn, max_turn] radians per step;
  its pixels (rounded positions) are 8-connected. It is drawn dashed: `dash_len` pixels on,
  `gap_len` pixels off, along the curve.
- Every image has two long paths A and B (`path_len` steps each) and `num_distractors` shorter
  ones (`distractor_len` steps). Positive (label 1, half of the examples, drawn at random): the
  markers sit on both ends of A. Negative (label 0): one marker on an end of A, one on an end of
  B, placed so that the two markers are as far apart (within 2 pixels) as A's two ends are. So
  both classes show the same number of paths of the same lengths with markers about as far apart,
  and only tracing tells them apart.
- Each path with its markers (a 3x3 square centred on a marked end) is placed where no pixel of it
  comes within Chebyshev distance `gap_len + 1` of any pixel of an earlier path or marker
  (rejection sampling), and every path stays inside the image. Hence the label is exactly what a
  flood fill over the lit pixels that steps at most `gap_len + 1` pixels (bridging the dash gaps)
  gives: the markers are in one component iff the label is 1 (tests/test_long_range.py checks
  this on every generated image).

Pixels: 0 background, 255 paths and markers (uint8). Sizes (builder configs): runlocal
(200/50/50 images), cpu (20,000/2,000/2,000), paper (160,000/20,000/20,000: LRA's Pathfinder-32
split of 200,000 images).

Examples: `{"image": uint8 [32, 32], "markers": int32 [2, 2] ((row, col) centres of the two
marker squares), "label": int (1 = connected)}`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator, Mapping

import numpy as np
import tensorflow_datasets as tfds

from attnlab.data.builders import generated
from attnlab.errors import DataError

# Pixel value of paths and markers (the background is 0).
ON = 255
# Half the side of a marker square (3x3).
MARKER_RADIUS = 1
# Placement attempts per path before the whole image is drawn again.
_TRIES = 200
# Whole-image attempts before the generator gives up (the settings leave no room).
_IMAGE_TRIES = 100
# Negatives: the markers' distance is within this many pixels of the span of path A.
_DISTANCE_TOLERANCE = 2.0


@dataclasses.dataclass(eq=False)
class PathfinderConfig(generated.GeneratedConfig):
  """Sizes and drawing settings of Pathfinder."""

  # Side of the square image in pixels (LRA: 32, i.e. 1,024-pixel sequences).
  size: int = 32
  # Steps (pixels) of the two long paths.
  path_len: int = 24
  # Distractor paths and their steps.
  num_distractors: int = 2
  distractor_len: int = 12
  # Largest turn per step in radians (the curvature).
  max_turn: float = 0.3
  # Dashes: `dash_len` pixels drawn, then `gap_len` left dark.
  dash_len: int = 3
  gap_len: int = 1


def curve(rng: np.random.Generator, steps: int, size: int, max_turn: float,
          margin: int) -> np.ndarray | None:
  """int `[steps + 1, 2]` (row, col) pixels of a smooth random curve inside the image (at least
  `margin` pixels from the border), 8-connected; None if it left the image."""
  pos = rng.uniform(margin, size - 1 - margin, size=2)
  heading = rng.uniform(0, 2 * np.pi)
  turns = rng.uniform(-max_turn, max_turn, size=steps)
  points = [pos.copy()]
  for turn in turns:
    heading += turn
    pos = pos + (np.sin(heading), np.cos(heading))
    points.append(pos.copy())
  pixels = np.rint(np.asarray(points)).astype(np.int64)  # [steps + 1, 2]
  if pixels.min() < margin or pixels.max() > size - 1 - margin:
    return None
  return pixels


def dashed(pixels: np.ndarray, dash_len: int, gap_len: int) -> np.ndarray:
  """The pixels of `pixels` (in order along the curve) that a dash covers."""
  keep = (np.arange(len(pixels)) % (dash_len + gap_len)) < dash_len
  keep[-1] = True  # both ends are drawn (markers sit there)
  return pixels[keep]


def _square(center: np.ndarray, radius: int) -> np.ndarray:
  offsets = np.arange(-radius, radius + 1)
  grid = np.stack(np.meshgrid(offsets, offsets, indexing="ij"), -1).reshape(-1, 2)
  return center[None, :] + grid  # [(2r+1)^2, 2]


def _dilate(mask: np.ndarray, radius: int) -> np.ndarray:
  """Every pixel within Chebyshev distance `radius` of a True pixel of `mask`."""
  out = mask.copy()
  padded = np.pad(mask, radius)
  size = mask.shape[0]
  for dr in range(-radius, radius + 1):
    for dc in range(-radius, radius + 1):
      out |= padded[radius + dr:radius + dr + size, radius + dc:radius + dc + mask.shape[1]]
  return out


def draw(rng: np.random.Generator, config: PathfinderConfig,
         label: int) -> tuple[np.ndarray, np.ndarray] | None:
  """(uint8 image `[size, size]` with `label`, int32 `[2, 2]` (row, col) centres of the two
  markers) (module docstring), or None if the paths found no room within the attempts."""
  size = config.size
  reach = config.gap_len + 1  # how far a flood fill over a dashed path must step
  occupied = np.zeros((size, size), bool)  # lit pixels of the placed paths and markers
  image = np.zeros((size, size), np.uint8)
  lengths = [config.path_len, config.path_len] + [config.distractor_len] * config.num_distractors
  ends: list[np.ndarray] = []
  first_path = None  # path A's pixels
  for index, steps in enumerate(lengths):
    # Which ends of this path carry a marker.
    if index == 0:
      marked = [0, -1] if label == 1 else [0]
    elif index == 1:
      marked = [] if label == 1 else [0]
    else:
      marked = []
    blocked = _dilate(occupied, reach)
    for _ in range(_TRIES):
      pixels = curve(rng, steps, size, config.max_turn, margin=MARKER_RADIUS)
      if pixels is None:
        continue
      if index == 1 and label == 0:
        # The markers of a negative are as far apart as a path's two ends (A's), so that their
        # distance does not give the label away.
        span = float(np.hypot(*(first_path[-1] - first_path[0])))
        if abs(float(np.hypot(*(pixels[0] - ends[0]))) - span) > _DISTANCE_TOLERANCE:
          continue
      drawn = dashed(pixels, config.dash_len, config.gap_len)
      squares = [_square(pixels[end], MARKER_RADIUS) for end in marked]
      lit = np.concatenate([drawn, *squares]) if squares else drawn
      if blocked[lit[:, 0], lit[:, 1]].any():
        continue
      occupied[lit[:, 0], lit[:, 1]] = True
      image[lit[:, 0], lit[:, 1]] = ON
      ends.extend(pixels[end] for end in marked)
      if index == 0:
        first_path = pixels
      break
    else:
      return None
  return image, np.asarray(ends, np.int32)


class Pathfinder(generated.GeneratedBuilder, skip_registration=True):
  """Generated Pathfinder images and their connectivity labels (module docstring)."""

  name = "pathfinder"
  # The examples are a function of the generator's code: a change to it needs a new VERSION.
  CONFIG_CLASS = PathfinderConfig
  BUILDER_CONFIGS = [
      PathfinderConfig(name="runlocal", description="seconds-long checks", num_train=200,
                       num_validation=50, num_test=50),
      PathfinderConfig(name="cpu", description="the reduced scale of the CPU study",
                       num_train=20_000, num_validation=2_000, num_test=2_000),
      PathfinderConfig(name="paper", description="LRA's Pathfinder-32 size",
                       num_train=160_000, num_validation=20_000, num_test=20_000),
  ]
  DESCRIPTION = ("Pathfinder (Linsley et al. 2018) at 32x32 as in the Long Range Arena: are the "
                 "two marked end points connected by a dashed path? Generated from a seed.")
  HOMEPAGE = "https://github.com/google-research/long-range-arena"
  CITATION = ("@inproceedings{linsley2018learning, title={Learning long-range spatial "
              "dependencies with horizontal gated recurrent units}, author={Linsley, Drew and "
              "others}, booktitle={NeurIPS}, year={2018}}")

  def _features(self) -> tfds.features.FeaturesDict:
    size = self.builder_config.size
    return tfds.features.FeaturesDict({
        "image": tfds.features.Tensor(shape=(size, size), dtype=np.uint8),
        "markers": tfds.features.Tensor(shape=(2, 2), dtype=np.int32),
        "label": tfds.features.ClassLabel(names=["disconnected", "connected"]),
    })

  @classmethod
  def check_config(cls, config: PathfinderConfig) -> None:
    super().check_config(config)
    if config.size < 8 or config.path_len < 2 or config.distractor_len < 2:
      raise DataError(f"pathfinder: need size >= 8 and path lengths >= 2, got size="
                      f"{config.size}, path_len={config.path_len}, distractor_len="
                      f"{config.distractor_len}")
    if config.dash_len < 1 or config.gap_len < 0 or config.num_distractors < 0:
      raise DataError("pathfinder: need dash_len >= 1, gap_len >= 0, num_distractors >= 0")

  @classmethod
  def generate(cls, config: PathfinderConfig, split: str, rng: np.random.Generator,
               count: int) -> Iterator[dict[str, Any]]:
    for _ in range(count):
      label = int(rng.integers(2))
      for _ in range(_IMAGE_TRIES):
        drawn = draw(rng, config, label)
        if drawn is not None:
          break
      else:
        raise DataError(f"pathfinder: no room for {2 + config.num_distractors} paths in a "
                        f"{config.size}x{config.size} image after {_IMAGE_TRIES} attempts; "
                        f"use fewer or shorter paths")
      image, markers = drawn
      yield {"image": image, "markers": markers, "label": label}

  @classmethod
  def to_example(cls, record: Mapping[str, Any], **options: Any) -> dict[str, Any]:
    return {"image": np.asarray(record["image"], np.uint8),
            "markers": np.asarray(record["markers"], np.int32), "label": int(record["label"])}

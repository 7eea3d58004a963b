"""Builders whose examples are generated from a seed (no raw files): the base of listops and
pathfinder.

A generated dataset's sizes and generator settings are a TFDS `BuilderConfig`: the presets
`runlocal` (seconds), `cpu` (the reduced scale of the CPU study) and `paper` (the Long Range Arena
sizes) are registered, and `custom_config(**fields)` makes one with other settings whose name
encodes them, so that every setting is prepared once into its own folder of the data dir
(`<data_dir>/<name>/<config name>/<version>/`).
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, ClassVar, Iterator

import numpy as np
import tensorflow_datasets as tfds

from attnlab.data.builders import base
from attnlab.errors import DataError


@dataclasses.dataclass(eq=False)
class GeneratedConfig(tfds.core.BuilderConfig):
  """Sizes and seed of a generated dataset (subclasses add the generator's settings)."""

  # Examples of each split.
  num_train: int = 0
  num_validation: int = 0
  num_test: int = 0
  # Seed of the generator; split i draws from np.random.default_rng([seed, i]).
  seed: int = 0

  def settings(self) -> dict[str, Any]:
    """Every field but the TFDS ones (name, description, ...): what decides the examples."""
    skip = {f.name for f in dataclasses.fields(tfds.core.BuilderConfig)}
    return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in skip}


class GeneratedBuilder(base.RawFileBuilder, skip_registration=True):
  """A builder that draws its examples from a seeded generator instead of reading raw files.

  Subclasses set `BUILDER_CONFIGS` (presets named runlocal, cpu, paper; the first is TFDS's
  default), `CONFIG_CLASS` and define `_features`, `generate(config, split, rng, count)` (a list
  of TFDS examples) and `to_example`.
  """

  SPLITS = ("train", "validation", "test")
  CONFIG_CLASS: ClassVar[type[GeneratedConfig]] = GeneratedConfig

  @tfds.core.utils.classproperty
  @classmethod
  def url_infos(cls) -> dict[str, Any] | None:
    return None  # nothing is downloaded

  @classmethod
  def preset_names(cls) -> tuple[str, ...]:
    return tuple(c.name for c in cls.BUILDER_CONFIGS)

  @classmethod
  def preset(cls, name: str) -> GeneratedConfig:
    """The registered config `name`; DataError listing the presets otherwise."""
    for config in cls.BUILDER_CONFIGS:
      if config.name == name:
        return config
    raise DataError(f"{cls.name}: unknown size {name!r}; valid sizes: "
                    f"{', '.join(cls.preset_names())}")

  @classmethod
  def custom_config(cls, preset: str = "runlocal", **fields: Any) -> GeneratedConfig:
    """The preset `preset` with `fields` changed; the preset itself when nothing changes.

    The config's name is `<preset>-<hash of the settings>`, so a custom setting is prepared once
    into its own folder and never mixed with another's examples.
    """
    base_config = cls.preset(preset)
    settings = base_config.settings()
    unknown = sorted(set(fields) - set(settings))
    if unknown:
      raise DataError(f"{cls.name}: unknown generator setting(s) {', '.join(unknown)}; valid: "
                      f"{', '.join(settings)}")
    changed = {k: v for k, v in fields.items() if settings[k] != v}
    if not changed:
      return base_config
    settings.update(changed)
    digest = hashlib.sha256(repr(sorted(settings.items())).encode()).hexdigest()[:10]
    desc = ", ".join(f"{k}={v}" for k, v in sorted(changed.items()))
    config = cls.CONFIG_CLASS(name=f"{preset}-{digest}", description=f"{preset} with {desc}",
                              **settings)
    cls.check_config(config)
    return config

  @classmethod
  def check_config(cls, config: GeneratedConfig) -> None:
    """Raises DataError for settings the generator cannot satisfy (subclasses add checks)."""
    for split in cls.SPLITS:
      if getattr(config, f"num_{split}") < 1:
        raise DataError(f"{cls.name}: num_{split} must be >= 1, got "
                        f"{getattr(config, f'num_{split}')}")

  def _split_generators(self, dl_manager: Any) -> dict[str, Iterator[tuple[int, dict]]]:
    del dl_manager
    config = self.builder_config
    self.check_config(config)
    self.info.metadata.update({"origin": f"generated (seed {config.seed})",
                               "settings": {k: (list(v) if isinstance(v, tuple) else v)
                                            for k, v in config.settings().items()}})
    return {split: self._generate_examples(
                self.generate(config, split, np.random.default_rng([config.seed, i]),
                              getattr(config, f"num_{split}")))
            for i, split in enumerate(self.SPLITS)}

  @classmethod
  def generate(cls, config: GeneratedConfig, split: str, rng: np.random.Generator,
               count: int) -> Iterator[dict[str, Any]]:
    """`count` TFDS examples of `split` drawn from `rng` (yielded one by one)."""
    raise NotImplementedError

"""Sweep: the three pooling kernels of the Nadaraya-Watson study, over three seeds (9 runs).

  python -m attnlab.cli sweep --sweep_file=configs/sweeps/nadaraya_watson_kernels.py --workdir=runs/nw_sweep
  attnlab sweep --sweep_file=configs/sweeps/nadaraya_watson_kernels.py --workdir=runs/nw_sweep --parallel=2
Results: runs/nw_sweep/summary.md (test MSE mean ± std over seeds per kernel).
"""


def get_sweep() -> dict:
  return {
      # Base config, relative to this file: path.py[:key=value,...] as for --config.
      "config": "../nadaraya_watson.py",
      # Config key -> values; every combination runs in DIR/<key=value,...>/.
      "axes": {
          "model.kernel": ["average", "gaussian", "learned"],
          "seed": [0, 1, 2],
      },
  }

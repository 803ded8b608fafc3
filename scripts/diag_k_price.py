"""Run an evaluation script with rdkv's K price scaled, or priced from the mean output: does the allocator spend
too much of a small budget on key precision?

    python diag_k_price.py eval_retrieval --contexts 4000 8000 --budgets 0.1 --protocols agnostic --methods rdkv-recon-noprior rdkv-recon-noprior:pool=9

The variant rides on the prior's ``pool`` option, which nothing reads once ``surprisal`` is 0 (as in
``rdkv-recon-noprior``): pool 9, 11 and 13 multiply every K table by 0.1, 0.01 and 0.001 (``LayerTables.dk``); pool
15 prices K and light-token eviction from the weight queries' mean output, as before each key's own distance to its
readers was measured (``AttentionSums.drift``). A diagnostic, not a method: the package has no such knob.
"""
from __future__ import annotations

import dataclasses
import importlib
import sys

import rdkv.methods.rate_distortion as rate_distortion

K_SCALE = {9: 0.1, 11: 0.01, 13: 0.001}
MEAN_OUTPUT = 15
_tables, _layer_tables = rate_distortion.RDKV.tables, rate_distortion.layer_tables
_mean_output = [False]


def layer_tables(k, v, present, sums, *args, **kwargs):
    if _mean_output[0]:
        sums = dataclasses.replace(sums, drift=None)
    return _layer_tables(k, v, present, sums, *args, **kwargs)


def tables(self, layer, surprise, gain=1.0):
    _mean_output[0] = self.prior.pool == MEAN_OUTPUT
    t = _tables(self, layer, surprise, gain)
    scale = K_SCALE.get(self.prior.pool)
    return dataclasses.replace(t, dk=t.dk * scale) if scale else t


if __name__ == "__main__":
    rate_distortion.layer_tables, rate_distortion.RDKV.tables = layer_tables, tables
    script = sys.argv[1]
    sys.argv = [f"{script}.py", *sys.argv[2:]]
    importlib.import_module(script).main()

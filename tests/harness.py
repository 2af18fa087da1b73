"""Run one transform directly on update tensors, keeping its state across steps."""

from __future__ import annotations

from collections import defaultdict

import torch

from modopt.core.step import Step, run_step


class Harness:
    """``Harness(t, params, group_of).step(updates)`` -> the transform's output updates.

    ``params`` are the parameter tensors (their values matter only for
    transforms that read parameters, like AGC); ``group_of[i]`` is the param
    group of tensor i (groups must be contiguous, as in an optimizer).
    """

    def __init__(self, transform, params, group_of=None, group_dicts=None, names=None):
        self.t = transform
        self.params = list(params)
        self.group_of = list(group_of) if group_of is not None else [0] * len(self.params)
        gids = sorted(set(self.group_of))
        self.groups = group_dicts or [{} for _ in gids]
        self.ranges = []
        for g in gids:
            idx = [i for i, x in enumerate(self.group_of) if x == g]
            assert idx == list(range(idx[0], idx[-1] + 1)), "groups must be contiguous"
            self.ranges.append((idx[0], idx[-1] + 1))
        self.gids = gids
        self.names = names or [None] * len(self.params)
        self.state = defaultdict(dict)
        self._store: dict = {}
        self._runtime: dict = {}
        self.stats: dict = {}
        self.layout = None  # kept across steps, as Modular keeps its layouts

    def transform_store(self, key):
        return self._store.setdefault(key, {})

    def runtime_store(self, key):
        return self._runtime.setdefault(key, {})

    plan = None  # no pipeline: nothing is left out, folded or linked

    def step(self, updates):
        """Run the transform through the pipeline runner, as ``Modular`` does: on a cached
        layout (segment tables, per-layout caches) with the step's norm memo."""
        self.stats = {}
        step = Step.over(self.params, self, self.stats, groups=self.groups, ranges=self.ranges, group_ids=self.gids,
                         names=self.names, layout=self.layout)
        self.layout = step.layout
        return run_step([self.t], step, [u.clone() for u in updates])

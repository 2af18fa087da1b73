"""A modopt experiment as a Hydra application: `python -m modopt.cli.hydra_app`.

The Hydra config is an experiment (the file `modopt run` reads); every Hydra job
validates its composed config as an `Experiment` and trains it with
`run_experiment` into the job's output directory (`config.yaml`,
`metrics.jsonl`, `summary.json`, ... next to Hydra's own `.hydra/`). A
`--multirun` sweep therefore goes through whatever launcher Hydra is given
(joblib on one machine, submitit on SLURM, Ray); modopt schedules nothing.

    python -m modopt.cli.hydra_app --config-dir examples/configs --config-name digits_clipping \\
        --multirun +variant=noclip,zclip train.seed=0,1 hydra/launcher=joblib

Without `--config-name` the config is the default experiment of `modopt run`
(stored as `modopt_default`). Two top-level keys are the app's own and are
taken out before validation, so they are added with `+`:

* `+variant=NAME`: the variant to train, for a config with `variants`
  (the run is named `<name>-<variant>`, as with `modopt run --variant`);
* `+trust_imports=true`: allow tasks and optimizer classes named by import path;
* `+force=true`: replace a modopt run already in the job's output directory
  (without it such a job is refused, as `modopt run` refuses a non-empty `--out`).

`output.dir` of the config is not used: the job's output directory is.
Hydra (`hydra-core`) is an optional dependency; this module imports it only
when the app starts.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

from ..config import ConfigError
from .experiment import Experiment, default_experiment, experiment_from_data

#: the name under which the default experiment is stored in Hydra's ConfigStore
DEFAULT_CONFIG = "modopt_default"
#: top-level keys of the Hydra config that belong to the app, not to the experiment
APP_KEYS = ("variant", "trust_imports", "force")

log: logging.Logger = logging.getLogger("modopt.cli.hydra_app")


def experiment_for_job(data: Any, source: str, default_name: str | None = None) -> tuple[Experiment, bool]:
    """The single-optimizer experiment of one job's config (plain data) and whether imports are trusted.

    `variant` and `trust_imports` (`APP_KEYS`) are taken out of `data`; a
    config without a `name` gets `default_name`. Errors are `ConfigError`s
    naming `source` and the field path, as for `modopt run`.
    """
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: an experiment config must be a mapping, got {type(data).__name__}")
    data = dict(data)
    variant = data.pop("variant", None)
    trust = data.pop("trust_imports", False)
    if not isinstance(trust, bool):
        raise ConfigError(f"{source}: trust_imports must be true or false, got {trust!r}")
    if not isinstance(data.pop("force", False), bool):  # (read by `run_job`)
        raise ConfigError(f"{source}: force must be true or false")
    if variant is not None and not isinstance(variant, str):
        raise ConfigError(f"{source}: variant must be the name of one of the config's variants, got {variant!r}")
    if "name" not in data and default_name:
        data["name"] = default_name
    exp = experiment_from_data(data, source, trust)
    if variant is None and exp.variants and len(exp.variants) > 1:
        names = ",".join(exp.variants)
        raise ConfigError(
            f"{source}: experiment {exp.name!r} has several variants ({', '.join(exp.variants)}); choose one "
            f"with +variant=NAME, or run them all with --multirun +variant={names}"
        )
    return exp.select(variant), trust


def run_job(cfg: Any) -> dict[str, Any]:
    """The Hydra task function: train the job's experiment into its output directory; return the summary."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    from .run import run_experiment

    hc = HydraConfig.get()
    overrides = " ".join(hc.overrides.task) or "no overrides"
    source = f"hydra config {hc.job.config_name or DEFAULT_CONFIG} ({overrides})"
    data = OmegaConf.to_container(cfg, resolve=True)
    exp, trust = experiment_for_job(data, source, hc.job.config_name)
    out = Path(hc.runtime.output_dir)
    force = bool(isinstance(data, dict) and data.get("force") is True)
    held = [f for f in ("config.yaml", "checkpoint.pt", "summary.json", "metrics.jsonl") if (out / f).exists()]
    if held and not force:
        raise ConfigError(f"{out} already holds a modopt run ({', '.join(held)}); give the job a new hydra.run.dir "
                          "(or hydra.sweep.dir), or add +force=true to replace that run")
    log.info("%s (%s, %d steps, seed %d) -> %s", exp.name, exp.task.name, exp.train.steps, exp.train.seed, out)
    summary = run_experiment(exp, out, trust_imports=trust, progress=False, log=log.info, force=True if force else None)
    log.info(
        "%s: final loss %.4g, eval loss %s, %d loss spikes, %.1f%% clipped",
        exp.name, summary["final_loss"], "-" if summary["final_eval_loss"] is None else f"{summary['final_eval_loss']:.4g}",
        summary["loss_spikes"], summary["clipped_pct"],
    )
    return summary


def main() -> None:
    """Start the Hydra application (reads Hydra's command line from `sys.argv`)."""
    try:
        import hydra
        from hydra.core.config_store import ConfigStore
    except ImportError:
        print(
            "modopt.cli.hydra_app: needs Hydra, which is not installed: pip install hydra-core "
            "(and a launcher plugin for --multirun in parallel, e.g. hydra-joblib-launcher)",
            file=sys.stderr,
        )
        raise SystemExit(1) from None
    ConfigStore.instance().store(name=DEFAULT_CONFIG, node=default_experiment().to_dict())
    hydra.main(version_base="1.3", config_path=None, config_name=DEFAULT_CONFIG)(run_job)()


if __name__ == "__main__":
    main()

"""Where train_grpo's metrics go besides metrics.jsonl: REPORT_TO, TRL's report_to (transformers' integrations).

TensorBoard by default (events in OUT_DIR/tensorboard); any tracker transformers integrates, once its package is
installed (wandb, trackio, mlflow, ...). A tracker that is not installed is one error line at the
settings check, before the data or the model load; its own settings stay its own (e.g. WANDB_MODE=offline or
WANDB_PROJECT in the environment, read by the tracker, never printed here).
"""

from __future__ import annotations

import importlib.util

# transformers 5.17-5.24's report_to names (integrations.INTEGRATION_TO_CALLBACK) -> the packages each needs, as its
# is_<name>_available checks them (kubeflow, in 5.24 only, needs a server address instead of a package: left out)
TRACKER_PACKAGES = {
    "azure_ml": ("azureml.core.run",), "clearml": ("clearml",), "codecarbon": ("codecarbon",),
    "comet_ml": ("comet_ml",), "dagshub": ("dagshub", "mlflow"), "dvclive": ("dvclive",), "flyte": ("flytekit",),
    "mlflow": ("mlflow",), "neptune": ("neptune",), "swanlab": ("swanlab",),
    "tensorboard": ("tensorboard|tensorboardX",), "trackio": ("trackio",), "wandb": ("wandb",),
}
NO_TRACKER = ("none",)


def report_to(value) -> list[str]:
    """REPORT_TO as the list TRL's report_to takes: names lower-cased, "none" (or nothing) = no tracker."""
    names = [str(name).strip().lower() for name in ([value] if isinstance(value, str) else value)]
    names = [name for name in names if name]
    return [] if not names or names == list(NO_TRACKER) else names


def _installed(requirement: str, find_spec) -> bool:
    """Whether a package (or one of "a|b") can be imported, without importing it."""
    for name in requirement.split("|"):
        try:
            if find_spec(name) is not None:
                return True
        except ModuleNotFoundError:  # a dotted name whose parent package is missing
            continue
    return False


def report_to_problem(value, find_spec=importlib.util.find_spec) -> str | None:
    """Why REPORT_TO cannot work (None: it can): an unknown tracker or one whose package is not installed."""
    names = report_to(value)
    unknown = [name for name in names if name not in TRACKER_PACKAGES]
    if unknown:
        return (f"REPORT_TO={value!r}: unknown tracker(s) {', '.join(unknown)}; one or more of "
                f"{', '.join(TRACKER_PACKAGES)}, or none alone for no tracker")
    missing = [(name, requirement) for name in names for requirement in TRACKER_PACKAGES[name]
               if not _installed(requirement, find_spec)]
    if missing:
        return "REPORT_TO: " + "; ".join(f"{name} needs the package {requirement.replace('|', ' or ')}, which is "
                                         "not installed" for name, requirement in missing)
    return None

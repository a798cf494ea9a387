"""The spec's `tracking` section: which experiment trackers rank 0 logs to beside metrics.jsonl
(TensorBoard, MLflow, Weights & Biases, any combination; dskit/train/trackers.py writes them).

No field holds a credential, and a tracker URI that carries one (user:password@, a query string) is
refused: MLflow and W&B read their credentials from their own environment variables
(MLFLOW_TRACKING_TOKEN or MLFLOW_TRACKING_USERNAME/PASSWORD, WANDB_API_KEY), which the job's
environment provides (Slurm: the submitting shell's; Kubernetes: `kubernetes.secret_env`, rendered as
secretKeyRef), so no rendered file ever holds one.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator

from dskit.spec.values import _Section

#: MLflow experiment and run names, W&B projects and entities: a safe alphabet (they reach HTTP APIs,
#: file names under OUTPUT_DIR/wandb and the trackers' UIs), no spaces or slashes.
TRACKER_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}\Z")
NAME_RULE = "must be 1-128 letters, digits, '.', '_' or '-', starting with a letter or digit"
#: scheme://host[:port][/path]: a DNS name, IPv4 or [IPv6] host; the path in an unreserved alphabet.
#: http(s) only: MLflow 3 refuses its file store, and a database URI would hold a password.
TRACKING_URI_RE = re.compile(
    r"^https?://([A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?|\[[0-9A-Fa-f:.]{2,45}\])"
    r"(:(?P<port>[0-9]{1,5}))?(/[A-Za-z0-9._~/-]{0,1000})?\Z"
)
CREDENTIALS_HINT = (
    "give credentials in the trainer's environment (MLFLOW_TRACKING_TOKEN, or MLFLOW_TRACKING_USERNAME and "
    "MLFLOW_TRACKING_PASSWORD; on Kubernetes through kubernetes.secret_env), never in the spec"
)


def check_tracking_uri(v: str) -> str:
    """An http(s) server URI with no credentials in it; ValueError naming what is wrong, never echoing
    the value (it may hold a credential)."""
    scheme = v.partition("://")[0] if "://" in v else ""
    if scheme not in ("http", "https"):
        raise ValueError("is not an http:// or https:// URI (MLflow's tracking server)")
    authority = v.partition("://")[2].partition("/")[0]
    if "@" in authority:
        raise ValueError(f"must not carry credentials (user:password@host): {CREDENTIALS_HINT}")
    if "?" in v or "#" in v:
        raise ValueError(
            f"must not carry a query or fragment (a token in the URI is a credential): {CREDENTIALS_HINT}"
        )
    m = TRACKING_URI_RE.match(v)
    if not m:
        raise ValueError("is not http(s)://HOST[:PORT][/PATH] (the path in letters, digits and . _ ~ - /)")
    if m.group("port") is not None and not 0 < int(m.group("port")) < 65536:
        raise ValueError("the port must be 1-65535")
    return v


def _tracker_name(v: str | None) -> str | None:
    if v is not None and not TRACKER_NAME_RE.match(v):
        raise ValueError(f"{v!r}: {NAME_RULE}")
    return v


class MlflowSpec(_Section):
    tracking_uri: str | None = Field(
        None,
        description="MLflow tracking server, http(s)://HOST[:PORT][/PATH] (no credentials: the trainer's "
        "MLFLOW_TRACKING_TOKEN or MLFLOW_TRACKING_USERNAME/PASSWORD). Default: MLFLOW_TRACKING_URI in the "
        "trainer's environment.",
    )
    experiment: str | None = Field(
        None, description="Experiment (created if missing). Default: the run's name."
    )
    run_name: str | None = Field(None, description="The MLflow run's name. Default: the run's name.")

    @field_validator("tracking_uri")
    @classmethod
    def _uri(cls, v: str | None) -> str | None:
        return None if v is None else check_tracking_uri(v)

    @field_validator("experiment", "run_name")
    @classmethod
    def _name(cls, v: str | None) -> str | None:
        return _tracker_name(v)


class WandbSpec(_Section):
    project: str | None = Field(None, description="W&B project. Default: the run's name.")
    entity: str | None = Field(None, description="W&B entity (user or team). Default: the API key's own.")
    mode: Literal["online", "offline"] = Field(
        "online",
        description="online: to the W&B server (the trainer's WANDB_API_KEY, WANDB_BASE_URL for a "
        "self-hosted one); offline: files under OUTPUT_DIR/wandb only, uploaded later with `wandb sync`.",
    )

    @field_validator("project", "entity")
    @classmethod
    def _name(cls, v: str | None) -> str | None:
        return _tracker_name(v)


class TrackingSpec(_Section):
    tensorboard: bool = Field(
        True, description="TensorBoard events in OUTPUT_DIR/tensorboard (needs the tensorboard package)."
    )
    mlflow: MlflowSpec | None = Field(
        None,
        description="Log to MLflow (the `track` extra) from rank 0: every metrics.jsonl figure at its step, "
        "the plan as parameters. Keys: tracking_uri (http(s)://HOST[:PORT][/PATH], no credentials; default: "
        "the trainer's MLFLOW_TRACKING_URI), experiment and run_name (default: the run's name); {} turns it "
        "on with the defaults. Default: off.",
    )
    wandb: WandbSpec | None = Field(
        None,
        description="Log to Weights & Biases (the `track` extra) from rank 0: every metrics.jsonl figure at "
        "its step, the plan as the run's config. Keys: project (default: the run's name), entity, mode "
        "(online: the trainer's WANDB_API_KEY; offline: OUTPUT_DIR/wandb only); {} turns it on with the "
        "defaults. Default: off.",
    )

    def for_run(self, name: str) -> TrackingSpec | None:
        """What run.yaml records: unset names filled with the run's name. None when only the default
        TensorBoard is on, so run.yaml stays what it was before trackers existed."""
        if self == TrackingSpec():
            return None
        mlflow = self.mlflow and self.mlflow.model_copy(
            update={"experiment": self.mlflow.experiment or name, "run_name": self.mlflow.run_name or name}
        )
        wandb = self.wandb and self.wandb.model_copy(update={"project": self.wandb.project or name})
        return self.model_copy(update={"mlflow": mlflow, "wandb": wandb})

"""A spec -> one run directory: build the plan, render the target's files (and TARGET_FILE), write
them all at once. `dskit render TARGET` and the bench scripts both come through here, so every run
directory carries the same files, modes and refusals."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dskit.errors import SpecError
from dskit.io.atomic import check_replaceable
from dskit.launch import local_run
from dskit.plan.build import build_plan
from dskit.plan.schema import Plan
from dskit.render import TARGETS, Step, Target, common
from dskit.spec import Spec


@dataclass(frozen=True)
class RenderedRun:
    target: Target
    plan: Plan
    out: Path  # the run directory, resolved
    files: dict[str, str]  # what was written there (relative path -> text)

    def next_steps(self) -> list[Step]:
        """How to submit it (the target's next steps)."""
        return self.target.next_steps(self.plan, self.out, self.files)


def render_run(
    spec: Spec,
    target: str,
    out: str | Path | None = None,
    *,
    force: bool = False,
    spec_file: str | Path | None = None,
    build: Callable[[Spec], Plan] = build_plan,
) -> RenderedRun:
    """Plan `spec`, render it for `target` into `out` (default runs/NAME-TARGET) and write it
    atomically; `force` replaces a run directory dskit wrote. `spec_file` is the spec's YAML, one of
    the inputs `out` must not contain. `build`: how the plan is made (`dskit calibrate`'s adds its job)."""
    if target not in TARGETS:
        raise SpecError("TARGET", f"unknown target {target!r}; one of {', '.join(TARGETS)}")
    t = TARGETS[target]
    plan = build(spec)
    # what the render reads: --force must never replace a directory holding one of them
    sources = [x.path for x in spec.data.sources or []]
    inputs = [spec_file, spec.data.path, spec.data.eval_path, *sources, spec.model.path]
    default = f"runs/{plan.name}-{target}"
    run_dir = check_replaceable(default if out is None else out, force=force, kind="run", inputs=inputs)
    if run_dir.is_dir():  # --force: a run dir a local trainer is training stays
        local_run.refuse_while_trained(run_dir, "--force would replace its run dir under it")
    for kept in [plan.run.checkpoint_dir, plan.run.output_dir, *t.writes(plan)]:
        if Path(kept).resolve().is_relative_to(run_dir):
            # replacing the run dir (--force) would delete the checkpoints and metrics inside it
            raise SpecError(
                "--output", f"{run_dir} would contain {kept}; render elsewhere or move storage.root"
            )
    files = t.files(plan, run_dir)
    common.write_output(files, run_dir, force=force, executable=t.executable, inputs=inputs)
    return RenderedRun(t, plan, run_dir, files)

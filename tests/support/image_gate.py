"""Whether `make test` must build the CPU image: the `image` tests (tests/e2e/test_image_build.py,
tests/e2e/test_image_install.py) run where an input of the images changed since they last passed.

Those tests verify what the images are made of (the rendered Dockerfiles, install scripts and locks,
their templates, the packaging, CI's engine setup) and take about a quarter of an hour on 2 cores, most
of it compiling DeepSpeed's CPU ops. So `make test-image` records, after they pass, a digest of those
inputs in `.ci/image-verified`; `make test` and `.ci/run` compare it with the working tree's and run
the image tests when the two differ (or when the file is missing or damaged: when in doubt, build).
The scheduled run (`.ci/scheduled`) builds always, since the package index moves under unchanged locks.

Standard library only: the Makefile and `.ci/run` ask it before the venv exists.

    python3 tests/support/image_gate.py           prints `run` or `verified`, with the reason on stderr
    python3 tests/support/image_gate.py record    writes .ci/image-verified for the working tree
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
STAMP = REPO / ".ci" / "image-verified"
#: what the image tests verify: a change to any of these files (or folders) runs them
INPUTS = (
    "images",
    "templates/image",
    "dskit/catalog/images.yaml",
    "dskit/render/image.py",
    "dskit/host/image_builder.py",
    "dskit/host/jit_ops.py",
    "dskit/host/doctor.py",
    # what doctor and jit_ops read in the image: the environment's forms, the extension cache, the extras
    # guard, the escaping of every line they print
    "dskit/launch/env_vars.py",
    "dskit/host/build_locks.py",
    "dskit/host/extras.py",
    "dskit/io/text.py",
    "pyproject.toml",
    ".ci/image-setup.sh",
    "tests/e2e/test_image_build.py",
    "tests/e2e/test_image_install.py",
    "tests/support/isa.py",
    "tests/support/image_gate.py",
)
#: DSKIT_IMAGE_TESTS: `auto` (the digest decides), `always` (the scheduled run), `never`
MODES = ("auto", "always", "never")


def files() -> list[Path]:
    out: list[Path] = []
    for name in INPUTS:
        p = REPO / name
        if p.is_dir():
            out += sorted(f for f in p.rglob("*") if f.is_file() and "__pycache__" not in f.parts)
        elif p.is_file():
            out.append(p)
    return out


def digest() -> str:
    """sha256 over every input's path and bytes, in path order."""
    h = hashlib.sha256()
    for f in files():
        rel = f.relative_to(REPO).as_posix().encode()
        data = f.read_bytes()
        h.update(len(rel).to_bytes(8, "big") + rel + len(data).to_bytes(8, "big") + data)
    return h.hexdigest()


def decide(mode: str | None = None) -> tuple[bool, str]:
    """(run the image tests?, why)."""
    mode = mode or os.environ.get("DSKIT_IMAGE_TESTS") or "auto"
    if mode not in MODES:
        raise SystemExit(f"DSKIT_IMAGE_TESTS: {mode!r} is not one of {', '.join(MODES)}")
    if mode != "auto":
        return mode == "always", f"DSKIT_IMAGE_TESTS={mode}"
    try:
        recorded = json.loads(STAMP.read_text())
        want = recorded["digest"]
    except FileNotFoundError:
        return True, f"{STAMP.relative_to(REPO)} is missing"
    except (ValueError, KeyError, TypeError):
        return True, f"{STAMP.relative_to(REPO)} is damaged"
    if want != digest():
        return True, "an image input changed since the image tests last passed (tests/support/image_gate.py)"
    when = recorded.get("verified", "?")
    return False, f"image inputs unchanged since the image tests passed ({when}); `make test-image` runs them"


def record() -> None:
    """Written by `make test-image` after the image tests passed on this working tree."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO)
    STAMP.write_text(
        json.dumps(
            {
                "digest": digest(),
                "verified": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                "on_top_of": head.stdout.strip() or None,
                "inputs": list(INPUTS),
            },
            indent=1,
        )
        + "\n"
    )


def main(argv: list[str]) -> int:
    if argv == ["record"]:
        record()
        print(f"recorded {STAMP.relative_to(REPO)}")
        return 0
    if argv:
        print(__doc__.rsplit("\n\n", 1)[-1], file=sys.stderr)
        return 2
    run, why = decide()
    print("run" if run else "verified")
    print(f"image tests: {'run' if run else 'not run'}: {why}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

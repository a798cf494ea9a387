"""Rewrite tests/golden/ from the current code. Run by hand only: python -m tests.regen_golden"""

from __future__ import annotations

import shutil

from tests.golden_cases import CASES, GOLDEN, render_case


def main() -> None:
    for name in CASES:
        d = GOLDEN / name
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        for rel, text in render_case(name).items():
            (d / rel).write_text(text)
        print(f"wrote {d}")


if __name__ == "__main__":
    main()

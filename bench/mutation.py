"""Mutation testing of the plan's use of a calibration (docs/development.md "Mutation testing of the
plan's calibration use").

mutmut (3.8.1; a tool run by hand, not a project dependency: `.venv/bin/pip install mutmut==3.8.1`)
mutates the code that reads a calibration and turns it into seconds, and runs the fast plan and
calibration tests against each mutant; a mutant no test fails "survives". In scope (`SCOPE`):
dskit/calibrate/calibration.py (the reader; not `write` and `versions`, the writer's), scales.py,
dskit/plan/links.py, and of dskit/plan/speed.py the communication terms (`_collectives_s`, `_sync_s`,
`_all_to_all_s`, `_exposed`, `compute_windows`), the CPU step (`_cpu_step`, which exists only with a
calibration), where a step's sources are named (`_link_sources`), `_scaled_flops`, and the lines of
`predict` and `_optimizer_s` that take the calibration's rates and factors; of dskit/plan/parallel.py
the lines of `_speed_of` that hand them to every candidate. Survivors that change no behaviour are
listed in `EQUIVALENT` with the reason; any other survivor fails the run.

    .venv/bin/python bench/mutation.py           # every mutant in scope (about 16 minutes on 2 cores)
    .venv/bin/python bench/mutation.py --list    # the mutants in scope and their diffs, not run
    .venv/bin/python bench/mutation.py --max-children 1

It works in a copy of the working tree, .mutation/ (ignored by git; MUTATION_DIR moves it), which
holds mutmut's setup.cfg and its mutants/: nothing of the run is written into the repository.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORK = Path(os.environ.get("MUTATION_DIR", REPO / ".mutation"))

#: file -> (the functions mutated whole, (functions, a regex one of a mutant's changed lines must match))
SCOPE: dict[str, tuple[str | None, tuple[str, str] | None]] = {
    "dskit/calibrate/calibration.py": (r"^(?!x_write$|x_versions$)", None),
    "dskit/calibrate/scales.py": (r"", None),
    "dskit/plan/links.py": (r"", None),
    "dskit/plan/speed.py": (
        r"^(x__collectives_s|x__all_to_all_s|x__exposed|x_compute_windows|x__scaled_flops|x__link_sources"
        r"|x__cpu_step|x__sync_s)$",
        (r"^(x_predict|x__optimizer_s)$", r"\bscales\b|\blinks\b|cpu_adam_core_s"),
    ),
    "dskit/plan/parallel.py": (None, (r"^x__speed_of$", r"calibration|scales|factors|\brates\b")),
}
#: the tests run against each mutant (mutmut runs those that reach the mutated function): about a
#: minute together on 2 cores
TESTS = [
    "tests/plan/test_calibration_terms.py",
    "tests/plan/test_calibration_file.py",
    # the peak check of calibration.load only: the file's other tests walk every bound through whole plans (8 s)
    "tests/plan/test_calibration_bounds.py::test_a_gpu_rate_above_the_catalogs_peak_is_refused",
    "tests/plan/test_links.py",
    "tests/plan/test_cpu_plan.py",
    "tests/train/test_calibrate_fit.py",
]
#: survivors that behave as the original does: (function, a line as written, a regex on the line as
#: mutated, why). Matched by text, not by mutmut's numbers, which move when a function is edited.
EQUIVALENT: list[tuple[str, str, str, str]] = [
    (
        "x_load",
        "peak = catalog.gpu(gpu, field).peak_tflops_bf16  # the probes run bf16",
        r"catalog\.gpu\(gpu, (None)?\)",
        "the plan's GPU was read from the same catalog before a calibration is loaded: catalog.gpu cannot "
        "refuse it here, so the field its refusal would name is never shown",
    ),
    (
        "x_read",
        'text = bounded_read.read_bytes(p, limit=MAX_BYTES, what="a calibration").decode("utf-8")',
        r'decode\("UTF-8"\)',
        "codec names are case-insensitive: UTF-8 is utf-8",
    ),
    (
        "x_read",
        "data = bounded_read.parse_json(text, p)",
        r"parse_json\(text, None\)",
        "the name is used only in TooLarge's own message; the refusal says the file and TooLarge's reason",
    ),
    (
        "x_groups",
        "if ep_size <= per_node:",
        r"if ep_size < per_node:",
        "at EP = ranks per node both branches form the same groups (EP per_node x 1, expert-DP 1 x nodes)",
    ),
    (
        "xǁLinksǁrate",
        "scale = ring_latency_s(op, g, self.intra_kind) / ring_latency_s(op, measured, self.intra_kind)",
        r"ring_latency_s\(None, ",
        "only rings (all_gather, reduce_scatter) are extrapolated to other node counts (Calibration.nearest),"
        " and their steps are what any op but all_reduce and all_to_all gets",
    ),
    (
        "xǁLinksǁcatalog_rate",
        "bus = moved_share(op, g.size) / max(net, node)",
        r"moved_share\(None, ",
        "in the all-to-all branch, where every op but all_reduce moves the same (g-1)/g",
    ),
    (
        "x__all_to_all_s",
        'sent = both_ways * links_.moved_share("all_to_all", ep.size)',
        r'moved_share\((None|"XXall_to_allXX"|"ALL_TO_ALL"), ',
        "every op but all_reduce moves the same (g-1)/g",
    ),
    (
        "x__link_sources",
        'r = links.rate("all_to_all", g)',
        r'rate\((None|"XXall_to_allXX"|"ALL_TO_ALL"), g\)',
        "the reader refuses a file that times anything but the rings and AutoEP's exchange, so an all-to-all"
        " takes the catalog's rate under any op name, and only whether there is one and its source are read",
    ),
    (
        "x__collectives_s",
        "_exposed(comm, w, share, free) for comm, w, free in zip(by_pass, windows, frees, strict=True)",
        r"strict=(None|False)\)|frees, \)$",
        "the passes, their windows and what runs free in them are all three long",
    ),
    (
        "x__collectives_s",
        'by_pass[2] += t("all_gather", gathered * frac, calls * frac) if frac else 0.0',
        r"if \(frac\) or True else",
        "with no recompute (frac 0) the recompute's gathers are of 0 bytes in 0 calls: 0 s either way",
    ),
    (
        "x__cpu_step",
        "T, w.flops_per_token, frac, CPU_COMPUTE_TFLOPS * 1e12 / scales.compute, False, fwd, efficiency=1.0",
        r"scales\.compute, None, fwd",
        "`compiled` None is false as False is",
    ),
    (
        "x__cpu_step",
        "1.0,",
        r"^2\.0,$",
        "nothing hides a CPU rank's collectives (its windows are zeros): a pass exposes comm x (1 - s) +"
        " max(0, comm x s + free - 0) = comm + free, whatever the prefetched share s",
    ),
    (
        "x__speed_of",
        "factors = scales.factors(hw.calibration, scales.kind_of(hw.gpu.name))",
        r"^factors = scales\.factors\(hw\.calibration, \)$",
        "with a calibration the kind is the calibration's; without one a GPU's is the default 'gpu' and a"
        " CPU plan has no step time (no GEMM rate), so its factors are never read",
    ),
]


def _equivalent(fn: str, removed: list[str], added: list[str]) -> str | None:
    for f, old, new, why in EQUIVALENT:
        if f == fn and old in removed and any(re.search(new, a) for a in added):
            return why
    return None


def copy_tree(deselect: list[str]) -> None:
    """The working tree as git sees it (tracked and untracked files, not ignored ones) into WORK, and
    mutmut's configuration beside it."""
    if WORK.exists():
        shutil.rmtree(WORK)
    files = subprocess.run(
        ["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=REPO, capture_output=True, check=True
    ).stdout.decode()
    for name in filter(None, files.split("\0")):
        src = REPO / name
        if src.is_file() and not name.startswith(WORK.name + "/"):
            (WORK / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, WORK / name)
    top = sorted(p.name for p in WORK.iterdir() if p.name not in ("dskit", "tests"))
    (WORK / "setup.cfg").write_text(
        "[mutmut]\n"
        "source_paths = dskit\n"
        "only_mutate =\n" + "".join(f"    {f}\n" for f in SCOPE) + "also_copy =\n"
        "" + "".join(f"    {p}\n" for p in top) + "pytest_add_cli_args_test_selection =\n"
        "" + "".join(f"    {t}\n" for t in TESTS) + "pytest_add_cli_args =\n    -p\n    no:cacheprovider\n"
        "" + "".join(f"    --deselect\n    {d}\n" for d in deselect)
    )


def in_scope() -> dict[str, tuple[str, list[str], list[str]]]:
    """mutant name -> (its function, the lines it removes, the lines it adds), for the mutants in SCOPE.
    Generates the mutants (mutmut's own step) if they are not there yet."""
    from mutmut.__main__ import create_mutants
    from mutmut.mutation.diff_apply import get_diff_for_mutant
    from mutmut.utils.file_utils import copy_src_dir

    Path("mutants").mkdir(exist_ok=True)
    copy_src_dir()
    create_mutants(1)
    out = {}
    for path, (whole, lines) in SCOPE.items():
        keys = json.loads(Path("mutants", path + ".meta").read_text())["exit_code_by_key"]
        for key in keys:
            fn = re.sub(r"__mutmut_\d+$", "", key.rsplit(".", 1)[1])
            diff = get_diff_for_mutant(key, path=path).splitlines()
            removed = [x[1:].strip() for x in diff if x.startswith("-") and not x.startswith("---")]
            added = [x[1:].strip() for x in diff if x.startswith("+") and not x.startswith("+++")]
            chosen = whole is not None and re.search(whole, fn)
            if not chosen and lines and re.search(lines[0], fn):
                chosen = any(re.search(lines[1], r) for r in removed)
            if chosen:
                out[key] = (fn, removed, added)
    return out


def report(mutants: dict[str, tuple[str, list[str], list[str]]]) -> int:
    from mutmut.stats import status_by_exit_code

    status = {}
    for path in SCOPE:
        codes = json.loads(Path("mutants", path + ".meta").read_text())["exit_code_by_key"]
        status.update({k: status_by_exit_code[codes[k]] for k in mutants if k in codes})
    counts = Counter(status.values())
    explained, unexplained = [], []
    for key, st in sorted(status.items()):
        if st == "killed":
            continue
        fn, removed, added = mutants[key]
        why = _equivalent(fn, removed, added) if st == "survived" else None
        (explained if why else unexplained).append((key, st, removed, added, why))
    print(f"\n{len(mutants)} mutants in scope: " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())))
    print(f"survived and equivalent: {len(explained)}; not killed and not explained: {len(unexplained)}")
    for key, st, removed, added, why in explained + unexplained:
        print(f"\n{key}: {st}" + (f" (equivalent: {why})" if why else ""))
        print("\n".join([*(f"  - {r}" for r in removed), *(f"  + {a}" for a in added)]))
    return 1 if unexplained else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--list", action="store_true", help="list the mutants in scope and their diffs; run none")
    ap.add_argument("--max-children", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--deselect", action="append", default=[], metavar="NODEID", help="a test to leave out")
    args = ap.parse_args()
    copy_tree(args.deselect)
    os.chdir(WORK)
    mutants = in_scope()
    if args.list:
        for key, (_, removed, added) in mutants.items():
            print(key, *(f"  - {r}" for r in removed), *(f"  + {a}" for a in added), sep="\n")
        print(f"{len(mutants)} mutants in scope")
        return 0
    run = [sys.executable, "-m", "mutmut", "run", "--max-children", str(args.max_children), *mutants]
    with open("mutmut.log", "w") as log:  # its progress; the report below is what matters
        subprocess.run(run, check=False, stdout=log, stderr=subprocess.STDOUT)
    return report(mutants)


if __name__ == "__main__":
    sys.exit(main())

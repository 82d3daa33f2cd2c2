"""The suite's time as a markdown table, from the reports of ``pytest --suite-report FILE``.

    python -m pytest --suite-report report.json            # a run writes its report (conftest.py)
    python benchmarks/suite_table.py report.json [more.json ...] [--top 15]
    python benchmarks/suite_table.py report.json --write-times tests/suite-times.json

One column per report, in the order given: each file's test time (setup and teardown included; the
files over the first report's top ``--top``, the rest summed), then the run's wall time, its test time,
its tests, the processes and torchrun launches it started and the graphs it built. CONTRIBUTING.md
carries the table of a cold run (fresh clone, empty caches). ``--write-times`` writes each
test of the reports at its longest in any of them (setup and all, and its setup's alone), as
``conftest.py`` reads them: the ``slow`` marker and the order the groups are handed out in come from
there. Give it a cold whole run (CI's, from a fresh clone) and a run of the fast tier alone, where a test
may build a fixture that the whole run's order had built before it.

    python benchmarks/suite_table.py whole.json fast.json --write-times tests/suite-times.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def table(reports: list[dict], names: list[str], top: int) -> str:
    first = reports[0]["files"]
    files = sorted(first, key=lambda f: -first[f])[:top]
    rows = [f"| {f} | " + " | ".join(f"{r['files'].get(f, 0.0):.0f}" for r in reports) + " |" for f in files]
    rest = [sum(s for f, s in r["files"].items() if f not in files) for r in reports]
    rows.append("| every other file | " + " | ".join(f"{s:.0f}" for s in rest) + " |")

    def line(label: str, value) -> str:
        return f"| **{label}** | " + " | ".join(value(r) for r in reports) + " |"

    rows += [
        line("wall time (s)", lambda r: f"{r['wall_s']:.0f}"),
        line("test time, every core (s)", lambda r: f"{sum(r['tests'].values()):.0f}"),
        line("tests", lambda r: str(len(r["tests"]))),
        line("Python processes launched", lambda r: str(r["launched"].get("processes", 0))),
        line("torchrun launches", lambda r: str(r["launched"].get("torchrun launches", 0))),
        line(
            "graphs built (fnloop's cache, inductor's)",
            lambda r: f"{r['graphs']['fnloop']}, {r['graphs']['inductor']}",
        ),
    ]
    head = "| file (test time, s) | " + " | ".join(names) + " |\n|---|" + "---:|" * len(reports)
    return head + "\n" + "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reports", nargs="+", type=Path)
    parser.add_argument("--top", type=int, default=15, help="files shown one by one (default 15)")
    parser.add_argument("--write-times", type=Path, help="write the times per test there")
    args = parser.parse_args()
    reports = [json.loads(p.read_text()) for p in args.reports]
    if args.write_times:
        first = reports[0]
        times = {}
        for k in sorted({k for r in reports for k in r["tests"]}):  # each test at its longest in any report
            runs = [r for r in reports if k in r["tests"]]
            total = max(r["tests"][k] for r in runs)
            times[k] = [round(total, 2), round(max(r.get("setups", {}).get(k, 0.0) for r in runs), 2)]
        lines = [f"{json.dumps(k)}: {json.dumps(v)}" for k, v in times.items()]
        recorded = json.dumps(f"a cold run, {first['wall_s']:.0f} s of wall time")
        args.write_times.write_text(
            '{"recorded": ' + recorded + ', "tests": {\n' + ",\n".join(lines) + "\n}}\n"
        )
        return
    print(table(reports, [p.stem for p in args.reports], args.top))


if __name__ == "__main__":
    main()

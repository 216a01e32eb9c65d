"""Machine figures every benchmark table quotes: build, devices, H2D/D2H and host bandwidth.

Usage: python benchmarks/machine_report.py [--json OUT.json] [--probe-mib N]
Prints a table and, with --json, writes the same figures as one JSON object.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from forecache.doctor import collect


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, help="write the figures to this file")
    ap.add_argument("--probe-mib", type=int, default=256, help="bytes per probe copy, MiB")
    args = ap.parse_args()
    report = collect(measure=True, probe_bytes=args.probe_mib << 20)
    report["date"] = time.strftime("%Y-%m-%d")
    rows = [("date", report["date"]), ("build", report["build"]["backend"]),
            ("llama-cpp-python", report["llama_cpp_python"]), ("CPUs", report["cpu_count"]),
            ("host memcpy GB/s", report["host_memcpy_gbps"])]
    for d in report["devices"]:
        rows.append((f"device {d['index']}", f"{d['name']} {d['description']} "
                     f"({d['memory_total_bytes'] / (1 << 30):.1f} GiB)"))
        for k in ("h2d_gbps_pinned", "d2h_gbps_pinned", "h2d_gbps_pageable", "d2h_gbps_pageable"):
            if k in d:
                rows.append((f"  {k}", d[k]))
    width = max(len(r[0]) for r in rows)
    print(f"| {'figure'.ljust(width)} | value |\n|{'-' * (width + 2)}|-------|")
    for name, val in rows:
        print(f"| {name.ljust(width)} | {val} |")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()

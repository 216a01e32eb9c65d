"""Resident memory over a long run: many completions in one process, RSS after each.

    python benchmarks/soak_rss.py [-m MODEL] [--policies offload,lru,promoe] [--tokens 50000]
        [--per-request 500] [--json OUT.json]

Each policy runs in a process of its own (so their memory does not mix): greedy completions of
--per-request tokens until --tokens are generated. It prints RSS at the start, the middle and the
end, and the growth per 1,000 tokens over the second half, where a leak shows as a steady rise.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

CHILD = """
import json, sys, time
from forecache import Llama
model, policy, total, per = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
kw = {"cache": None} if policy == "none" else {"policy": policy, "cache_fraction": 0.5}
llm = Llama(model, n_ctx=max(512, per + 64), verbose=False, **kw)
def rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))
samples, done, t0 = [], 0, time.perf_counter()
while done < total:
    out = llm.create_completion(f"Request {len(samples)}: in the beginning", max_tokens=per,
                                temperature=0)
    done += out["usage"]["completion_tokens"] or 1
    samples.append((done, rss()))
print(json.dumps({"samples": samples, "seconds": time.perf_counter() - t0}))
"""


def run_policy(model: str, policy: str, total: int, per: int) -> dict:
    """RSS samples (tokens so far, bytes) of one policy, in a child process."""
    res = subprocess.run([sys.executable, "-c", CHILD, model, policy, str(total), str(per)],
                         capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise SystemExit(f"{policy}: exited {res.returncode}:\n{res.stderr[-2000:]}")
    data = json.loads(res.stdout.strip().splitlines()[-1])
    samples = data["samples"]
    half = samples[len(samples) // 2]
    end = samples[-1]
    grow = (end[1] - half[1]) / max(end[0] - half[0], 1) * 1000
    return {"policy": policy, "tokens": end[0], "requests": len(samples),
            "rss_start_mib": samples[0][1] / 2**20, "rss_mid_mib": half[1] / 2**20,
            "rss_end_mib": end[1] / 2**20, "growth_bytes_per_1k_tokens": grow,
            "seconds": data["seconds"], "samples": samples}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=None, help="GGUF (default: the default model)")
    ap.add_argument("--policies", default="none,offload,lru,promoe")
    ap.add_argument("--tokens", type=int, default=50000)
    ap.add_argument("--per-request", type=int, default=500)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    if a.model is None:
        from forecache.models.default import ensure_default_model

        a.model = str(ensure_default_model())
    rows = []
    for policy in a.policies.split(","):
        print(f"running {policy} ...", file=sys.stderr)
        rows.append(run_policy(a.model, policy.strip(), a.tokens, a.per_request))
    print(f"{'policy':<9}{'tokens':>8}{'requests':>10}{'RSS start':>11}{'mid':>9}{'end':>9}"
          f"{'B per 1k tok (2nd half)':>26}")
    for r in rows:
        print(f"{r['policy']:<9}{r['tokens']:>8}{r['requests']:>10}{r['rss_start_mib']:>9.1f}Mi"
              f"{r['rss_mid_mib']:>7.1f}Mi{r['rss_end_mib']:>7.1f}Mi"
              f"{r['growth_bytes_per_1k_tokens']:>26.0f}")
    if a.json:
        a.json.write_text(json.dumps({"model": a.model, "host": platform.node(),
                                      "date": time.strftime("%Y-%m-%d"), "command":
                                      " ".join(sys.argv), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The simulator against measured runs on this machine (CPU build): ProMoE-style validation.

    python benchmarks/sim_validate.py [--model GGUF] [--prompt-len 128] [--gen 32] [--prompts 8]
        [--fraction 0.5] [--calib-fraction 0.25] [--repeats 3] [--json OUT]
        [--profile-out PROFILE.json]

A profile of this machine is fitted to calibration runs (offload; lru and promoe with every
expert cached; both at --calib-fraction), then lru and promoe at --fraction are measured and
simulated with it (the same workload's recorded routing). Prints simulated vs measured TTFT and
TPOT with the relative error; the issue's tolerance is 15%.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict
from pathlib import Path

from forecache.models.default import ensure_default_model
from forecache.sim.calibrate import validate

TOLERANCE = 0.15


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None, help="GGUF (default: the built-in model)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--fraction", type=float, default=0.5)
    ap.add_argument("--calib-fraction", type=float, default=0.25)
    ap.add_argument("--repeats", type=int, default=3, help="measurements of each run")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--profile-out", type=Path, default=None, help="write the fitted profile")
    a = ap.parse_args()
    model = a.model or ensure_default_model()
    t0 = time.perf_counter()
    v = validate(model, prompt_len=a.prompt_len, n_gen=a.gen, n_prompts=a.prompts,
                 fraction=a.fraction, calib_fraction=a.calib_fraction, repeats=a.repeats,
                 n_threads=a.threads,
                 progress=lambda s: print(s, flush=True))
    print(f"\n{model.name}: {a.prompts} prompts of {a.prompt_len} tokens, {a.gen} generated; "
          f"{time.perf_counter() - t0:.0f} s")
    print(f"{'run':<22} {'TTFT ms':>9} {'sim':>9} {'err':>7} {'TPOT ms':>9} {'sim':>9} "
          f"{'err':>7}")
    for kind, runs in (("calibration", v.calibration), ("validation", v.validation)):
        print(f"-- {kind}")
        for m in runs:
            e1, e2 = m.errors()
            print(f"{m.label:<22} {m.ttft_s * 1e3:>9.2f} {m.sim_ttft_s * 1e3:>9.2f} "
                  f"{e1 * 100:>+6.1f}% {m.tpot_s * 1e3:>9.3f} {m.sim_tpot_s * 1e3:>9.3f} "
                  f"{e2 * 100:>+6.1f}%")
    worst = v.worst_error()
    print(f"worst validation error {worst * 100:.1f}% "
          f"({'within' if worst <= TOLERANCE else 'outside'} {TOLERANCE * 100:.0f}%)")
    if a.profile_out:
        a.profile_out.write_text(json.dumps(asdict(v.profile), indent=2) + "\n")
    if a.json:
        a.json.write_text(json.dumps({"model": str(model), **v.to_json()}, indent=1))


if __name__ == "__main__":
    main()

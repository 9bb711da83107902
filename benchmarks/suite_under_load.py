"""The timing-sensitive tests under a competing CPU load: busy processes (a pure-Python spin each) run beside
pytest the whole time, so the machine's load is about ``--load`` + what the tests themselves run.

    python benchmarks/suite_under_load.py                 # load 4, the timing-sensitive selection below
    python benchmarks/suite_under_load.py --load 4 -- tests/test_main_job.py

Writes ``benchmarks/results/suite_under_load.json``: the pytest exit code, its summary line, the wall time, and
the load average sampled every 10 s; pytest's output goes to ``suite_under_load.log`` beside it as it runs
(``-rA``: a line per test), so a run stopped early still shows how far it got. Not a timing figure: it checks that nothing breaks when the CPUs are shared.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TIMING_SENSITIVE = [
    "tests/test_main_job.py",  # the README's main job: it must learn, whatever the load
    "tests/test_reward_stream.py", "tests/test_faults.py", "tests/test_bad_inputs.py", "tests/test_threads.py",
    "tests/test_rollout_server.py", "tests/test_ray_executor.py",
    "plugins/engines/diffusers/tests", "plugins/rewards/remote/tests", "plugins/rewards/vlm-judge/tests",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--load", type=int, default=4, help="busy processes beside pytest")
    parser.add_argument("paths", nargs="*", help="test paths (default: the timing-sensitive selection)")
    args = parser.parse_args()
    paths = args.paths or TIMING_SENSITIVE
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a stop runs the finally below: no busy process left
    busy = [subprocess.Popen([sys.executable, "-c", "while True:\n    pass"]) for _ in range(args.load)]
    loads: list[float] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(10.0):
            loads.append(os.getloadavg()[0])

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.perf_counter()
    log = HERE / "results" / "suite_under_load.log"
    log.parent.mkdir(exist_ok=True)
    try:
        with log.open("w") as out:
            proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", *paths],
                                  cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, text=True, check=False,
                                  env={**os.environ, "PYTHONUNBUFFERED": "1"})  # each result as it comes
    finally:
        stop.set()
        for p in busy:
            p.kill()
            p.wait()
    wall = time.perf_counter() - start
    proc.stdout = log.read_text()
    # pytest's last line: "16 passed in 657.46s (0:10:57)", with -q; "==== ... in 12.3s ====" without
    summary = next((line for line in reversed(proc.stdout.splitlines())
                    if re.search(r"\b(passed|failed|error|errors|skipped|no tests ran)\b.* in [\d.]+s", line)),
                   proc.stdout.splitlines()[-1] if proc.stdout else "")
    failures = [line for line in proc.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]
    result = {"load_processes": args.load, "paths": paths, "exit_code": proc.returncode, "summary": summary,
              "failures": failures, "wall_s": wall, "load_avg_samples": loads,
              "cpus": os.cpu_count(), "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    out = HERE / "results" / "suite_under_load.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{summary}\nexit {proc.returncode}, {wall:.0f} s, load average {min(loads, default=0):.1f}-"
          f"{max(loads, default=0):.1f}\n" + "\n".join(failures) + f"\nwrote {out}")
    if proc.returncode:
        print(proc.stdout[-6000:], file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()

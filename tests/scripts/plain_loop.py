"""A script that knows nothing of hpc_train (no ``init()``, no torch: it is about the lifecycle, not
the training), as ``run --script`` meets one: it reads its rank from the environment, works for
STEPS steps of SLEEP_S each and prints each one.

``python plain_loop.py STEPS SLEEP_S [--fail-while FILE --fail-rank R --fail-at K]``: rank R
exits with code 2 at step K while FILE exists (a fault outside the command, which removing FILE
cures, so that the same command can then be run again).
"""

import argparse
import os
import sys
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("steps", type=int)
    ap.add_argument("sleep_s", type=float)
    ap.add_argument("--fail-while")
    ap.add_argument("--fail-rank", type=int, default=1)
    ap.add_argument("--fail-at", type=int, default=1)
    args = ap.parse_args()
    rank = int(os.environ.get("RANK", "0"))
    for step in range(1, args.steps + 1):
        if args.fail_while and rank == args.fail_rank and step == args.fail_at and os.path.exists(args.fail_while):
            print(f"rank {rank}: {args.fail_while} exists; giving up at step {step}", file=sys.stderr, flush=True)
            sys.exit(2)
        time.sleep(args.sleep_s)
        print(f"rank {rank} step {step}", flush=True)


if __name__ == "__main__":
    main()

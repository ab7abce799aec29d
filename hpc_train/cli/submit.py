"""``python -m hpc_train submit``: one job, a sweep's array, or a sweep's failed tasks again. Torch-free."""

from __future__ import annotations

import argparse
import sys

from hpc_train import rundir
from hpc_train.errors import EXIT_USAGE, UsageError
from hpc_train.login import scheduler
from hpc_train.login.submission import dry_run_text, make_executor, refusal, submit


def cmd_submit(args: argparse.Namespace) -> int:
    from hpc_train.login.args import check_plugins_light, load as _load
    if args.resubmit_failed:
        if args.sweep or args.config or args.script or args.fn or args.overrides:
            raise UsageError("--resubmit-failed SWEEP_DIR takes no config, --set or --sweep: each task runs "
                             "again with the config in its run directory")
        from hpc_train.login import sweep
        return sweep.resubmit_failed(args)
    cfg = _load(args)
    check_plugins_light(cfg)
    rd = cfg.resolved_run_dir().absolute()
    cfg.run_dir = str(rd)
    if args.sweep:
        from hpc_train.login import sweep
        return sweep.submit(args, cfg, rd)
    if args.dry_run:
        from hpc_train.login.executor import header
        from hpc_train.rundir import check_path
        check_path(rd, "the run directory")
        scheduler.time_minutes(cfg.job.time)
        print(dry_run_text(make_executor(cfg, rd, dry_run=True, header=header(cfg, rd))), end="")
        why = refusal(rd, args.resume)
        if why is not None:   # the script is shown all the same; the exit code is the real submit's
            print(f"hpc_train: error: a real submit would refuse this: {why}", file=sys.stderr)
            return EXIT_USAGE
        return 0
    job = submit(cfg, run_dir=rd, resume=args.resume)
    print(f"submitted job {job.job_id}\n  run directory: {rd}\n  logs: {rd / rundir.LOGS}/rank-*.log "
          f"(submitit's: {rd / rundir.SUBMITIT})\n  follow: python -m hpc_train logs {rd} -f")
    if not args.wait:
        return 0
    jid = str(job.job_id)

    def show(answer: scheduler.Answer) -> None:
        st = answer.states.get(jid)
        state = "unknown" if answer.live(jid) is None or st is None else st.state
        print(f"  job {jid}: {state}" + (f" ({answer.failed})" if answer.failed else ""), file=sys.stderr)
    final = scheduler.wait([jid], on_change=show)[jid].state
    print(f"job {job.job_id} ended: {final}")
    return 0 if final == "COMPLETED" else 1

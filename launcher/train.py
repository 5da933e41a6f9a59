"""Worker entry point, started by torchrun on every node:

    python -m torch.distributed.run ... -m launcher.train --run-dir <abs run dir> [--resume latest|<ckpt dir>]

Exit codes: 0 done, 1 failed (the error is in the log and the `end` event), 143 stopped by SIGTERM.
"""
from __future__ import annotations

import argparse
import logging
import sys
import traceback
from pathlib import Path

USER_ERRORS = ("ConfigError", "DataError", "ModelError", "Diverged")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="launcher.train", description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument("--resume", default=None, help="'latest' or a checkpoint directory")
    args = parser.parse_args(argv)

    from launcher import dist
    from launcher.config import load_job
    from launcher.trainer import Stopped, Trainer

    try:
        spec = load_job(args.run_dir)
    except Exception as exc:  # nothing started yet: report and leave
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
    ctx = dist.init(spec.ddp_timeout)
    logging.basicConfig(level=logging.INFO if ctx.is_main else logging.WARNING,
                        format=f"[rank{ctx.rank}] %(asctime)s %(levelname)s %(message)s", stream=sys.stdout, force=True)
    trainer = Trainer(args.run_dir, spec, ctx, args.resume)
    code = 0
    try:
        trainer.setup()
        trainer.train()
        trainer.end("succeeded", None)
    except Stopped:
        trainer.end("stopped", None)
        code = 143
    except Exception as exc:
        user_error = type(exc).__name__ in USER_ERRORS
        message = str(exc) if user_error else f"{type(exc).__name__}: {exc}"
        if not user_error:
            traceback.print_exc()
        print(f"[rank{ctx.rank}] error: {message}", file=sys.stderr, flush=True)
        trainer.end("failed", message)
        code = 1
    finally:
        sys.stdout.flush()
    if code == 0:
        dist.close()
    # On failure skip destroy_process_group: it can block on peers that are gone; torchrun
    # takes the remaining ranks down when this one exits non-zero.
    return code


if __name__ == "__main__":
    sys.exit(main())

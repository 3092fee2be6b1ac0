"""One rank of an MPI test run (tests/test_distributed.py): the llmtune CLI, optionally with a fault.

    mpiexec -n 1 python tests/dist_rank.py -- finetune ... : -n 1 python tests/dist_rank.py --kill-at 3 -- finetune ...

--kill-at STEP: this rank SIGKILLs itself as optimizer step STEP begins (a rank that dies);
--stop-at STEP: it SIGSTOPs itself there (a rank that hangs, which no launcher notices).
"""

from __future__ import annotations

import os
import signal
import sys

from llmtune.cli import main as cli_main
from llmtune.train.trainer import Trainer


def main() -> None:
    args = sys.argv[1:]
    faults = {"--kill-at": signal.SIGKILL, "--stop-at": signal.SIGSTOP}
    fault = None
    while args and args[0] != "--":
        fault = (faults[args[0]], int(args[1]))
        args = args[2:]
    args = args[1:]
    if fault is not None:

        sig, at = fault
        original = Trainer.train_step

        def train_step(self, *a, **k):
            if self.steps_done + 1 == at:
                os.kill(os.getpid(), sig)
            return original(self, *a, **k)

        Trainer.train_step = train_step
    sys.argv = ["llmtune", *args]

    cli_main()


if __name__ == "__main__":
    main()

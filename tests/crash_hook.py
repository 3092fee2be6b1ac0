"""A training-loop hook that raises Crash after a given step: the tests' stand-in for a run killed
mid-way (checkpoints kept, then resumed)."""

from llmtune.train.loop import Hook


class Crash(Exception):
    pass


def crash_hooks(crash_at):
    """finetune's `hooks` argument: one hook raising Crash once global step `crash_at` ends (None: never)."""

    class CrashAt(Hook):
        def on_step(self, run, step):
            if step.global_step == crash_at:
                raise Crash

    return lambda cfg, model: [CrashAt()]

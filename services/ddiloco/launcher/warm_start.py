"""A serial warm start: one learner trains alone first, and the run starts from its model.

Why. Early in training the gradient noise scale is small, so a small batch makes as much
progress per step as a large one and far more per token (McCandlish et al., 2018, "An
Empirical Model of Large-Batch Training"; GPT-3 ramps its batch size over its first
billions of tokens for this reason). M learners that each train H steps from a random
initialisation and are then averaged spend M times the tokens of one learner for about one
learner's progress, and DiLoCo's outer momentum starts from zero; at the small budgets of
this project's quality benches that early loss is never made up (docs/quality.md, "Warm
start"). Data-parallel training pays the same price (a batch M times larger from the first
step), so benches that compare the two give both the same warm start.

How. The phase is an ordinary ddiloco run of one learner, synchronous, outer SGD with
learning rate 1 and no momentum, in fp32: each outer step sets the global model to the
learner's own, and the learner keeps its AdamW state across windows, so the phase is plain
serial training with the run's inner optimizer, through the same services, checkpoints and
files as any run. Its folder (``RUN/warm-start``) is then the run's ``--init-from``.
The run's token budget counts the phase's tokens, and its time budget the phase's time.
"""

from __future__ import annotations

import json
import math
import pathlib
from dataclasses import dataclass

from ddiloco.common.config import RunConfig

FOLDER = "warm-start"  # inside the run folder


class WarmStartError(ValueError):
    """A warm start the run's budget or flags make impossible."""


@dataclass(frozen=True)
class Plan:
    steps: int  # inner steps the one learner trains: whole windows of H
    tokens: int  # their weight: the phase's token budget


PHASE_SUFFIX = "-warm-start"  # the phase's run id: the run's, with this after it

def plan(config: RunConfig, steps: int, step_weight: int) -> Plan:
    """The phase for ``steps`` requested inner steps, rounded up to whole windows of H (a
    window cut short would be applied at a fraction of its length, not in full); raises
    ``WarmStartError`` when it does not fit the run's budget. ``step_weight``: the tokens of
    one inner step (``Workload.step_weight``)."""
    if steps < 1:
        raise WarmStartError(f"--warm-start-steps must be at least 1, got {steps}")
    from ddiloco.common.config_rules import MAX_RUN_ID_CHARS

    if len(config.run_id) + len(PHASE_SUFFIX) > MAX_RUN_ID_CHARS:  # the phase is a run of its own id
        raise WarmStartError(f"--warm-start-steps names its phase run {config.run_id!r}{PHASE_SUFFIX}: give a --run-id of "
                             f"at most {MAX_RUN_ID_CHARS - len(PHASE_SUFFIX)} characters")
    if config.init_from:
        raise WarmStartError("--warm-start-steps trains the run's starting model; --init-from already names one")
    h = config.learner.inner_steps
    windows = math.ceil(steps / h)
    tokens = windows * h * step_weight
    if config.max_tokens > 0 and tokens >= config.max_tokens:
        raise WarmStartError(
            f"--warm-start-steps {steps} ({windows * h} steps in windows of H = {h}, {tokens:,} tokens) leaves nothing "
            f"of the run's --max-tokens {config.max_tokens:,}"
        )
    from ddiloco.coordinator.stats_rules import MAX_STEPS_PER_S

    # the phase's speed is not known before it runs, but no learner takes more than
    # MAX_STEPS_PER_S steps a second: more steps than that over the whole time budget were
    # trained for the whole budget and then refused (--warm-start-steps 1e9 ran 150 s first)
    if windows * h > config.max_seconds * MAX_STEPS_PER_S:
        raise WarmStartError(
            f"--warm-start-steps {steps} cannot be trained within the run's --max-seconds {config.max_seconds:g} "
            f"(at most {MAX_STEPS_PER_S:,} steps a second)"
        )
    return Plan(windows * h, tokens)


def phase_flags(run_flags: list[str], config: RunConfig, plan_: Plan) -> list[str]:
    """The phase's run flags: the run's, then what makes it one learner's serial training
    (later flags win)."""
    return run_flags + [
        "--run-id", f"{config.run_id}{PHASE_SUFFIX}",
        "--learners", "1", "--sync", "--quorum", "1", "--fragments", "1", "--outer-shards", "1",
        "--codec", "fp32", "--merge-rule", "weighted", "--outer-lr", "1", "--outer-momentum", "0",
        "--max-tokens", str(plan_.tokens),
    ]


@dataclass(frozen=True)
class Result:
    folder: pathlib.Path
    tokens: int  # trained by the phase (its report's tokens_trained)
    seconds: float
    initial_eval_loss: float | None
    final_eval_loss: float | None


def read_result(folder: pathlib.Path) -> Result:
    """The finished phase in ``folder`` (its report.json)."""
    report = json.loads((folder / "report.json").read_text())
    return Result(folder, int(report["tokens_trained"]), float(report["wall_seconds"]),
                  report.get("initial_eval_loss"), report.get("final_eval_loss"))


def run_flags_after(run_flags: list[str], config: RunConfig, result: Result) -> list[str]:
    """The run's flags once the phase is done: it starts from the phase's model, with what
    is left of its budgets; raises ``WarmStartError`` when nothing is left."""
    flags = run_flags + ["--init-from", str(result.folder.resolve())]
    if config.max_tokens > 0:
        left = config.max_tokens - result.tokens
        if left <= 0:
            raise WarmStartError(f"the warm start trained {result.tokens:,} tokens, the run's whole --max-tokens")
        flags += ["--max-tokens", str(left)]
    seconds = config.max_seconds - result.seconds
    if seconds <= 0:
        raise WarmStartError(f"the warm start took {result.seconds:.1f} s, the run's whole --max-seconds")
    return flags + ["--max-seconds", f"{seconds:.3f}"]

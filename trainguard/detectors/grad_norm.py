"""Gradient-norm surge and trend: the precursor of an explosion.

Observes one number per step that is available *before* the optimizer step on every rank: the
root-mean-square of the ranks' local gradient norms (gathered by the AGREE collective). Two
verdicts:

- ``grad_surge``: this step's norm lies more than ``z`` robust deviations above the window median -- a surge, counted
  toward a repeated surge below -- and is alerted when it does so as a ratio too (on log norms: a norm's noise scales
  with it -- near a loss floor a healthy norm moves 17x from one step to the next, and the linear z alone alerted
  every fifth step of a healthy Megatron-LM run; a too-high LR's 3.6x jumps in a warmup's noisy norm are evidence on
  the linear z alone, their escalation gated by the loss);
- ``slow_rise``: the log-norm has risen by more than ``trend_rise`` per step (least squares) over the
  last ``trend_steps`` steps and every one of them is above the median -- a sustained creep, which
  is how a too-high LR shows itself before the loss explodes. Reported once per episode. A surge that is
  irregular never gives a clean slope (Megatron-LM's norm jumping z 7.9, 13, 42, 28 with calm steps
  between): ``surges_to_rise`` surges within ``surge_window`` steps are a ``slow_rise`` too.
"""
from __future__ import annotations

import math

from trainguard.config import GradNormConfig
from trainguard.verdicts import Verdict
from trainguard.detectors.stats import RollingWindow


class GradNormDetector:
    name = "grad_norm"

    def __init__(self, cfg: GradNormConfig):
        self.cfg = cfg
        self.window = RollingWindow(cfg.window)
        self.recent = RollingWindow(max(cfg.trend_steps, 3))
        self.in_rise = False
        self.last_z = 0.0
        self.history: list[tuple[int, float]] = []   # (step, norm) of the last `window` steps
        self.surges: list[int] = []                   # steps of recent grad_surge verdicts
        self.rise_at: int | None = None               # the step the last slow_rise was given
        self.pushed: tuple[int, bool] | None = None   # (step, whether its norm went into the window)

    def onset(self, step: int) -> int:
        """Where the current rise began: the first of the uninterrupted run of steps whose norm
        lies above the window median, counting back from now. A creep starts before it is
        detected, and the checkpoint to return to must predate its start, not its detection.
        (Repeated surges give their own onset, the first of them, in the verdict.)"""
        return self._creep_onset(step)

    def _creep_onset(self, step: int) -> int:
        if not len(self.window):
            return step - self.cfg.trend_steps
        med = self.window.median()
        start = step
        for s, v in reversed(self.history):
            if v <= med:
                break
            start = s
        return min(start, step - self.cfg.trend_steps)

    def trend(self) -> str | None:
        """'rising' when the steps *before* the current one show a sustained creep."""
        n = self.cfg.trend_steps
        if len(self.recent) < n or len(self.window) < self.cfg.min_history:
            return None
        med = self.window.median()
        vals = list(self.recent.values)[-n:]
        if self.recent.slope(n, log=True) > self.cfg.trend_rise and min(vals) > med:
            return "rising"
        return None

    def observe(self, step: int, norm: float | None, ranks=(), loss_up: bool = True) -> list[Verdict]:
        """``loss_up``: the loss has stopped improving (its smoothed value stands above its best level, past its noise
        and the floor of what it learnt: trainguard.detectors.loss_trend). Repeated surges and a creep escalate only
        then: a heavy-tailed norm surges now and then while the loss goes on improving (bench/natural: a one-head
        model, its LR halved seven times by surges alone until lr_floor aborted a run that was learning), and near a
        loss floor the norm creeps and surges by half itself (bench/natural/healthy.py's Megatron-LM run)."""
        self.last_z = 0.0
        if norm is None or not math.isfinite(norm):
            return []
        rising_before = self.trend()
        verdicts, surged = [], False
        if len(self.window) >= self.cfg.min_history:
            z = self.window.robust_z(norm)
            self.last_z = z
            surged = z > self.cfg.z  # (evidence: it counts toward a repeated surge, and stays out of the baseline)
            ratio_z = self.window.log_robust_z(norm) if surged else 0.0
            if ratio_z > self.cfg.z:  # (news: a jump past the norm's own multiplicative noise too -- an alert)
                verdicts.append(Verdict(self.name, "grad_surge", tuple(ranks), {
                    "grad_norm": norm, "median": self.window.median(), "z": round(z, 2), "ratio_z": round(ratio_z, 2),
                    "trend": rising_before or "flat"}))
        self.recent.push(norm)
        self.history = (self.history + [(step, norm)])[-self.cfg.window:]
        if not surged:  # surges stay out of the baseline
            self.window.push(norm)
        self.pushed = (step, not surged)
        rising_now = self.trend()
        self.surges = [s for s in self.surges if s > step - self.cfg.surge_window] + ([step] if surged else [])
        repeated = 0 < self.cfg.surges_to_rise <= len(self.surges) and loss_up
        rising_now = rising_now and loss_up  # (a creep while the loss stays in its band -- a loss near its floor, whose
        # norm wiggles by half itself -- is no divergence: Megatron-LM at --lr 0.01 was rolled back three times for it)
        if (rising_now or repeated) and not self.in_rise:  # (once per episode: a remedy's reset_trend ends it)
            self.in_rise = True
            detail = {"grad_norm": norm, "median": self.window.median(), "steps": self.cfg.trend_steps,
                      "remedy": "lower the LR (or lengthen the warmup): the gradient norm is creeping up"}
            if rising_now:
                detail["log_slope_per_step"] = round(self.recent.slope(self.cfg.trend_steps, log=True), 4)
            else:
                detail.update({"surges": list(self.surges), "why": f"{len(self.surges)} gradient-norm surges within "
                               f"{self.cfg.surge_window} steps", "onset_step": self.surges[0]})
            self.rise_at = step
            verdicts.append(Verdict(self.name, "slow_rise", (), detail))  # (a trend of the run: no rank its cause)
        elif not rising_now and not repeated:
            self.in_rise = False
        return verdicts

    def blame_data(self, step: int) -> bool:
        """This step's batch was bad (a loss burst the weights do not explain): its norm is no evidence about the
        LR -- it leaves the surge count, the creep and the baseline (a stretch of bad data made the norm creep and
        surge, and the LR was lowered until lr_floor aborted the run). Returns True when a slow_rise was given at
        this step (void now)."""
        self.surges = [s for s in self.surges if s != step]
        if self.history and self.history[-1][0] == step:
            self.history.pop()
            if self.recent.values:
                self.recent.values.pop()
            if self.pushed == (step, True) and self.window.values:
                self.window.values.pop()
        if self.rise_at == step:
            self.rise_at, self.in_rise = None, False
            return True
        return False

    def ratio_since(self, step: int) -> float | None:
        """The median norm of the steps after ``step`` over the window's median: how far the gradient norm stands
        above its baseline over a climb (None: too few steps known)."""
        vals = [v for s, v in self.history if s > step]
        if len(vals) < 3 or len(self.window) < self.cfg.min_history or self.window.median() <= 0:
            return None
        vals.sort()
        return vals[len(vals) // 2] / self.window.median()

    def reset_trend(self) -> None:
        """After a rollback the trajectory is a new one: the creep measured on the old one is void (and after the LR
        was lowered in place: what goes on after a remedy is a new episode)."""
        self.recent = RollingWindow(self.recent.size)
        self.in_rise = False
        self.history = []
        self.surges = []

    def reset(self) -> None:
        """After a precision change (fp16 -> bf16): the norms measured before belong to another distribution
        (fresh optimizer state, no loss scale), against which every new step would look like a surge."""
        self.window = RollingWindow(self.window.size)
        self.reset_trend()

    def state_dict(self) -> dict:
        return {"window": self.window.state_dict(), "recent": self.recent.state_dict(), "in_rise": self.in_rise}

    def load_state_dict(self, state: dict) -> None:
        self.window.load_state_dict(state["window"])
        self.recent.load_state_dict(state["recent"])
        self.in_rise = bool(state["in_rise"])

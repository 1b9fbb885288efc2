"""The cost model the planner consults: seconds for each way of running one expert on ``n`` tokens.

Rates start from the hardware profile (``freetoken doctor``'s microbenchmarks) and move with what the engine
observes: every timed copy and every timed host compute updates an exponential moving average, so a drifting
machine (another process took a core, the PCIe link is shared) changes the plan within a few steps.

Model, per expert of ``B`` bytes and ``n`` routed tokens:
- host compute: ``B / host_gbps(n)``, where ``host_gbps`` interpolates the measured M=1 and M=16 kernel rates
  (decode streams the weights once; more tokens cost more arithmetic per byte);
- fetch: ``B / copy_gbps`` (+ a queue of copies already planned this step) then device compute;
- device compute: ``device_s_per_token * n + device_s_fixed`` (learned on a real accelerator from timed device parts
  of steps whose experts were all resident: no copy in the time);
- a cold expert also pays ``B / disk_gbps`` on either path (it must reach host memory first).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Rates:
    """Throughputs in GB/s and device times in seconds (all measured or scripted)."""

    copy_gbps: float = 12.0
    """Host → device copy."""
    host_gbps_m1: float = 8.0
    """CPU expert kernel, one token (weight bytes / second)."""
    host_gbps_m16: float = 4.0
    """CPU expert kernel, 16 tokens (weight bytes / call time)."""
    disk_gbps: float = 2.0
    device_s_fixed: float = 20e-6
    device_s_per_token: float = 1e-6


class CostModel:
    """Seconds per path for one expert; ``observe_*`` update the rates (EMA with weight ``alpha``)."""

    def __init__(self, rates: Rates | None = None, alpha: float = 0.2) -> None:
        self.rates = rates or Rates()
        self.alpha = alpha
        self.observations = 0

    def host_seconds(self, nbytes: int, n: int) -> float:
        r = self.rates
        t1 = nbytes / (r.host_gbps_m1 * 1e9)
        t16 = nbytes / (r.host_gbps_m16 * 1e9)
        return t1 + (t16 - t1) * (n - 1) / 15 if n > 1 else t1

    def copy_seconds(self, nbytes: int) -> float:
        return nbytes / (self.rates.copy_gbps * 1e9)

    def device_seconds(self, n: int) -> float:
        return self.rates.device_s_fixed + self.rates.device_s_per_token * n

    def disk_seconds(self, nbytes: int) -> float:
        return nbytes / (self.rates.disk_gbps * 1e9)

    def _ema(self, name: str, value: float) -> None:
        old = getattr(self.rates, name)
        setattr(self.rates, name, (1 - self.alpha) * old + self.alpha * value)
        self.observations += 1

    def observe_copy(self, nbytes: int, seconds: float) -> None:
        if seconds > 0:
            self._ema("copy_gbps", nbytes / seconds / 1e9)

    def observe_host(self, nbytes: int, n: int, seconds: float) -> None:
        """A timed host compute of one expert on ``n`` tokens (updates the M=1 or M=16 rate it is closest to)."""
        if seconds > 0:
            self._ema("host_gbps_m1" if n <= 4 else "host_gbps_m16", nbytes / seconds / 1e9)

    def observe_disk(self, nbytes: int, seconds: float) -> None:
        if seconds > 0:
            self._ema("disk_gbps", nbytes / seconds / 1e9)

    def observe_device(self, experts: int, tokens: int, seconds: float) -> None:
        """A timed device part of a step: ``experts`` resident experts computed on ``tokens`` routed tokens in all in
        ``seconds`` (launches and kernels; no copies). Decode-sized calls (<= 4 tokens an expert) update the fixed
        term, larger ones the per-token term: on a GPU driven op by op the fixed term is most of a decode step (an
        H200 took ~16x the built-in 20 us per expert), and a planner that believes 20 us sends to the device what
        the host would finish first."""
        if experts <= 0 or seconds <= 0:
            return
        per, n = seconds / experts, tokens / experts
        if n <= 4:
            self._ema("device_s_fixed", max(per - self.rates.device_s_per_token * n, 0.0))
        else:
            self._ema("device_s_per_token", max((per - self.rates.device_s_fixed) / n, 0.0))

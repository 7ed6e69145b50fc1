"""How a Ray job fails, for both ways of running one (:mod:`fp8rl.kube.submit`, :mod:`fp8rl.kube.job_submission`).

A module of its own so that both paths raise the same classes without importing each other.
"""

from __future__ import annotations

from fp8rl.errors import UserError


class RayJobFailed(UserError):
    """The Ray job did not succeed. ``reason`` is one line; ``str()`` adds the details (e.g. the traceback)."""

    def __init__(self, job: str, reason: str, details: str = "") -> None:
        self.job, self.reason, self.details = job, reason, details
        super().__init__(f"Ray job {job} failed: {reason}" + (f"\n{details}" if details else ""))


class RayJobTimeout(RayJobFailed):
    """A deadline passed; the job was stopped (or its RayJob deleted)."""

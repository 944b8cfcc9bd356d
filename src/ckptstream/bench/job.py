"""What the parent hands each worker process: the job (a JSON dict) and the helpers every kind
of job shares."""

from __future__ import annotations

import sys
from typing import Any

from .multirank import Group
from .state import StateSpec

Job = dict[str, Any]  # written by runner.base_job, read by the worker


def say(group: Group, message: str) -> None:
    """A progress line on stderr, from the lead rank only (N ranks would print it N times)."""
    if group.lead:
        print(f"  {message}", file=sys.stderr, flush=True)


def spec_of(job: Job, group: Group) -> StateSpec:
    """The state this rank builds."""
    spec = StateSpec(**job["spec"])
    # every rank its own data: equal data on all ranks could be deduplicated somewhere below
    return StateSpec(spec.size_bytes, spec.tensors, spec.tensor_kib, spec.seed + group.rank)

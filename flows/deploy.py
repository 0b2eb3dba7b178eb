"""The project's deployments, on a Prefect ``process`` work pool, declared from this checkout.

``python -m flows.deploy`` registers, with the Prefect server named by ``PREFECT_API_URL``
(credentials: ``PREFECT_API_AUTH_STRING``):

- the work pool ``ganpipe`` (type ``process``) with two queues: ``experiments`` (every run that
  trains; one worker per GPU takes them one at a time) and ``sweeps`` (a sweep only starts
  experiment runs and waits for them, so it must not hold the slot of a worker its
  experiments need);
- ``ganpipe-pipeline/scheduled``: one DVC experiment, nightly by default (``0 2 * * *``);
- ``ganpipe-pipeline/experiment``: the same flow on demand, no schedule: what a sweep starts
  for each grid point, and what ``prefect deployment run`` with overrides is for (pausing the
  nightly schedule never stops a sweep);
- ``ganpipe-sweep/scheduled``: the strategy sweep, weekly by default (``0 3 * * 0``);
- the automation ``ganpipe: crash silent flow runs``: a flow run whose heartbeats stop (its
  machine died, its worker was killed with it) is marked Crashed after ``--crash-after``
  seconds, which is how a sweep learns that an experiment is gone.

Every deployment runs this checkout's code in this checkout (pull step
``set_working_directory``): a worker on another machine needs a clone at the same path.
Deployments take no path from callers: the API refuses a parameter a flow does not declare
(HTTP 409). Schedules are cron strings, a number of seconds (an interval), or ``off``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import re
from typing import Any

from prefect import Flow
from prefect.deployments.runner import RunnerDeployment
from prefect.schedules import Cron, Interval, Schedule
from prefect.utilities.callables import ParameterSchema
from pydantic import ConfigDict

from flows import checkout

POOL = "ganpipe"
#: Queue of the runs that train (pipeline, experiments); workers per GPU take them.
EXPERIMENTS = "experiments"
#: Queue of the sweeps: light processes that start experiment runs and wait for them.
SWEEPS = "sweeps"
PIPELINE = "ganpipe-pipeline/scheduled"
EXPERIMENT = "ganpipe-pipeline/experiment"
SWEEP = "ganpipe-sweep/scheduled"
ZOMBIES = "ganpipe: crash silent flow runs"
#: Seconds between a flow run's heartbeats (Prefect's minimum is 30); set on the workers.
HEARTBEAT_S = 30


def parse_schedule(text: str, timezone: str) -> Schedule | None:
    """``"0 2 * * *"`` -> cron, ``"3600"`` -> every 3600 s, ``"off"`` -> no schedule.

    Raises:
        ValueError: neither a 5-field cron string, a positive number, nor ``off``.
    """
    text = text.strip()
    if text.lower() in ("off", "none", ""):
        return None
    if re.fullmatch(r"\d+(\.\d+)?", text):
        seconds = float(text)
        if seconds <= 0:
            raise ValueError(f"schedule {text!r}: an interval must be positive seconds")
        return Interval(datetime.timedelta(seconds=seconds), timezone=timezone)
    if len(text.split()) != 5:
        raise ValueError(
            f"schedule {text!r}: use a 5-field cron string ('0 2 * * *'), seconds ('3600') or 'off'"
        )
    return Cron(text, timezone=timezone)


def describe(schedule: Schedule | None) -> str:
    if schedule is None:
        return "on demand only"
    if schedule.interval is not None:
        return f"every {schedule.interval.total_seconds():g} s"
    return f"cron '{schedule.cron}' ({schedule.timezone or 'UTC'})"


class _ClosedSchema(ParameterSchema):
    model_config = ConfigDict(extra="allow")


def closed_parameters(deployment: RunnerDeployment) -> None:
    """Make the server refuse a flow run with a parameter the flow does not declare.

    Prefect's schema lets unknown keys through (no ``additionalProperties``), so a run asked
    with e.g. ``project_dir`` would be created and crash later; with this the API answers
    409 at creation.
    """
    schema = deployment._parameter_openapi_schema.model_dump()
    deployment._parameter_openapi_schema = _ClosedSchema(**schema, additionalProperties=False)


def ensure_pool() -> None:
    """The process work pool and its two queues (created once; left as they are after)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists

    with get_client(sync_client=True) as client:
        with contextlib.suppress(ObjectAlreadyExists):
            client.create_work_pool(WorkPoolCreate(name=POOL, type="process"))
        queues = {q.name for q in client.read_work_queues(work_pool_name=POOL)}
        for priority, name in enumerate((EXPERIMENTS, SWEEPS), 1):
            if name not in queues:
                client.create_work_queue(name, work_pool_name=POOL, priority=priority)


def ensure_crash_automation(crash_after_s: float) -> None:
    """Prefect's recipe for zombie flow runs (docs: "detect zombie flows"): a flow run that
    sent a heartbeat and then neither another one nor a final state within
    ``crash_after_s`` is marked Crashed. Replaced on every deploy (its window may change)."""
    from prefect.automations import Automation
    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import ChangeFlowRunState
    from prefect.events.schemas.automations import EventTrigger, Posture
    from prefect.events.schemas.events import ResourceSpecification
    from prefect.exceptions import ObjectNotFound

    with contextlib.suppress(ValueError, ObjectNotFound):  # none yet
        Automation.read(name=ZOMBIES).delete()
    Automation(
        name=ZOMBIES,
        description="A flow run whose process (or machine) died stops sending heartbeats",
        trigger=EventTrigger(
            after={"prefect.flow-run.heartbeat"},
            expect={
                "prefect.flow-run.heartbeat",
                "prefect.flow-run.Completed",
                "prefect.flow-run.Failed",
                "prefect.flow-run.Cancelled",
                "prefect.flow-run.Crashed",
            },
            match=ResourceSpecification({"prefect.resource.id": ["prefect.flow-run.*"]}),
            for_each={"prefect.resource.id"},
            posture=Posture.Proactive,
            threshold=1,
            within=datetime.timedelta(seconds=crash_after_s),
        ),
        actions=[
            ChangeFlowRunState(
                state=StateType.CRASHED,
                message=f"no heartbeat for {crash_after_s:g} s: its worker or machine is gone",
            )
        ],
    ).create()


def deployments(schedules: dict[str, Schedule | None]) -> list[RunnerDeployment]:
    """The three deployments, from this checkout's source, with closed parameter schemas."""
    project = str(checkout.PROJECT_ROOT)
    specs: list[tuple[str, str, str, Schedule | None, str]] = [
        (
            PIPELINE,
            "flows/pipeline.py:pipeline",
            EXPERIMENTS,
            schedules["pipeline"],
            "one DVC experiment",
        ),
        (EXPERIMENT, "flows/pipeline.py:pipeline", EXPERIMENTS, None, "one DVC experiment"),
        (SWEEP, "flows/sweep.py:sweep", SWEEPS, schedules["sweep"], "the strategy sweep"),
    ]
    made = []
    for full_name, entrypoint, queue, schedule, what in specs:
        flow_: Flow[Any, Any] = Flow.from_source(project, entrypoint)
        deployment = flow_.to_deployment(
            full_name.split("/")[1],
            work_pool_name=POOL,
            work_queue_name=queue,
            schedules=[schedule] if schedule else None,
            paused=False,
            description=f"{what} in a checkout of its own of {project}, {describe(schedule)}",
            tags=["ganpipe"],
        )
        closed_parameters(deployment)
        made.append(deployment)
    return made


def deploy(schedules: dict[str, Schedule | None], crash_after_s: float) -> list[str]:
    """Pool, queues, deployments and the crash automation; return the deployment names."""
    ensure_pool()
    ensure_crash_automation(crash_after_s)
    for deployment in deployments(schedules):
        deployment.apply(work_pool_name=POOL)
    return [PIPELINE, EXPERIMENT, SWEEP]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pipeline", default="0 2 * * *", help="cron, seconds or off")
    parser.add_argument("--sweep", default="0 3 * * 0", help="cron, seconds or off")
    parser.add_argument("--timezone", default="UTC", help="IANA zone of the cron schedules")
    parser.add_argument(
        "--crash-after",
        type=float,
        default=3 * HEARTBEAT_S,
        help="seconds without a heartbeat after which a flow run is marked Crashed "
        f"(workers send one every {HEARTBEAT_S} s; default three missed)",
    )
    args = parser.parse_args()
    schedules = {
        "pipeline": parse_schedule(args.pipeline, args.timezone),
        "sweep": parse_schedule(args.sweep, args.timezone),
    }
    deploy(schedules, args.crash_after)
    print(f"{PIPELINE}: {describe(schedules['pipeline'])}", flush=True)
    print(f"{EXPERIMENT}: on demand (sweeps start it)", flush=True)
    print(f"{SWEEP}: {describe(schedules['sweep'])}", flush=True)


if __name__ == "__main__":
    main()

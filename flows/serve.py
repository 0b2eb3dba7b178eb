"""Deployments of the pipeline and sweep flows, with schedules, served from this checkout.

``python -m flows.serve`` registers two deployments with the Prefect server named by
``PREFECT_API_URL`` (credentials: ``PREFECT_API_AUTH_STRING``) and runs their flow runs
here until stopped (SIGTERM or Ctrl-C). They work on this checkout's repository and take no
path from callers:

- ``ganpipe-pipeline/local``: one DVC experiment, nightly by default (``0 2 * * *``);
- ``ganpipe-sweep/local``: the strategy sweep, weekly by default (``0 3 * * 0``).

Either can also be started on demand, with parameters (``prefect deployment run
ganpipe-pipeline/local --param overrides='{"precision": "bf16"}'``). Schedules are cron
strings, a number of seconds (an interval), or ``off``. ``make serve`` starts a local
server and this process in the background; ``make stop`` stops both.
"""

from __future__ import annotations

import argparse
import datetime
import re

from prefect import serve
from prefect.deployments.runner import RunnerDeployment
from prefect.schedules import Cron, Interval, Schedule
from prefect.utilities.callables import ParameterSchema
from pydantic import ConfigDict

from flows import checkout
from flows.pipeline import pipeline
from flows.sweep import sweep

DEPLOYMENT = "local"
FLOWS = ("ganpipe-pipeline", "ganpipe-sweep")


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pipeline", default="0 2 * * *", help="cron, seconds or off")
    parser.add_argument("--sweep", default="0 3 * * 0", help="cron, seconds or off")
    parser.add_argument("--timezone", default="UTC", help="IANA zone of the cron schedules")
    parser.add_argument(
        "--limit",
        type=int,
        default=1,
        help="most flow runs at once (default 1: a run that outlasts its schedule's interval "
        "makes the next one wait instead of running beside it on the same CPU or GPU)",
    )
    args = parser.parse_args()
    schedules = {
        "pipeline": parse_schedule(args.pipeline, args.timezone),
        "sweep": parse_schedule(args.sweep, args.timezone),
    }
    project = str(checkout.PROJECT_ROOT)
    deployments = [
        flow_.to_deployment(
            DEPLOYMENT,
            schedules=[schedules[name]] if schedules[name] else None,
            paused=False,
            description=f"{what} of {project}, {describe(schedules[name])}",
            tags=["ganpipe"],
        )
        for name, flow_, what in (
            ("pipeline", pipeline, "one DVC experiment in its own checkout"),
            ("sweep", sweep, "strategy sweep"),
        )
    ]
    for deployment in deployments:
        closed_parameters(deployment)
    for name, schedule in schedules.items():
        print(f"ganpipe-{name}/{DEPLOYMENT}: {describe(schedule)}", flush=True)
    serve(*deployments, limit=args.limit)


if __name__ == "__main__":
    main()

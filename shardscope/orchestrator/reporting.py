"""Write a comparison's reports (summary.json, report.md, plots) at the end of a session or from files."""

from __future__ import annotations

import os
import sys

from shardscope.config import Comparison, dump_json
from shardscope.orchestrator.state import RunState


def write_reports(out_dir: str, comparison: Comparison, states: dict[str, RunState]) -> dict[str, str]:
    """Write summary.json (and, when the profiling reports are available, report.md and plots).

    Returns the paths written by name. Falls back to the core summary alone when the full report
    writer fails, so a summary always exists.
    """
    from shardscope.profiling import summary

    try:
        from shardscope.profiling.report import write_reports as full_reports
    except ImportError:
        full_reports = None
    if full_reports is not None:
        try:
            return full_reports(out_dir)
        except Exception as err:
            from shardscope.outspace import describe, disk_error

            disk = disk_error(err)
            why = describe(disk) if disk is not None else repr(err)
            print(f"shardscope: full report failed, writing the core summary: {why}", file=sys.stderr)
    path = os.path.join(out_dir, "summary.json")
    dump_json(path, summary.build_summary(comparison, states, out_dir))
    return {"summary": path}

"""The GPU benchmark's table, torch-free: ``benchmarks.gpu`` prints it, the docs test compares
docs/benchmarks.md with it rendered from the committed ``benchmarks/results/gpu.json``."""

from __future__ import annotations

from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "gpu.json"


def table(result: dict) -> str:
    """Markdown: a title line (GPU, torch, date), then one row per measured configuration."""
    lines = [
        f"{result['gpu']}, torch {result['torch']}, {result['date']}",
        "| program | step | batch | precision | images/s | ms/step | peak MiB |",
        "|---|---|---:|---|---:|---:|---:|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['program']} | {r['step']} | {r['batch']} | {r['precision']} | "
            f"{r['images_per_s']:,.0f} | {r['ms_per_step']:.2f} | {r['peak_memory_mb']:,.0f} |"
        )
    return "\n".join(lines)

"""The ``ftsystem`` command line: one entry point, one sub-command per component."""

from __future__ import annotations

import typer

app = typer.Typer(no_args_is_help=True, add_completion=False,
                  help="ftsystem: fault-tolerant training jobs (FT-HSDP, HALoS).")
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks: each prints a table and writes JSON.")
sim_app = typer.Typer(no_args_is_help=True, help="Simulators for scales that do not fit here.")
app.add_typer(bench_app, name="bench")
app.add_typer(sim_app, name="sim")

# Sub-command modules register themselves on the apps above when imported (one line each).
# --- registrations ---


def main() -> None:
    app()


if __name__ == "__main__":
    main()

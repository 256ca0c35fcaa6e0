"""A benchmark's table: printed with rich, and written as markdown and CSV beside each other."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any, Sequence

from rich.console import Console
from rich.table import Table


def print_table(title: str, columns: Sequence[str], body: Sequence[Sequence[str]], text_columns: Sequence[str],
                console: Console) -> None:
    """Print ``body`` under ``columns``; ``text_columns`` are left-aligned, the others (numbers) right-aligned."""
    table = Table(title=title)
    for column in columns:
        table.add_column(column, justify="left" if column in text_columns else "right")
    for row in body:
        table.add_row(*row)
    console.print(table)


def write_table(out: Path, stem: str, title: str, columns: Sequence[str], body: Sequence[Sequence[str]],
                notes: Sequence[str] = ()) -> tuple[Path, Path]:
    """Write ``out/stem.csv`` (the rows) and ``out/stem.md`` (the title, the table and ``notes``, a line each);
    return both paths."""
    out.mkdir(parents=True, exist_ok=True)
    csv_path, md_path = out / f"{stem}.csv", out / f"{stem}.md"
    with open(csv_path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(columns)
        writer.writerows(body)
    lines = [f"**{title}**", "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(row) + " |" for row in body]
    lines += ["", *notes, ""] if notes else [""]
    md_path.write_text("\n".join(lines))
    return md_path, csv_path


def publish(out: Path, stem: str, title: str, columns: Sequence[str], body: Sequence[Sequence[str]],
            text_columns: Sequence[str]) -> None:
    """A benchmark's one table: printed (:func:`print_table`), written as ``out/stem.csv`` and ``.md``
    (:func:`write_table`), and where it went said."""
    console = Console(width=180)
    print_table(title, columns, body, text_columns, console)
    written = write_table(out, stem, title, columns, body)
    console.print(f"wrote {written[0]} and {written[1]}")


def settings_and_out(cfg: Any) -> tuple[dict, Path]:
    """A benchmark's Hydra config as plain settings (its ``hydra`` and ``out`` keys taken off) and where its table
    goes (``out``)."""
    from omegaconf import OmegaConf

    settings = OmegaConf.to_container(cfg, resolve=True)
    settings.pop("hydra", None)
    return settings, Path(settings.pop("out"))

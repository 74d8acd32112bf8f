"""`specdraft export`: a profile's target as a transformers folder serving engines load as is
(models/export.py). The output folder is checked before the model loads: an existing
non-empty folder is replaced only with --force."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from specdraft.commands.io import EXIT_OK
from specdraft.errors import UsageError


def run_export_command(pool: str, out: str, dtype: str, force: bool, console: Console) -> int:
    from specdraft.models.export import DTYPES

    if dtype not in DTYPES:
        raise UsageError(f"--dtype {dtype}: expected one of {', '.join(DTYPES)}")
    folder = Path(out)
    if folder.exists() and not folder.is_dir():
        raise UsageError(f"--out {out} is a file, not a folder")
    if folder.is_dir() and any(folder.iterdir()) and not force:
        raise UsageError(f"--out {out} exists and is not empty; pass --force to replace it")
    from specdraft.models.export import export_model
    from specdraft.profile import load_profile

    profile = load_profile(pool)
    export_model(profile.target, str(profile.file), "target", folder, dtype)
    console.print(f"exported {profile.target.describe()} ({dtype}) → {out}", markup=False)
    return EXIT_OK

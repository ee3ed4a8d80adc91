"""Thin command-line front ends over the public Python API. Every `main` goes through `cli_main`
(dflash2.cli.entry): one place for how a refused, interrupted or failed run ends."""

from dflash2.cli.entry import CliError, cli_main

__all__ = ["CliError", "cli_main", "print_files"]


def print_files(files: dict) -> None:
    """The file / size table the export and build commands end with (files: name -> manifest.FileEntry)."""
    print(f"{'file':<28}{'MB':>10}")
    for name, meta in files.items():
        print(f"{name:<28}{meta.bytes / 1e6:>10.2f}")

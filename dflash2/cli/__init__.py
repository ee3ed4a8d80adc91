"""Thin command-line front ends over the public Python API."""


def print_files(files: dict) -> None:
    """The file / size table the export and build commands end with (files: name -> manifest.FileEntry)."""
    print(f"{'file':<28}{'MB':>10}")
    for name, meta in files.items():
        print(f"{name:<28}{meta.bytes / 1e6:>10.2f}")

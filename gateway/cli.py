"""Command line entry point (filled in by the core)."""


def main() -> int:
    raise SystemExit("not yet implemented")

"""`serve` refused in the parent: the one-line form every start-up refusal test checks (exit 2, or 75
for a port or socket another process holds now)."""

from __future__ import annotations

from pathlib import Path

from dspark_sidecar import cli


def refused(argv: list[str], capsys, *words: str, sock_dir: Path | None = None, status: int = 2) -> str:
    """Run the command: exit `status`, one line on stderr naming `words`, no traceback, and (with sock_dir)
    no socket left there. Returns the line."""
    rc = cli.main(argv)
    err = capsys.readouterr().err
    assert rc == status, err
    assert err.startswith("dspark-sidecar: ") and err.count("\n") == 1 and "Traceback" not in err, err
    for w in words:
        assert w in err, err
    if sock_dir is not None and sock_dir.is_dir():
        assert not list(sock_dir.glob("*.sock")), list(sock_dir.iterdir())
    return err

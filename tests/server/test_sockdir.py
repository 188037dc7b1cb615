"""server/sockdir.py making a missing socket folder while another process makes the same one."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from dspark_sidecar.server import sockdir
from dspark_sidecar.server.config import ServeConfigError


def test_parents_another_rank_makes_meanwhile_are_used_not_refused(tmp_path, monkeypatch):
    """Under torchrun every rank runs prepare at once on the same fresh path (there is no parent of ours to make
    it first), as do two serves started together: a parent another one made between this one's look and its
    mkdir (EEXIST) is the folder wanted, not a reason to refuse the socket folder."""
    d = tmp_path / "a" / "b" / "sock"
    parents = {tmp_path / "a", tmp_path / "a" / "b"}
    real = os.mkdir
    raced = []

    def mkdir_after_the_other_rank(p, mode=0o777, *args, **kwargs):
        if Path(p) in parents and not os.path.lexists(p):
            real(p, 0o755)  # the other rank's mkdir, just before ours
            raced.append(Path(p))
        return real(p, mode, *args, **kwargs)

    monkeypatch.setattr(sockdir.os, "mkdir", mkdir_after_the_other_rank)
    sockdir.prepare(d)
    monkeypatch.undo()
    assert set(raced) == parents
    assert stat.S_IMODE(d.stat().st_mode) == sockdir.LEAF_MODE


def test_missing_folders_under_a_link_to_nowhere_are_refused_in_one_line(tmp_path):
    """A link on the way whose target does not exist (a volume not mounted yet): mkdir of the folder below
    it fails with ENOENT while mkdir of the link itself fails with EEXIST, and _mkdir went back and forth
    between the two until Python's recursion limit, a RecursionError traceback (exit 1, which systemd
    restarts) instead of serve's one-line refusal of the folder."""
    (tmp_path / "mnt").symlink_to(tmp_path / "not-mounted")
    d = tmp_path / "mnt" / "dspark" / "sock"
    with pytest.raises(ServeConfigError, match=f"--socket-dir: cannot create {d}: No such file or directory"):
        sockdir.prepare(d)
    assert not (tmp_path / "not-mounted").exists()  # nothing made where the link points

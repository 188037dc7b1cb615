"""server/sockdir.py on the folders a socket path's lookup passes through, not only the resolved path's."""

from __future__ import annotations

import os

import pytest

from dspark_sidecar.server import preflight, sockdir
from dspark_sidecar.server.config import ServeConfig, ServeConfigError

OTHER_UID = 4242


@pytest.mark.parametrize("tail", ["", "sock"])  # the link is the folder itself, or one on the way to it
def test_a_link_of_ours_in_a_folder_every_user_may_rename_in_is_refused(tmp_path, tail):
    """A folder made directly in such a folder is refused (its parent's check), but a link of ours there to
    a private folder passed: the resolved path's parents are all private. Anyone may rename the link away
    and put theirs in its place, and the engine, which connects by the same path, follows theirs."""
    real = tmp_path / "real"
    (real / "sock").mkdir(parents=True, mode=0o700)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    scratch.chmod(0o777)  # no sticky bit
    (scratch / "mine").symlink_to(real)
    d = scratch / "mine" / tail if tail else scratch / "mine"
    for check in (preflight.check_socket_dir, lambda cfg: preflight.claim_socket(cfg, 0)):
        with pytest.raises(ServeConfigError, match=f"--socket-dir: {d}: the way to it passes {scratch / 'mine'}, "
                                                   f"whose folder {scratch} is writable by every user without the "
                                                   "sticky bit"):
            check(ServeConfig(tp=1, socket_dir=d))
    scratch.chmod(0o1777)  # as /tmp: others may not rename what is not theirs
    preflight.check_socket_dir(ServeConfig(tp=1, socket_dir=d))


def test_a_folder_leading_to_a_link_of_ours_in_a_folder_every_user_may_rename_in_is_refused(tmp_path):
    """scratch/sub/mine -> a private folder: whoever may rename in scratch can replace sub, and mine with it."""
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    scratch = tmp_path / "scratch"
    (scratch / "sub").mkdir(parents=True)
    scratch.chmod(0o777)
    (scratch / "sub" / "mine").symlink_to(real)
    with pytest.raises(ServeConfigError, match=f"passes {scratch / 'sub'}, whose folder {scratch} is writable"):
        sockdir.prepare(scratch / "sub" / "mine")


@pytest.mark.skipif(os.geteuid() != 0, reason="a link of another user's needs lchown (root)")
def test_a_link_of_another_user_s_undone_by_dot_dot_is_still_refused(tmp_path):
    """The kernel resolves theirs/.. through the link (to the folder above its target); os.path.abspath
    dropped both textually, so the walk looked at a path that does not exist and never saw their link,
    which its owner can point elsewhere later."""
    (tmp_path / "elsewhere" / "deep").mkdir(parents=True, mode=0o700)
    (tmp_path / "elsewhere").chmod(0o700)
    theirs = tmp_path / "theirs"
    theirs.symlink_to(tmp_path / "elsewhere" / "deep")
    os.lchown(theirs, OTHER_UID, -1)
    d = theirs / ".." / "sock"  # the kernel's: elsewhere/sock
    with pytest.raises(ServeConfigError, match=f"{theirs} is a symbolic link owned by another user"):
        sockdir.prepare(d)


@pytest.mark.skipif(os.geteuid() != 0, reason="a folder of another user's needs chown (root)")
def test_dot_dot_after_a_link_of_ours_is_not_judged_by_the_link_target_s_owner(tmp_path):
    """mine/.. is the folder above mine's target, which nobody can rename away: that target may belong to another
    user (a folder they made beside ours) without letting them move what the path reaches. Judged as an entry
    of the target, the lookup refused a socket folder no one else could change."""
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, OTHER_UID, -1)
    (tmp_path / "mine").symlink_to(theirs)
    d = tmp_path / "mine" / ".." / "sock"  # the kernel's: tmp_path/sock
    sockdir.prepare(d)
    assert (tmp_path / "sock").is_dir()


@pytest.mark.skipif(os.geteuid() != 0, reason="a link of root's needs root")
def test_a_link_of_root_s_on_the_way_is_not_another_user_s(tmp_path, monkeypatch):
    """A sidecar of its own user whose socket folder is reached through a link that root made (/var/run -> /run on
    most distributions): root can change anything anyway, so its link is trusted as its folders are, not refused
    as one another user could point elsewhere."""
    (tmp_path / "run" / "dspark").mkdir(parents=True, mode=0o770)
    (tmp_path / "run" / "dspark").chmod(0o770)
    (tmp_path / "var-run").symlink_to(tmp_path / "run")  # made by root: owner uid 0
    monkeypatch.setattr(sockdir, "effective_uid", lambda: OTHER_UID)  # the sidecar runs as another user than root
    d = tmp_path / "var-run" / "dspark"
    assert sockdir.foreign_link(d, OTHER_UID) is None
    sockdir.prepare(d)


def test_each_entry_on_the_way_is_looked_up_once_however_many_links_lead_back_to_it(tmp_path, monkeypatch):
    """Each link's target was walked from the root again, and with it every link on that walk: n links
    "l -> ." in a row cost ~2**n lstat calls (103 s at n = 18), a preflight and a client launch that never
    ended. Walked once per entry, the same answers come in a number of calls that grows with the path."""
    d = tmp_path
    for i in range(16):
        (d / f"l{i}").symlink_to(".")
        d = d / f"l{i}"
    calls = []
    real = os.lstat
    monkeypatch.setattr(sockdir.os, "lstat", lambda p: calls.append(p) or real(p))
    assert sockdir.foreign_link(d / "sock", os.geteuid()) is None
    assert sockdir.swappable_entry(d / "sock", os.geteuid()) is None
    assert len(calls) < 40 * (len(tmp_path.parts) + 17)


def test_a_link_of_ours_reached_only_through_a_chain_of_links_is_judged_too(tmp_path):
    """mine1 -> safe/mine2 -> scratch/mine3 -> a private folder: the link that anyone may rename away lies
    two links deep, on no path but the targets' own. Each link's target is walked in turn, not only the
    first's: the lookup passes scratch/mine3 as surely as if it had been written in the path."""
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    scratch.chmod(0o777)  # no sticky bit
    (scratch / "mine3").symlink_to(real)
    (tmp_path / "safe").mkdir()
    (tmp_path / "safe" / "mine2").symlink_to(scratch / "mine3")
    (tmp_path / "mine1").symlink_to(tmp_path / "safe" / "mine2")
    assert sockdir.swappable_entry(tmp_path / "mine1", os.geteuid())[:2] == (scratch / "mine3", scratch)
    with pytest.raises(ServeConfigError, match=f"passes {scratch / 'mine3'}, whose folder {scratch} is writable"):
        sockdir.prepare(tmp_path / "mine1")

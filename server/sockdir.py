"""The socket folder: made private when `serve` makes it, refused when someone else could plant sockets in it.

The gRPC endpoints have no authentication; the socket folder's permissions are the access control
(deploy/SECURITY.md). Whoever may create entries in the folder can bind DIR/rank{r}.sock while the
sidecar is down (or swap it, where they may also remove ours) and receive an engine's connection, and
with it the IPC handles of the engine's GPU memory. So the folder must be one that only the sidecar's
user, root, and the group they chose can write.

Policy (`problem`), on the folder the sockets will actually be in (a symbolic link is followed, and
refused when another user owns the link, or any link on the way to it: they could point it elsewhere
later):
- owned by another user (neither this effective uid nor root): refused; its owner controls it whatever
  its mode says, and can chmod it back at any time.
- writable by every user (o+w): refused, sticky or not (the sticky bit stops others from removing our
  sockets, not from taking a rank's name first), with one exception: a root-owned setgid folder. That
  is kubelet's emptyDir with the pod's fsGroup (root, group fsGroup, mode 2777, or 3777 where the tmpfs
  of medium: Memory is sticky), visible only to that pod's containers. Shared scratch folders (/tmp,
  /var/tmp, /dev/shm) are never setgid. The bit is a marker that root provisioned the folder for a
  group, not a proof, so a root-made 2777 folder elsewhere is trusted as root's choice.
  Our own o+w folder is refused rather than tightened: while it was open, others may already have put
  entries in it that a chmod would not remove, and the mode may be an operator's deliberate choice;
  the message says how to fix it (OpenSSH's StrictModes and tmux refuse in the same way).
- group-writable is accepted: the group is how the engine reaches the sockets (0660).
Its parents (`parent_problem`): whoever may rename entries in a parent can move the folder away and
put theirs in its place. So each must belong to this user or root, and be writable by every user only
with the sticky bit (as /tmp is: others may not rename what is not theirs). Group-writable parents are
accepted, as the folder's own group is. The same holds for every folder the path's lookup passes
through, not only the resolved path's parents: a link of ours (or a folder leading to it) in a folder
anyone may rename in can be swapped for one of theirs as easily as the folder itself.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

from dspark_sidecar.server.config import ServeConfigError

LEAF_MODE = 0o770  # the sidecar's user and the group it shares with the engine; never others
# Parents made here: others may pass through to the sockets but not create or rename entries, which
# would let them swap our folder for theirs. mkdir's mode is narrowed by the umask and never widened,
# so no folder made here is writable by others at any instant (no mkdir-then-chmod window). Unlike the
# leaf, whose 0770 is the documented contract, parents keep what the umask takes: a umask of 077 then
# keeps an engine of another user out, as the operator asked.
PARENT_MODE = 0o755


def effective_uid() -> int:
    """The uid the sockets will belong to (tests substitute another to stand for a foreign owner)."""
    return os.geteuid()


def problem(d: Path, st_uid: int, st_mode: int, euid: int) -> str | None:
    """Why a folder with this owner and mode may not hold the sockets of a sidecar running as `euid`
    (one clause, naming what was found and what to do), or None."""
    found = f"owner uid {st_uid}, mode {stat.S_IMODE(st_mode):04o}"
    if st_uid not in (euid, 0):
        return (f"belongs to another user ({found}), who could replace the sockets in it; have it removed (by "
                f"its owner or root) or choose a folder this user (uid {euid}) or root made (serve makes a "
                "missing one, mode 0770)")
    if not st_mode & stat.S_IWOTH or (st_uid == 0 and st_mode & stat.S_ISGID):
        return None
    risk = f"is writable by every user ({found}): any local user could take a rank's socket name there"
    if st_uid == euid != 0:
        return f"{risk}; chmod o-w {d}, or remove it and let serve make it (mode 0770)"
    if not st_mode & stat.S_ISVTX:
        # A folder of ours inside would be refused in turn (parent_problem): anyone may rename it away.
        return (f"{risk}, and rename away any folder made inside it (no sticky bit); have root chmod o-w {d}, "
                "or choose a folder whose parents only this user or root may change (serve makes a missing one, "
                "mode 0770), or in Kubernetes an emptyDir with the pod's fsGroup set")
    return (f"{risk}; use a folder of the sidecar's own inside it, e.g. {d / 'dspark-sidecar'} (serve makes a "
            "missing one, mode 0770), or in Kubernetes an emptyDir with the pod's fsGroup set")


def parent_problem(d: Path, st_uid: int, st_mode: int, euid: int) -> str | None:
    """Why a parent folder with this owner and mode would let another user swap the socket folder `d`
    for theirs (one clause), or None."""
    found = f"owner uid {st_uid}, mode {stat.S_IMODE(st_mode):04o}"
    if st_uid not in (euid, 0):
        why = f"belongs to another user ({found})"
    elif st_mode & stat.S_IWOTH and not st_mode & stat.S_ISVTX:
        why = f"is writable by every user without the sticky bit ({found})"
    else:
        return None
    return (f"{why}, who could rename {d} away and put a folder of theirs in its place; choose a socket folder "
            "whose parents only this user or root may change")


def _on_the_way(d: Path, hops: int = 0, seen: set[Path] | None = None) -> Iterator[tuple[Path, os.stat_result]]:
    """Each entry a lookup of `d` passes, with its lstat: `d` and each of its parents, and the same of every
    link's target in turn (the parents' check sees only the resolved path, on which no link lies). The path
    is made absolute but not normalized: the kernel resolves "link/.." through the link, where a textual
    normalization drops both (and with them a link of another user's).

    Each entry once (`seen`): a link's target walks its parents again, which the walk has mostly passed
    already, and re-walking them made n links "l -> ." in a row cost ~2**n lookups (minutes at n = 18)."""
    seen = set() if seen is None else seen
    path = Path(d).absolute()
    for p in (*reversed(path.parents), path):
        if p in seen:  # looked up already, and its link's target walked then: nothing new
            continue
        seen.add(p)
        try:
            st = os.lstat(p)  # follows the links above p, not p itself
        except OSError:
            return
        yield p, st
        if stat.S_ISLNK(st.st_mode) and hops < 40:  # the kernel's own limit on links followed in one lookup
            yield from _on_the_way(p.parent / os.readlink(p), hops + 1, seen)


def foreign_link(d: Path, euid: int) -> tuple[Path, int] | None:
    """The first symbolic link on the way to `d` that another user (not `euid`, not root) owns, with its
    owner; None if there is none."""
    return next(((p, st.st_uid) for p, st in _on_the_way(d) if stat.S_ISLNK(st.st_mode)
                 and st.st_uid not in (euid, 0)), None)


def swappable_entry(d: Path, euid: int) -> tuple[Path, Path, str] | None:
    """The first entry on the way to `d` (a link of ours, or a folder leading to one) whose folder would
    let another user rename it away and put theirs in its place (parent_problem), as (entry, folder, why);
    None if there is none."""
    for p, _ in _on_the_way(d):
        if p.name in ("", ".."):  # the root, or ".." (which no one can rename)
            continue
        st = os.stat(p.parent)  # the folder actually holding p: links above it followed
        why = parent_problem(p, st.st_uid, st.st_mode, euid)
        if why:
            return p, p.parent, why
    return None


def _mkdir(p: Path, mode: int) -> bool:
    """mkdir p with `mode`, and its missing parents with PARENT_MODE; True if p was made here."""
    try:
        os.mkdir(p, mode)
    except FileExistsError:
        return False
    except FileNotFoundError:
        if p.parent == p:
            raise
        _mkdir(p.parent, PARENT_MODE)
        try:  # once more, not through here: a parent that exists but leads nowhere (a link to a missing folder)
            os.mkdir(p, mode)  # answers ENOENT again, and retrying made and found it for ever (RecursionError)
        except FileExistsError:
            return False
    return True


def _make_leaf(d: Path) -> tuple[int, int] | None:
    """mkdir `d` (LEAF_MODE) and its missing parents (PARENT_MODE); the (st_dev, st_ino) of the folder made
    here, with its mode set (_give_group_bits), or None where `d` existed already.

    The parent is opened before the mkdir, and the folder looked for in it afterwards: the path alone may
    lead elsewhere by then (below)."""
    try:
        parent = os.open(d.parent, os.O_PATH | os.O_DIRECTORY)
    except FileNotFoundError:
        _mkdir(d.parent, PARENT_MODE)
        parent = os.open(d.parent, os.O_PATH | os.O_DIRECTORY)
    try:
        try:
            os.mkdir(d, LEAF_MODE)
        except FileExistsError:
            return None
        return _give_group_bits(d, parent)
    finally:
        os.close(parent)


def _replaced(d: Path, why: str) -> ServeConfigError:
    """The refusal of a socket folder that is no longer the one serve just made (`why`: what is there now)."""
    return ServeConfigError(f"--socket-dir: {d} is not the folder serve just made ({why}): someone who may change "
                            f"{d.parent} or a folder above it replaced it; choose a socket folder whose parents "
                            "only this user or root may change")


def _give_group_bits(d: Path, parent: int) -> tuple[int, int]:
    """Set LEAF_MODE on the folder `_make_leaf` just made at `d` in the folder `parent` (a descriptor opened
    before the mkdir), and return its (st_dev, st_ino): the umask may have taken the group's bits, which the
    engine needs. A setgid bit inherited from the parent is kept: it is what gives the sockets the engine's
    group (where only a chmod's loss of it could give the group its bits, they are left as the umask made them).

    Through a descriptor opened in `parent` without following a link, and only on a folder of this user's:
    between the mkdir and here, whoever may rename entries in the parent (its group; anyone where the parent
    check below refuses it, too late for this) could have put a link or a folder of theirs at `d`, and a
    chmod by path followed the link (as root: any file's mode made 0770). Whoever may rename entries in a
    folder above could instead have moved the parent away and put a link in its place: the path then named
    a folder elsewhere, made 0770 as well, so the name is looked up in `parent`, not along the path."""
    try:
        fd = os.open(d.name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=parent)
    except OSError as err:  # a link (ENOTDIR or ELOOP, neither naming it), a file, or nothing now
        try:
            link = stat.S_ISLNK(os.stat(d.name, dir_fd=parent, follow_symlinks=False).st_mode)
        except OSError:
            link = False
        raise _replaced(d, "a symbolic link now" if link else err.strerror) from None
    try:
        st = os.fstat(fd)
        if st.st_uid != effective_uid():
            raise _replaced(d, f"now owner uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o}")
        if st.st_mode & stat.S_ISGID and not _in_group(st.st_gid):
            # A chmod by a user outside the folder's group clears its setgid bit (the kernel's rule), and the
            # sockets then got this user's group, not the engine's that the parent hands down (a parent made
            # by root for this user with the engine's group): no engine could connect. Kept as mkdir made it:
            # LEAF_MODE less the umask, so never anything for others.
            return st.st_dev, st.st_ino
        os.fchmod(fd, LEAF_MODE | (st.st_mode & stat.S_ISGID))
    finally:
        os.close(fd)
    return st.st_dev, st.st_ino


def _in_group(gid: int) -> bool:
    """Whether this process may keep a folder's setgid bit through a chmod: root, or a member of its group `gid`."""
    return os.geteuid() == 0 or gid == os.getegid() or gid in os.getgroups()


def prepare(d: Path) -> None:
    """Make `d` if it is missing (mode 0770 whatever the umask, unless that would cost it a setgid parent's
    group: _give_group_bits), then refuse it under the policy above.
    Runs in the parent before any rank starts and again in each rank before it binds (under torchrun
    there is no parent of ours)."""
    try:
        made = _make_leaf(d)
    except OSError as err:
        raise ServeConfigError(f"--socket-dir: cannot create {d}: {err.strerror}") from None
    try:
        st = os.stat(d)
    except OSError as err:
        raise ServeConfigError(f"--socket-dir: cannot use {d}: {err.strerror}") from None
    if made is not None and (st.st_dev, st.st_ino) != made:
        # The path leads elsewhere than to the folder made above (a folder on the way was replaced by a link):
        # the checks below would judge, and the ranks serve in, that other folder.
        raise _replaced(d, f"a folder on the way to it was replaced, and it now leads to {os.path.realpath(d)}")
    if not stat.S_ISDIR(st.st_mode):
        raise ServeConfigError(f"--socket-dir: {d} exists and is not a folder")
    euid = effective_uid()
    found = foreign_link(d, euid)
    if found:
        # Its owner can point it elsewhere after the check, and the engine follows it too.
        link, uid = found
        where = f"{d}" if link == Path(d).absolute() else f"{d}: {link}"
        raise ServeConfigError(f"--socket-dir: {where} is a symbolic link owned by another user (uid {uid}), "
                               f"who could point it elsewhere; give the folder itself ({os.path.realpath(d)})")
    why = problem(d, st.st_uid, st.st_mode, euid)
    if why:
        raise ServeConfigError(f"--socket-dir: {d} {why}")
    for parent in Path(os.path.realpath(d)).parents:
        pst = os.stat(parent)
        why = parent_problem(d, pst.st_uid, pst.st_mode, euid)
        if why:
            raise ServeConfigError(f"--socket-dir: {d}: its parent {parent} {why}")
    swappable = swappable_entry(d, euid)
    if swappable:
        entry, folder, why = swappable
        raise ServeConfigError(f"--socket-dir: {d}: the way to it passes {entry}, whose folder {folder} {why}")

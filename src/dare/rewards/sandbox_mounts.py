"""Inside an ``unshare`` sandbox: build the candidate's file-system view, then give up every privilege over it.

``unshare --user --map-root-user --mount --pid --ipc --net --uts --fork`` starts the bootstrap as root of a fresh user
namespace that owns fresh mount, pid, IPC, network and UTS namespaces. ``enter_view`` (run before any untrusted code,
prepended to ``sandbox_child.py``'s source, standard library only) then

1. mounts an empty tmpfs as the new root and bind-mounts into it, read-only, exactly the paths the parent listed (the
   interpreter, the standard library, the shared libraries it maps, the loader's cache; see ``sandbox_host``),
   recreating the symlinks that lead to them and masking ``site-packages`` with empty read-only tmpfs;
2. adds ``/dev/{null,zero,full,random,urandom}``, a fresh ``/proc`` of the sandbox's pid namespace (none when the
   kernel refuses one), the program (read-only ``/program.py``) and the only writable places: a size-capped tmpfs
   ``/tmp`` (the scratch, also HOME and TMPDIR) and ``/dev/shm``;
3. ``pivot_root`` into it and detaches the old root, so no path leads back to the host's file system;
4. remounts the root read-only and enters a nested user namespace: from then on the process holds no capability in
   the namespaces that own these mounts, so it cannot unmount, remount or mount anything there (``umount2("/proc")``
   fails; and below /proc there is only an empty directory of the tmpfs root).

Everything lives in namespaces that die with the sandbox's last process: the tmpfs contents, and every SysV IPC object
(the IPC namespace) are gone with it.
"""
import os

_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = 32, 4096, 16384, 1 << 18
_MS_NOATIME, _MS_NODIRATIME, _MS_RELATIME = 1024, 2048, 1 << 21
_MNT_DETACH = 2
_CLONE_NEWUSER = 0x10000000
# pivot_root has no libc wrapper; its system call number per architecture (others cannot use this mode).
_SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "ppc64": 203, "s390x": 217}
_DEVICES = ("null", "zero", "full", "random", "urandom")


class _Libc:
    def __init__(self):
        import ctypes
        self.ctypes = ctypes
        self.lib = ctypes.CDLL(None, use_errno=True)

    def _check(self, result, what):
        if result != 0:
            errno = self.ctypes.get_errno()
            raise OSError(errno, f"{what}: {os.strerror(errno)}")

    def mount(self, source, target, fstype, flags, data=None):
        enc = lambda s: None if s is None else s.encode()  # noqa: E731
        self._check(self.lib.mount(enc(source), enc(target), enc(fstype), self.ctypes.c_ulong(flags), enc(data)),
                    f"mount {source or fstype} on {target}")

    def umount(self, target, flags):
        self._check(self.lib.umount2(target.encode(), flags), f"umount {target}")

    def pivot_root(self, new_root, put_old):
        number = _SYS_PIVOT_ROOT.get(os.uname().machine)
        if number is None:
            raise OSError(0, f"pivot_root: unknown system call number on {os.uname().machine}")
        self._check(self.lib.syscall(number, new_root.encode(), put_old.encode()), "pivot_root")

    def unshare(self, flags):
        self._check(self.lib.unshare(flags), "unshare")


def _locked_flags(path):
    """Mount flags a read-only remount of a bind of ``path`` must keep (the kernel refuses to clear them in a user
    namespace when the host mount has them)."""
    from os import statvfs
    f_flag = statvfs(path).f_flag
    flags = 0
    for st, ms in ((getattr(os, "ST_NOSUID", 2), _MS_NOSUID), (getattr(os, "ST_NODEV", 4), _MS_NODEV),
                   (getattr(os, "ST_NOEXEC", 8), _MS_NOEXEC), (getattr(os, "ST_NOATIME", 1024), _MS_NOATIME),
                   (getattr(os, "ST_NODIRATIME", 2048), _MS_NODIRATIME), (getattr(os, "ST_RELATIME", 4096), _MS_RELATIME)):
        if f_flag & st:
            flags |= ms
    return flags


def _mountpoint(path, is_dir):
    os.makedirs(path if is_dir else os.path.dirname(path), exist_ok=True)
    if not is_dir and not os.path.exists(path):
        with open(path, "w"):
            pass


def _bind_ro(libc, source, target):
    _mountpoint(target, os.path.isdir(source))
    libc.mount(source, target, None, _MS_BIND | _MS_REC)
    libc.mount(None, target, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _locked_flags(source))


def _tmpfs(libc, target, size, mode, read_only=False):
    os.makedirs(target, exist_ok=True)
    libc.mount("tmpfs", target, "tmpfs", _MS_NOSUID | _MS_NODEV, f"size={size},mode={mode:o}")
    if read_only:
        libc.mount(None, target, None, _MS_REMOUNT | _MS_RDONLY | _MS_NOSUID | _MS_NODEV)


def enter_view(view):
    """Build the view described by ``view`` (``{"root", "entries", "scratch_bytes", "program"}``, from
    ``sandbox_host.unshare_spec``) and move this process into it for good. Raises OSError when the kernel refuses a
    step: the sandbox then fails to start, it never runs the program with the host's view."""
    libc = _Libc()
    root = view["root"]
    libc.mount(None, "/", None, _MS_REC | _MS_PRIVATE)  # nothing we mount propagates to the host
    libc.mount("tmpfs", root, "tmpfs", _MS_NOSUID | _MS_NODEV, "size=4m,mode=755")
    for entry in view["entries"]:
        kind, path = entry[0], entry[-1]
        if kind == "bind":
            _bind_ro(libc, path, root + path)
        elif kind == "symlink":
            os.makedirs(os.path.dirname(root + path), exist_ok=True)
            os.symlink(entry[1], root + path)
        elif kind == "mask":
            _tmpfs(libc, root + path, 4096, 0o755, read_only=True)
    os.makedirs(root + "/dev", exist_ok=True)
    for name in _DEVICES:
        if os.path.exists("/dev/" + name):
            _bind_ro(libc, "/dev/" + name, f"{root}/dev/{name}")
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"{root}/dev/{name}")
    size = int(view["scratch_bytes"])
    _tmpfs(libc, root + "/tmp", size, 0o1777)
    _tmpfs(libc, root + "/dev/shm", size, 0o1777)
    if view.get("program"):
        _bind_ro(libc, view["program"], root + "/program.py")
    os.makedirs(root + "/proc", exist_ok=True)
    try:
        libc.mount("proc", root + "/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)
    except OSError:
        pass  # a kernel that refuses a proc mount here (host /proc partly masked): the sandbox has no /proc
    os.chdir(root)
    libc.pivot_root(".", ".")  # the old root is now stacked under the new one at "/"
    libc.umount(".", _MNT_DETACH)  # ... and gone: no path leads back to the host
    os.chdir("/")
    libc.mount(None, "/", None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | _MS_NODEV)
    os.chdir("/tmp")
    # Last: a nested user namespace. Its process has no capability in the namespaces owning the mounts, the pid and
    # IPC namespaces, so nothing above can be undone from inside.
    libc.unshare(_CLONE_NEWUSER)

"""Safe output: never delete what moeplan did not write, never leave a half-written result.

Every `--out` goes through `atomic_path`:
- the result is built in a private temporary beside the target and swapped in only on success;
- an existing target is replaced only if it is empty or a previous moeplan output of the same
  kind (a trace, a placement, a plan, an ONNX file, a bundle), unless the user passed `--force`;
- a target equal to, inside, or containing any input of the command is refused, even with
  `--force` (the CLI declares the inputs with `command_scope`);
- the swap is an atomic exchange (`renameat2(RENAME_EXCHANGE)`) where the filesystem has one,
  else rename-aside-then-rename inside our temporary, so a kill at any moment leaves the old or
  the new result whole (a kill between the two renames is undone by the next write);
- temporaries left by killed runs (`.NAME.moeplan-PID-xxxx`, and the older `.NAME.xxxxxxxx`) are
  cleaned up by the next write to the same target.
"""
from __future__ import annotations

import contextlib
import contextvars
import ctypes
import ctypes.util
import errno
import json
import os
import re
import shutil
import tempfile
import zipfile
from pathlib import Path

from moeplan.core.errors import UserError

_INPUTS: contextvars.ContextVar = contextvars.ContextVar("moeplan_inputs", default=())
_FORCE: contextvars.ContextVar = contextvars.ContextVar("moeplan_force", default=False)

_TMP_TAG = "moeplan"
_DISK_ERRNOS = (errno.ENOSPC, errno.EACCES, errno.EROFS, errno.EDQUOT, errno.EPERM)


@contextlib.contextmanager
def command_scope(inputs=(), force: bool = False):
    """Declare the current command's input paths and its --force flag for every write inside."""
    resolved = tuple(sorted({Path(p).resolve() for p in inputs if p is not None and os.path.lexists(p)}))
    tokens = (_INPUTS.set(resolved), _FORCE.set(bool(force)))
    try:
        yield
    finally:
        _FORCE.reset(tokens[1])
        _INPUTS.reset(tokens[0])


# ---------------------------------------------------------------------------------------- kinds

def _is_trace(path: Path) -> bool:
    try:
        with zipfile.ZipFile(path) as zf:
            return "experts.npy" in zf.namelist()
    except (OSError, zipfile.BadZipFile, ValueError):
        return False


def _json_object(path: Path):
    try:
        if path.stat().st_size > 1 << 30:
            return None
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    return doc if isinstance(doc, dict) else None


def _is_placement(path: Path) -> bool:
    doc = _json_object(path)
    return doc is not None and "layers" in doc and "topology" in doc and "policy" in doc


def _is_plan(path: Path) -> bool:
    doc = _json_object(path)
    return doc is not None and "version" in doc and "placement" in doc and "model" in doc


def _is_onnx(path: Path) -> bool:
    try:
        import onnx

        onnx.load(str(path), load_external_data=False)
        return True
    except Exception:
        return False


def _is_bundle(path: Path) -> bool:
    doc = _json_object(path / "manifest.json") if path.is_dir() else None
    return doc is not None and isinstance(doc.get("files"), dict) and (path / "plan.json").is_file()


def _is_hardware_profile(path: Path) -> bool:
    try:
        import yaml

        from moeplan.core.hardware import profile_from_dict

        if path.stat().st_size > 1 << 20:
            return False
        profile_from_dict(yaml.safe_load(path.read_text(encoding="utf-8")), str(path))
        return True
    except Exception:
        return False


def _is_report(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except OSError:
        return False
    return head.startswith(b"<!DOCTYPE html>") and b"<title>moeplan report" in head


KINDS = {
    "trace": ("routing trace (.npz)", _is_trace),
    "report": ("report (HTML)", _is_report),
    "placement": ("placement.json", _is_placement),
    "plan": ("plan.json", _is_plan),
    "onnx": ("ONNX model", _is_onnx),
    "bundle": ("bundle directory", _is_bundle),
    "hardware": ("hardware profile (YAML)", _is_hardware_profile),
}


# ------------------------------------------------------------------------------------- checks

def _relation(a: Path, b: Path) -> str | None:
    if a == b:
        return "is"
    if b in a.parents:
        return "is inside"
    if a in b.parents:
        return "contains"
    return None


def check_not_input(target: Path) -> None:
    """Refuse a target that is, lies inside, or contains an input of the current command."""
    resolved = Path(os.path.realpath(target.parent)) / target.name
    for inp in _INPUTS.get():
        how = _relation(resolved, inp)
        if how is not None:
            raise UserError(f"output '{target}' {how} the input '{inp}'; write to another path "
                            "(--force never replaces an input)")


def _is_empty_dir(path: Path) -> bool:
    return path.is_dir() and not path.is_symlink() and not any(path.iterdir())


def check_replaceable(target: Path, kind: str | None) -> None:
    """Refuse an existing target that is not an earlier moeplan output of `kind` (unless --force)."""
    if kind is None or not os.path.lexists(target) or _is_empty_dir(target) or _FORCE.get():
        return
    description, recognise = KINDS[kind]
    if not target.is_symlink() and recognise(target):
        return
    what = "directory" if target.is_dir() else "file"
    raise UserError(f"output '{target}' already exists and is a {what} that is not a moeplan {description}; "
                    "choose another path, or pass --force to replace it")


# ------------------------------------------------------------------------------- temporaries

def _tmp_prefix(name: str) -> str:
    return f".{name}.{_TMP_TAG}-"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_stale_temporaries(target: Path) -> list:
    """Remove temporaries of dead moeplan runs beside `target`; restore a target a kill left aside."""
    removed = []
    try:
        siblings = list(target.parent.iterdir())
    except OSError:
        return removed
    ours = re.compile(re.escape(_tmp_prefix(target.name)) + r"(\d+)-[A-Za-z0-9_]+$")
    legacy = re.compile(re.escape(f".{target.name}.") + r"[A-Za-z0-9_]{8}$")
    for entry in siblings:
        m = ours.match(entry.name)
        if m:
            if _pid_alive(int(m.group(1))) and int(m.group(1)) != os.getpid():
                continue
        elif not (legacy.match(entry.name) and entry.is_dir() and {c.name for c in entry.iterdir()} <= {target.name}):
            continue
        aside = entry / (target.name + ".old")
        if m and aside.exists() and not os.path.lexists(target):
            os.rename(aside, target)  # a kill between the two renames of a swap: put the old result back
        shutil.rmtree(entry, ignore_errors=True)
        removed.append(entry)
    return removed


# --------------------------------------------------------------------------------------- swap

_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux renameat2); False when unsupported here."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint)
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EXDEV):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _swap_in(new: Path, target: Path, tmp_dir: Path) -> None:
    """Put `new` at `target`; the old target (if any) ends up inside `tmp_dir` to be removed."""
    if not os.path.lexists(target):
        os.rename(new, target)
    elif new.is_file() and target.is_file() and not target.is_symlink():
        os.replace(new, target)
    elif not _exchange(new, target):
        os.rename(target, tmp_dir / (target.name + ".old"))
        os.rename(new, target)


def check_output(target, kind: str | None) -> None:
    """Everything that can be said about an output before any work: not an input, replaceable, and
    under a directory (not a file). Commands call it first, `atomic_path` again at the write."""
    target = Path(target)
    check_not_input(target)
    check_replaceable(target, kind)
    blocking = next((p for p in (target.parent, *target.parent.parents) if os.path.lexists(p)), None)
    if blocking is not None and not blocking.is_dir():
        raise UserError(f"cannot write '{target}': '{blocking}' is a file, not a directory; choose another --out")


@contextlib.contextmanager
def atomic_path(target: str | os.PathLike, kind: str | None = None):
    """Yield a temporary path beside `target`; swap it onto `target` only on success.

    Works for files and directories alike. `kind` names what the target holds ("trace",
    "placement", "plan", "onnx", "bundle"): an existing target of another kind is refused unless
    --force; None (internal caches) replaces files freely.
    """
    target = Path(target)
    check_output(target, kind)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        clean_stale_temporaries(target)
        tmp_dir = Path(tempfile.mkdtemp(prefix=f"{_tmp_prefix(target.name)}{os.getpid()}-", dir=target.parent))
    except OSError as exc:
        raise UserError(f"cannot write '{target}': {exc.strerror or exc} ('{target.parent}'); "
                        "choose a writable directory for the output") from None
    tmp = tmp_dir / target.name
    try:
        yield tmp
        _swap_in(tmp, target, tmp_dir)
    except OSError as exc:
        if exc.errno in _DISK_ERRNOS:
            raise UserError(f"cannot write '{target}': {exc.strerror}; free space or choose another location") from None
        raise
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)


def write_text_atomic(target: str | os.PathLike, text: str, kind: str | None = None) -> None:
    """Write `text` to `target` atomically."""
    with atomic_path(target, kind) as tmp:
        tmp.write_text(text)

"""Step folders on disk: their names, checksums, atomic publishing and retention.

The pieces of :mod:`lintime.training.checkpoint` (the run folder's layout and its contract) that
handle one ``checkpoints/step_NNNNNNNN/`` folder at a time: the file names, :func:`file_sha256`
and :func:`verify_checkpoint` (``checksums.json``), writing the weights and trainer state into a
hidden temporary folder and publishing it by a rename, pruning to the ``keep`` newest intact
folders, setting an abandoned future aside (:func:`later_checkpoints`), and finding a folder
again (:func:`list_checkpoints`, :func:`resolve_checkpoint`, :func:`run_dir_of`).  The single- and
multi-process saves (:func:`lintime.training.checkpoint.save_checkpoint`,
:func:`lintime.training.checkpoint_sharded.save_distributed_checkpoint`) are built from these.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch

from lintime.utils.io import atomic_write_json, fsync_dir, fsync_file, ordinary_mode

CONFIG_FILE = "config.json"
TOKENIZER_DIR = "tokenizer"
CHECKPOINTS_DIR = "checkpoints"
LATEST_FILE = "latest"
WEIGHTS_FILE = "model.safetensors"
STATE_FILE = "trainer_state.pt"
CHECKSUM_FILE = "checksums.json"  # {"sha256": {file name: hex digest}} of the step folder's files
OPTIM_DIR = "optimizer"
ABANDONED_DIR = "abandoned"  # checkpoints/abandoned/: intact step folders a resume from an earlier step set aside
DCP_MARK = "dcp"  # trainer_state["optimizer"] of a distributed checkpoint
_STEP_DIR = re.compile(r"^step_(\d{8,})$")


def step_dir_name(step: int) -> str:
    """``step_00000100`` (8 digits, zero-padded, so names sort like steps)."""
    return f"step_{step:08d}"


# ---------------------------------------------------------------------------------------------
# step folders: written whole, then published by a rename


def _publish(tmp: Path, final: Path, ckpt_root: Path) -> None:
    """Move the finished temporary folder ``tmp`` to ``final``; re-saving a step (e.g. after a
    resume) swaps the folders, so a reader never sees a half-written state."""
    ordinary_mode(tmp)
    fsync_dir(tmp)
    if final.exists():
        old = Path(tempfile.mkdtemp(prefix=f".old-{final.name}-", dir=ckpt_root))
        os.rename(final, old / final.name)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)


def _write_weights_and_state(folder: Path, model: torch.nn.Module, step: int, trainer_state: dict) -> None:
    """``model.safetensors``, ``trainer_state.pt`` and their ``checksums.json`` into ``folder``,
    each fsynced.  A failed write (a full disk) raises ``OSError`` naming the folder."""
    from safetensors import SafetensorError
    from safetensors.torch import save_model

    weights, state = folder / WEIGHTS_FILE, folder / STATE_FILE
    try:
        save_model(model, str(weights), metadata={"format": "lintime", "step": str(step)})
        ordinary_mode(weights)  # safetensors writes through a private (0600) temporary file
        fsync_file(weights)
        with open(state, "wb") as f:
            torch.save(trainer_state, f)
            f.flush()
            os.fsync(f.fileno())
    except (RuntimeError, SafetensorError) as err:  # how torch.save / safetensors report a failed write
        raise _write_error(folder, err) from None
    atomic_write_json(folder / CHECKSUM_FILE, {"sha256": {WEIGHTS_FILE: file_sha256(weights), STATE_FILE: file_sha256(state)}})


def _write_error(folder: Path, err: BaseException) -> OSError:
    """``err`` of a library's failed write as the ``OSError`` it hides: the errno it names
    (``os error 28``), else ENOSPC when the disk is full, else EIO."""
    found = re.search(r"os error (\d+)", str(err))
    if found:
        code = int(found.group(1))
    else:
        try:
            code = errno.ENOSPC if shutil.disk_usage(folder).free < (1 << 20) else errno.EIO
        except OSError:
            code = errno.EIO
    return OSError(code, f"{os.strerror(code)} (writing a checkpoint: {_one_line(err)})", str(folder))


_DIGESTS: dict[tuple, str] = {}  # file identity and stat -> sha256, so pruning does not re-hash every save


def file_sha256(path: str | os.PathLike) -> str:
    """sha256 of the file; remembered for the file as it is (device, inode, size, mtime and ctime
    in ns: any write or replacement changes them), so a process hashes a checkpoint once."""
    st = os.stat(path)
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    if key in _DIGESTS:
        return _DIGESTS[key]
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
        after = os.fstat(f.fileno())
    digest = h.hexdigest()
    if (after.st_size, after.st_mtime_ns, after.st_ctime_ns) == key[2:]:  # not written while read
        if len(_DIGESTS) >= 256:
            _DIGESTS.clear()
        _DIGESTS[key] = digest
    return digest


def verify_checkpoint(step_dir: str | os.PathLike, files: tuple[str, ...] = (WEIGHTS_FILE, STATE_FILE)) -> str | None:
    """``None`` when ``files`` of ``step_dir`` match the checksums recorded at save, else what is
    wrong (one phrase).  A checkpoint saved before checksums existed has none to check: ``None``."""
    step_dir = Path(step_dir)
    try:
        recorded = json.loads((step_dir / CHECKSUM_FILE).read_text())["sha256"]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError):
        return f"its {CHECKSUM_FILE} is unreadable"
    for name in files:
        if name in recorded and (not (step_dir / name).is_file() or file_sha256(step_dir / name) != recorded[name]):
            return f"{name} does not match the checksum recorded when it was saved"
    return None


def newest_intact_checkpoint(run_dir: str | os.PathLike, *, besides: Path | None = None) -> Path | None:
    """The newest step folder of ``run_dir`` (other than ``besides``) whose files match their checksums."""
    for cand in reversed(list_checkpoints(run_dir)):
        if besides is not None and cand.resolve() == Path(besides).resolve():
            continue
        if verify_checkpoint(cand) is None:
            return cand
    return None


def _corrupted(step_dir: Path, what: str) -> ValueError:
    step_dir = Path(step_dir)
    good = newest_intact_checkpoint(run_dir_of(step_dir), besides=step_dir) if _STEP_DIR.match(step_dir.name) else None
    hint = f"; the newest intact checkpoint is {good}" if good is not None else "; the run has no other intact checkpoint"
    return ValueError(f"checkpoint {step_dir} is corrupted: {what}{hint}")


def _prune(run_dir: str | os.PathLike, keep: int, newest: Path) -> None:
    """Keep the ``keep`` newest intact step folders (``newest``, just written, is one); delete the
    older ones and every corrupted one, which never counts among the ``keep``."""
    kept = 0
    for cand in reversed(list_checkpoints(run_dir)):
        if kept < keep and (cand == newest or verify_checkpoint(cand) is None):
            kept += 1
        else:
            shutil.rmtree(cand, ignore_errors=True)


def later_checkpoints(step_dir: str | os.PathLike) -> list[Path]:
    """The step folders of ``step_dir``'s run with a later step, oldest first: what a run resumed
    from ``step_dir`` abandons (pass them as ``abandon`` to its first save)."""
    m = _STEP_DIR.match(Path(step_dir).name)
    if m is None:
        return []
    return [p for p in list_checkpoints(run_dir_of(step_dir)) if _step_of(p) > int(m.group(1))]


def abandon_notice(step_dir: str | os.PathLike, later: list[Path]) -> str:
    """The line that tells a user resuming from ``step_dir`` what happens to ``later``."""
    corrupted = {p for p in later if verify_checkpoint(p) is not None}
    names = ", ".join(p.name + (" (corrupted)" if p in corrupted else "") for p in later)
    todo = []
    if corrupted:
        todo.append("deletes the corrupted ones")
    if len(corrupted) < len(later):
        todo.append(f"moves the intact ones to {run_dir_of(step_dir) / CHECKPOINTS_DIR / ABANDONED_DIR}/")
    return (f"lintime train: resuming from {step_dir}: the later {names} belong to an abandoned future; "
            f"the first save {' and '.join(todo)}")


def _set_aside(folders, ckpt_root: Path) -> None:
    """Delete the corrupted step folders of ``folders``, move the intact ones to ``abandoned/``
    (replacing an earlier abandoned folder of the same step)."""
    for old in folders:
        old = Path(old)
        if not old.is_dir():
            continue
        if verify_checkpoint(old) is not None:
            shutil.rmtree(old, ignore_errors=True)
            continue
        dest = ckpt_root / ABANDONED_DIR / old.name
        dest.parent.mkdir(exist_ok=True)
        if dest.exists():
            shutil.rmtree(dest)
        os.rename(old, dest)
    if folders:
        fsync_dir(ckpt_root)


def _step_of(step_dir: Path) -> int:
    return int(_STEP_DIR.match(step_dir.name).group(1))


def _remove_stale_temporaries(ckpt_root: Path) -> None:
    """Leftovers of a save that crashed (hidden ``.tmp-`` / ``.old-`` folders)."""
    for p in ckpt_root.iterdir():
        if p.is_dir() and (p.name.startswith(".tmp-") or p.name.startswith(".old-")):
            shutil.rmtree(p, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# finding a step folder


def list_checkpoints(run_dir: str | os.PathLike) -> list[Path]:
    """Complete step folders of a run, oldest first (hidden temporaries are not listed)."""
    root = Path(run_dir) / CHECKPOINTS_DIR
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))]
    return [p for _, p in sorted(found) if (p / WEIGHTS_FILE).is_file()]


def resolve_checkpoint(path: str | os.PathLike, *, intact: bool = True) -> Path:
    """The step folder meant by ``path``: a step folder itself, or a run folder (its ``latest``;
    when ``latest`` is missing or names a missing folder, the highest complete step folder).
    With ``intact`` (the default), a run folder's choice that is corrupted (its files do not
    match their checksums) gives way to the newest intact step folder before it, when there is
    one; ``intact=False`` returns it as is (:func:`load_model` does, so that loading refuses it
    in one line naming the intact one rather than silently loading an older model).
    Raises ``FileNotFoundError`` with one line when there is none."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    if (path / WEIGHTS_FILE).is_file():
        return path
    if _STEP_DIR.match(path.name):
        raise FileNotFoundError(f"checkpoint {path} is incomplete: it has no {WEIGHTS_FILE}")
    if (path / CHECKPOINTS_DIR).is_dir() or (path / CONFIG_FILE).is_file():
        latest = path / CHECKPOINTS_DIR / LATEST_FILE
        found = list_checkpoints(path)
        chosen = found[-1] if found else None
        if latest.is_file():
            cand = path / CHECKPOINTS_DIR / latest.read_text().strip()
            if (cand / WEIGHTS_FILE).is_file():
                chosen = cand
        if chosen is None:
            raise FileNotFoundError(f"run {path} has no checkpoint yet (no {CHECKPOINTS_DIR}/step_* folder)")
        if intact and _STEP_DIR.match(chosen.name) and verify_checkpoint(chosen) is not None:
            before = [p for p in found if _step_of(p) < _step_of(chosen)]
            good = next((p for p in reversed(before) if verify_checkpoint(p) is None), None)
            if good is not None:
                return good
        return chosen
    raise FileNotFoundError(f"{path} is neither a run folder (with {CONFIG_FILE}) nor a checkpoint folder (with {WEIGHTS_FILE})")


def run_dir_of(step_dir: str | os.PathLike) -> Path:
    """The run folder of a step folder (``runs/<name>/checkpoints/step_N`` -> ``runs/<name>``; also
    of one set aside in ``checkpoints/abandoned/``)."""
    parent = Path(step_dir).parent
    if parent.name == ABANDONED_DIR and parent.parent.name == CHECKPOINTS_DIR:
        return parent.parent.parent
    return parent.parent


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return text if len(text) <= 300 else text[:297] + "..."

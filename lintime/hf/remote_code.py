"""The ``trust_remote_code`` route: make an HF folder loadable where lintime is not installed.

:func:`write_remote_code` adds three files to a folder written by ``save_pretrained`` and points
``config.json``'s ``auto_map`` at them:

* ``lintime_bundle.py`` -- this lintime's Python sources (every module except the command line
  and the benchmarks), zlib-compressed and base64-encoded, and :func:`ensure_lintime`, which makes
  ``import lintime`` work: when lintime is importable it is used as it is; otherwise the sources
  are unpacked once (atomically) into ``lintime_src_<hash>/`` next to the module (HF's modules
  cache) and that folder is put on ``sys.path``;
* ``configuration_lintime.py`` / ``modeling_lintime.py`` -- call ``ensure_lintime()``, then
  re-export :class:`~lintime.hf.configuration.LintimeConfig` /
  :class:`~lintime.hf.modeling.LintimeForCausalLM`.

transformers copies these files into its modules cache and imports them; their only imports are
the standard library, so its check for missing packages passes.  Limits: the bundled lintime
needs what lintime itself needs to run a model (torch, numpy, safetensors; triton for the fused
kernels on CUDA); an installed lintime takes precedence over the bundle (a warning is printed when
its version differs from the bundled one); the bundle is Python source, so a folder written by
one lintime version keeps running that version's code.
"""

from __future__ import annotations

import base64
import hashlib
import json
import zlib
from pathlib import Path

_SKIP = ("cli", "bench")  # top-level subpackages the model does not need

_BUNDLE_TEMPLATE = '''"""lintime sources bundled for ``trust_remote_code`` (written by lintime {version}; see
lintime/hf/remote_code.py).  Do not edit: regenerate with ``lintime export``."""

import base64
import importlib
import importlib.util
import json
import os
import sys
import tempfile
import warnings
import zlib
from pathlib import Path

VERSION = {version!r}
DIGEST = {digest!r}
_DATA = {data!r}


def _sources():
    return json.loads(zlib.decompress(base64.b64decode(_DATA)).decode("utf-8"))


def _unpack(root):
    if (root / "lintime" / "__init__.py").is_file():
        return
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=root.name + ".tmp-", dir=root.parent))
    for rel, text in _sources().items():
        path = tmp / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    try:
        os.rename(tmp, root)
    except OSError:  # another process unpacked the same bundle first: keep theirs
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
        if not (root / "lintime" / "__init__.py").is_file():
            raise


def ensure_lintime():
    """Make ``import lintime`` work: the installed lintime if there is one, else this bundle."""
    if "lintime" in sys.modules or importlib.util.find_spec("lintime") is not None:
        installed = importlib.import_module("lintime").__version__
        if installed != VERSION:
            warnings.warn(f"this model was exported by lintime {{VERSION}}; using the installed lintime {{installed}}")
        return
    root = Path(__file__).resolve().parent / ("lintime_src_" + DIGEST)
    try:
        _unpack(root)
    except OSError:  # read-only modules cache: unpack under the temporary folder instead
        root = Path(tempfile.gettempdir()) / ("lintime_src_" + DIGEST)
        _unpack(root)
    sys.path.insert(0, str(root))
    importlib.invalidate_caches()
'''

_CONFIG_MODULE = '''"""AutoConfig entry of a lintime model for ``trust_remote_code=True`` (written by lintime export)."""

import importlib

from .lintime_bundle import ensure_lintime

ensure_lintime()
LintimeConfig = importlib.import_module("lintime.hf.configuration").LintimeConfig
'''

_MODEL_MODULE = '''"""AutoModelForCausalLM entry of a lintime model for ``trust_remote_code=True`` (written by lintime export)."""

import importlib

from .lintime_bundle import ensure_lintime

ensure_lintime()
LintimeConfig = importlib.import_module("lintime.hf.configuration").LintimeConfig
LintimeForCausalLM = importlib.import_module("lintime.hf.modeling").LintimeForCausalLM
'''

AUTO_MAP = {
    "AutoConfig": "configuration_lintime.LintimeConfig",
    "AutoModelForCausalLM": "modeling_lintime.LintimeForCausalLM",
}


def bundle_sources() -> dict[str, str]:
    """``{relative path: source}`` of the lintime package (without cli/ and bench/)."""
    import lintime

    root = Path(lintime.__file__).resolve().parent
    out = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[0] in _SKIP or "__pycache__" in rel.parts:
            continue
        out[str(Path("lintime") / rel)] = path.read_text(encoding="utf-8")
    return out


def write_remote_code(directory: str | Path) -> list[Path]:
    """Add the remote-code files to the HF folder ``directory`` (which holds ``config.json``) and
    set its ``auto_map``; return the files written."""
    from lintime import __version__

    directory = Path(directory)
    cfg_path = directory / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{cfg_path} not found: write the model with save_pretrained first")
    payload = json.dumps(bundle_sources(), sort_keys=True).encode("utf-8")
    digest = hashlib.sha256(payload).hexdigest()[:16]
    data = base64.b64encode(zlib.compress(payload, 9)).decode("ascii")
    files = {
        "lintime_bundle.py": _BUNDLE_TEMPLATE.format(version=__version__, digest=digest, data=data),
        "configuration_lintime.py": _CONFIG_MODULE,
        "modeling_lintime.py": _MODEL_MODULE,
    }
    written = []
    for name, text in files.items():
        (directory / name).write_text(text, encoding="utf-8")
        written.append(directory / name)
    config = json.loads(cfg_path.read_text())
    config["auto_map"] = dict(AUTO_MAP)
    cfg_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return written

"""Where a search keeps its results: a local folder or a URI that every node reaches.

``--storage-path`` is either a local path (``ray_results``, ``/mnt/nfs/mtbert``: the
driver writes its files there with plain file I/O, exactly as for a single machine) or
a URI that ``pyarrow.fs.FileSystem.from_uri`` resolves and Ray Tune accepts as
``RunConfig(storage_path=...)``: ``s3://BUCKET/PREFIX``, ``gs://BUCKET/PREFIX``,
``abfs://CONTAINER@ACCOUNT.dfs.core.windows.net/PREFIX``, ``hdfs://HOST:PORT/PATH`` or
``file:///ABSOLUTE/PATH`` (a shared filesystem named as a URI).

With a URI, Ray writes trial folders and checkpoints there itself; the driver's own
files (``mtbert_search.json``, ``mtbert_mlflow.json``, ``summary.*``, report plots,
ensemble predictions) are written to a local staging folder
(``$MTBERT_CACHE/experiments/...``, default ``~/.cache/mtbert/experiments/...``) and
copied to ``URI/<experiment>/`` -- the settings and MLflow-id files at once, everything
else when the search ends -- so ``--resume`` works from any machine that reaches the URI.

:class:`ExperimentLocation` names one experiment's places (local folder, URI, what Ray
is given, what users are shown).
"""

from __future__ import annotations

import hashlib
import os
import posixpath
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from mtbert.core.errors import ConfigError

_URI_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://(.*)$")
#: URI schemes that pyarrow resolves to a filesystem Ray Tune can use for storage
SCHEMES = {"file": "LocalFileSystem", "s3": "S3FileSystem", "gs": "GcsFileSystem",
           "gcs": "GcsFileSystem", "abfs": "AzureFileSystem", "abfss": "AzureFileSystem",
           "hdfs": "HadoopFileSystem"}
_BUCKETED = {"s3", "gs", "gcs", "abfs", "abfss"}
#: local copies of a URI storage's best checkpoints, inside the staging experiment folder
STAGED_CHECKPOINTS = "_checkpoints"
#: written when a finished search removed its training states (retention.py): nothing
#: is left to ``--resume``
PRUNED_FILE = "mtbert_pruned.json"
_HINT = ("use a local folder or a URI: s3://BUCKET/PREFIX, gs://BUCKET/PREFIX, "
         "abfs://CONTAINER@ACCOUNT.dfs.core.windows.net/PREFIX, hdfs://HOST:PORT/PATH "
         "or file:///ABSOLUTE/PATH")


def is_uri(text: str) -> bool:
    return bool(_URI_RE.match(str(text)))


def check_uri(uri: str, what: str = "--storage-path") -> str:
    """Syntax of a storage URI (no network); returns it without a trailing slash."""
    m = _URI_RE.match(uri)
    if not m:
        raise ConfigError(f"{what} {uri}: not a URI; {_HINT}")
    scheme, rest = m.group(1).lower(), m.group(2)
    if scheme not in SCHEMES:
        raise ConfigError(f"{what} {uri}: unsupported scheme {scheme!r}; {_HINT}")
    import pyarrow.fs
    if not hasattr(pyarrow.fs, SCHEMES[scheme]):
        raise ConfigError(f"{what} {uri}: this pyarrow build has no {SCHEMES[scheme]} "
                          f"(pyarrow {__import__('pyarrow').__version__})")
    if scheme == "file":
        if not rest.startswith("/"):
            raise ConfigError(f"{what} {uri}: a file URI needs an absolute path "
                              "(file:///ABSOLUTE/PATH)")
    elif scheme in _BUCKETED:
        bucket = rest.split("/", 1)[0].split("?", 1)[0]
        if not bucket:
            raise ConfigError(f"{what} {uri}: no bucket/container name; {_HINT}")
    return uri.rstrip("/") if rest.rstrip("/") else uri


def join(uri: str, *parts: str) -> str:
    """``uri/part/...`` keeping a query string (``?endpoint_override=...``) at the end."""
    base, sep, query = uri.partition("?")
    return "/".join([base.rstrip("/"), *parts]) + (sep + query if sep else "")


def filesystem(uri: str):
    """``(pyarrow filesystem, path on it)``; may contact the service (credentials, region)."""
    import pyarrow.fs
    try:
        return pyarrow.fs.FileSystem.from_uri(uri)
    except Exception as exc:  # noqa: BLE001 -- pyarrow raises OSError / ArrowInvalid / ...
        raise ConfigError(f"--storage-path: cannot open {uri} ({exc})") from None


def local_path_of(uri: str) -> Path | None:
    """The local folder a ``file://`` URI names (None for remote schemes)."""
    m = _URI_RE.match(uri)
    if m and m.group(1).lower() == "file":
        return Path(m.group(2).split("?", 1)[0])
    return None


def exists(uri: str) -> bool:
    import pyarrow.fs
    fs, path = filesystem(uri)
    return fs.get_file_info(path).type != pyarrow.fs.FileType.NotFound


def read_text(uri: str) -> str | None:
    """The text of a file at a URI, or None when it does not exist."""
    import pyarrow.fs
    fs, path = filesystem(uri)
    if fs.get_file_info(path).type != pyarrow.fs.FileType.File:
        return None
    with fs.open_input_stream(path) as fh:
        return fh.read().decode("utf-8")


def write_text(uri: str, text: str) -> None:
    """Write a file at a URI whole or not at all: to a temporary sibling, then moved over
    it (a driver killed mid-write left an empty settings file that --resume could not read)."""
    data = text.encode("utf-8")
    fs, path = filesystem(uri)
    parent = path.rsplit("/", 1)[0]
    if parent:
        fs.create_dir(parent, recursive=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with fs.open_output_stream(tmp) as fh:
            fh.write(data)
        fs.move(tmp, path)
    except BaseException:
        try:
            fs.delete_file(tmp)
        except OSError:
            pass
        raise


def upload_tree(local_dir: Path, uri: str, skip: tuple[str, ...] = ()) -> None:
    """Copy a local folder's files to ``uri`` (overwriting), except top-level ``skip`` names."""
    import pyarrow.fs
    fs, root = filesystem(uri)
    local_fs = pyarrow.fs.LocalFileSystem()
    for path in sorted(Path(local_dir).rglob("*")):
        rel = path.relative_to(local_dir)
        if not path.is_file() or rel.parts[0] in skip:
            continue
        dest = f"{root.rstrip('/')}/{rel.as_posix()}"
        fs.create_dir(dest.rsplit("/", 1)[0], recursive=True)
        pyarrow.fs.copy_files(str(path), dest, source_filesystem=local_fs,
                              destination_filesystem=fs)


def download_checkpoint(fs, fs_path: str, dest: Path, with_weights: bool) -> Path:
    """Copy one checkpoint folder (``fs_path`` on the pyarrow filesystem ``fs``) to ``dest``.

    The optimizer state (``state.pt``) is skipped, and without ``with_weights`` the weight
    files too: metrics, config and validation predictions are enough for the MLflow
    artifacts, the weights for predicting and keeping the model."""
    import pyarrow.fs

    from mtbert.run.training_state import STATE_FILE, WEIGHT_FILES  # deferred: torch
    local_fs = pyarrow.fs.LocalFileSystem()
    dest.mkdir(parents=True, exist_ok=True)
    for info in fs.get_file_info(pyarrow.fs.FileSelector(fs_path, recursive=True)):
        if info.type != pyarrow.fs.FileType.File:
            continue
        rel = info.path[len(fs_path.rstrip("/")) + 1:]
        if rel == STATE_FILE or (rel in WEIGHT_FILES and not with_weights):
            continue
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        pyarrow.fs.copy_files(info.path, str(target), source_filesystem=fs,
                              destination_filesystem=local_fs)
    return dest


def _uri_path(uri: str) -> tuple[str, str, str]:
    """(scheme, path, ``?query`` or "") of a URI."""
    scheme, _, rest = uri.partition("://")
    rest, sep, query = rest.partition("?")
    return scheme, rest, sep + query


def _normalized(path: str) -> str:
    """A URI's path with ``..`` and ``.`` resolved (its leading ``/`` kept: file:///)."""
    lead = "/" if path.startswith("/") else ""
    return lead + posixpath.normpath(path).lstrip("/")


def weights_at_hand(path: str) -> bool:
    """Whether a kept model's (or checkpoint's) folder is there: a local folder, or a
    URI with something at it."""
    return exists(path) if is_uri(path) else Path(path).is_dir()


def uri_of(uri: str, fs_path: str) -> str:
    """The URI of a path on the filesystem of the storage root ``uri``."""
    _, root = filesystem(uri)
    root = root.rstrip("/")
    if fs_path.startswith(root + "/"):
        return join(uri, fs_path[len(root) + 1:])
    return fs_path


def staging_root(uri: str) -> Path:
    """Local folder where the driver writes its files for a URI storage root."""
    base = Path(os.environ.get("MTBERT_CACHE") or Path.home() / ".cache" / "mtbert").expanduser()
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", uri.split("?", 1)[0])[-60:].strip("_")
    digest = hashlib.sha1(uri.encode("utf-8")).hexdigest()[:8]
    return (base / "experiments" / f"{slug}-{digest}").resolve()


def reset_staging(folder: Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)


@dataclass(frozen=True)
class ExperimentLocation:
    """One experiment's places: ``storage`` is the local root (the storage folder, or the
    staging folder of a URI), ``storage_uri`` the ``--storage-path`` URI if it is one."""
    storage: Path
    experiment: str
    storage_uri: str | None = None

    @property
    def exp_dir(self) -> Path:
        """Local: the experiment folder (or its staging copy for a URI)."""
        return self.storage / self.experiment

    @property
    def exp_uri(self) -> str | None:
        return join(self.storage_uri, self.experiment) if self.storage_uri else None

    @property
    def ray_storage(self) -> str:
        """``RunConfig(storage_path=...)``."""
        return self.storage_uri or str(self.storage)

    @property
    def ray_experiment(self) -> str:
        """The experiment's location for Ray (``Tuner.restore``) and for users."""
        return self.exp_uri or str(self.exp_dir)

    def taken(self) -> bool:
        return exists(self.exp_uri) if self.exp_uri else self.exp_dir.exists()

    def public(self, path: str | Path | None) -> str | None:
        """A path under the local experiment folder as users find it (the URI copy)."""
        if path is None or not self.exp_uri:
            return None if path is None else str(path)
        try:
            rel = Path(path).resolve().relative_to(self.exp_dir.resolve())
        except ValueError:
            return str(path)
        return join(self.exp_uri, *rel.parts) if rel.parts else self.exp_uri

    def read(self, name: str) -> str | None:
        """A file of the experiment (the URI copy where there is one), None if absent."""
        if self.exp_uri:
            return read_text(join(self.exp_uri, name))
        path = self.exp_dir / name
        return path.read_text(encoding="utf-8") if path.is_file() else None

    def write(self, name: str, text: str) -> None:
        """A file of the experiment, locally and (for a URI) at once to the URI too."""
        self.exp_dir.mkdir(parents=True, exist_ok=True)
        (self.exp_dir / name).write_text(text, encoding="utf-8")
        if self.exp_uri:
            write_text(join(self.exp_uri, name), text)

    def upload(self, skip: tuple[str, ...] = ()) -> None:
        """Copy the local experiment files to the URI (nothing for a local storage)."""
        if self.exp_uri:
            upload_tree(self.exp_dir, self.exp_uri, skip=skip)

    def relative(self, path: str | None) -> str | None:
        """A folder of this experiment, or of another one in its storage (a local path, or
        a URI on a URI storage), as ``trials.json`` names it: relative to the experiment
        folder -- ``models/<trial>``, ``trial_<id>/checkpoint_000002``,
        ``../first/models/<trial>`` -- as Ray names checkpoints, so that a search folder
        (or the storage) copied or moved still finds its weights.  A path outside the
        storage stays as it is."""
        if not path:
            return None
        if self.storage_uri:
            if not is_uri(path):
                return path
            root, rest = _uri_path(self.storage_uri)[1], _uri_path(path)[1]
            if _uri_path(path)[0] != _uri_path(self.storage_uri)[0] \
                    or not rest.startswith(root.rstrip("/") + "/"):
                return path
            return posixpath.relpath(rest, posixpath.join(root, self.experiment))
        if is_uri(path):
            return path
        where = Path(path).resolve()
        try:
            where.relative_to(self.storage.resolve())
        except ValueError:
            return path
        return Path(os.path.relpath(where, self.exp_dir.resolve())).as_posix()

    def resolved(self, path: str | None, experiments: tuple[str, ...] = ()) -> str | None:
        """A weights entry of this experiment's ``trials.json`` as a folder (or URI) to
        read.  Relative (:meth:`relative`): under this experiment folder.  Absolute (as
        searches named them before): itself where it exists, else the same place relative
        to the experiment folder it named, moved here -- the last of its parts that is
        one of ``experiments``: the first is the search that wrote the file (now this
        folder, whatever its name), the others (a trial's own search) are folders of this
        storage -- where that exists, so that a search copied or moved keeps reading its
        old file.  Otherwise the path as written (the ensemble then says it is gone)."""
        if not path:
            return None
        if not is_uri(path) and not os.path.isabs(path):
            if self.exp_uri:
                scheme, rest, query = _uri_path(self.exp_uri)
                return f"{scheme}://{_normalized(posixpath.join(rest, path))}{query}"
            return os.path.normpath(self.exp_dir / path)
        if weights_at_hand(path):
            return path
        parts = _uri_path(path)[1].split("/") if is_uri(path) else list(Path(path).parts)
        for i, name in enumerate(experiments):
            if not name or name not in parts[:-1]:
                continue
            tail = parts[len(parts) - 1 - parts[-2::-1].index(name):]
            if self.storage_uri:
                moved = join(self.exp_uri if i == 0 else join(self.storage_uri, name), *tail)
            else:
                moved = str((self.exp_dir if i == 0 else self.storage / name).joinpath(*tail))
            if weights_at_hand(moved):
                return moved
        return path

    def stage_earlier_weights(self, records) -> None:
        """Local copies (under ``STAGED_CHECKPOINTS``) of the weights of an earlier
        search's trials (``--extend``) that a URI names; each record then names its copy."""
        for r in records:
            if r.origin and r.best_checkpoint and is_uri(r.best_checkpoint):
                fs, fs_path = filesystem(r.best_checkpoint)
                r.best_checkpoint = str(download_checkpoint(
                    fs, fs_path,
                    self.exp_dir / STAGED_CHECKPOINTS / r.trial_id, with_weights=True))

    def stage_best_checkpoints(self, records, with_model: set[str]) -> dict[str, str]:
        """For a URI storage: local copies of each trial's best checkpoint (metrics, config,
        validation predictions; the model state only for the trials in ``with_model``),
        under ``STAGED_CHECKPOINTS``; each record then names its local copy.  Returns
        ``{trial_id: the checkpoint's URI}`` (where users find it)."""
        stored: dict[str, str] = {}
        if not self.storage_uri:
            return stored
        fs, _ = filesystem(self.storage_uri)
        for r in records:
            if r.best_checkpoint:
                stored[r.trial_id] = uri_of(self.storage_uri, r.best_checkpoint)
                r.best_checkpoint = str(download_checkpoint(
                    fs, r.best_checkpoint,
                    self.exp_dir / STAGED_CHECKPOINTS / r.trial_id,
                    with_weights=r.trial_id in with_model))
        return stored

"""Search spaces: YAML files of TrainConfig keys and distributions, validated up front.

A space file (``search_spaces/NAME.yaml``)::

    description: one line shown by --list-spaces
    params:
      lr:          {loguniform: [1.0e-5, 2.0e-4]}   # log-uniform float in [low, high]
      dropout:     {uniform: [0.05, 0.4]}           # uniform float in [low, high]
      smart_lambda_sst: {quniform: [1.0, 5.0, 1.0]} # uniform on low, low + step, ..., high
      smart_steps: {randint: [1, 3]}                # integer in [low, high], both included
      batch_size:  {choice: [8, 16, 32]}            # one of the listed values
      pcgrad:      true                             # fixed value (or {fixed: true})

Every key must be a :class:`~mtbert.core.config.TrainConfig` field that a trial may change:
the data-shaping fields (model, data folder, max length, slices, validation split,
cache) are fixed per search because the driver tokenises the data once and shares
it through Ray's object store, and the run-length fields belong to ``--budget``.
Values and bounds are checked against the field's type and valid range, and each
searched value is checked together with the space's fixed values (e.g.
``pcgrad: true`` needs ``update: summed``).  Any problem is one
:class:`SpaceError` naming the file and the key, raised before anything starts.

:meth:`SearchSpace.param_space` maps to Ray Tune domains (``tune.choice``,
``tune.uniform``, ``tune.quniform``, ``tune.loguniform``, ``tune.randint``; Ray's
OptunaSearch turns them
into Optuna distributions); :meth:`SearchSpace.optuna_distributions` gives the same
space as Optuna distributions directly (for the importance report).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


from mtbert.core.config import (DATA_PER_SEARCH, RUN_PER_SEARCH, TrainConfig, check_value,
                           coerce_value, field_kind, field_range, read_yaml_file)
from mtbert.core.errors import ConfigError

DISTRIBUTIONS = ("choice", "uniform", "quniform", "loguniform", "randint", "fixed")
SPACE_KEYS = ("description", "params")

_FORMAT_HINT = ("expected a fixed value or one of {choice: [a, b, ...]}, {uniform: [low, high]}, "
                "{quniform: [low, high, step]}, {loguniform: [low, high]}, {randint: [low, high]}, {fixed: value}")


class SpaceError(ConfigError):
    """A bad search-space file; the message names the file and the key."""


def default_spaces_dir() -> Path:
    """The named spaces: ``mtbert/search_spaces/`` of the installed package (in a checkout,
    a link to the top-level ``search_spaces/``; in a wheel, its package data), wherever the
    command runs."""
    package = Path(__file__).resolve().parents[2]  # mtbert/tune/search/spaces.py -> mtbert/
    return package / "search_spaces"


@dataclass(frozen=True)
class Param:
    """One key of a space: a fixed value or a distribution."""
    key: str
    dist: str                       # choice | uniform | quniform | loguniform | randint | fixed
    value: Any = None               # fixed
    choices: tuple = ()             # choice
    low: float | int | None = None  # the ranges (inclusive)
    high: float | int | None = None
    step: float | None = None       # quniform: values low + k * step, up to high

    @property
    def searched(self) -> bool:
        return self.dist != "fixed"

    def describe(self) -> str:
        if self.dist == "fixed":
            return f"{self.value!r}"
        if self.dist == "choice":
            return "choice " + ", ".join(map(repr, self.choices))
        step = f", step {self.step:g}" if self.step else ""
        return f"{self.dist} [{self.low:g}, {self.high:g}{step}]"

    def rejects(self, value: Any, on_grid: bool = True) -> str | None:
        """Why ``value`` is no value of this key (None: it is one): not of the field's type
        or valid range, not the fixed value, not one of the choices, outside the range,
        or (``on_grid``) off a ``quniform`` step -- Optuna refuses such a value."""
        shown = f"{self.key}={value!r}"
        try:
            check_value(TrainConfig.field_spec(self.key), value)
        except ConfigError as exc:
            return f"{exc} (the space: {self.describe()})"
        if self.dist == "fixed":
            return None if value == self.value else f"{shown}: the space fixes it at {self.value!r}"
        if self.dist == "choice":
            return None if value in self.choices else (
                f"{shown} is not one of the space's choices "
                f"({', '.join(map(repr, self.choices))})")
        if not self.low <= value <= self.high:
            return f"{shown} is outside the space's {self.describe()}"
        if on_grid and self.step:
            k = (value - self.low) / self.step
            if abs(k - round(k)) > 1e-8:
                return f"{shown} is not on the space's {self.describe()}"
        return None

    def to_tune(self):
        """The Ray Tune domain (or the constant)."""
        from ray import tune
        if self.dist == "fixed":
            return self.value
        if self.dist == "choice":
            return tune.choice(list(self.choices))
        if self.dist == "uniform":
            return tune.uniform(self.low, self.high)
        if self.dist == "quniform":
            # Ray rounds a uniform draw to the nearest multiple of step (OptunaSearch maps
            # it to a FloatDistribution with that step); low is one, as the parser checks
            return tune.quniform(self.low, self.high, self.step)
        if self.dist == "loguniform":
            return tune.loguniform(self.low, self.high)
        return tune.randint(self.low, self.high + 1)  # Ray's upper bound is exclusive

    def to_optuna(self):
        """The Optuna distribution (None for a fixed value)."""
        from optuna.distributions import (CategoricalDistribution, FloatDistribution,
                                          IntDistribution)
        if self.dist == "fixed":
            return None
        if self.dist == "choice":
            return CategoricalDistribution(list(self.choices))
        if self.dist == "randint":
            return IntDistribution(int(self.low), int(self.high))
        return FloatDistribution(float(self.low), float(self.high), log=self.dist == "loguniform",
                                 step=self.step)


@dataclass(frozen=True)
class SearchSpace:
    name: str
    path: str
    description: str
    params: dict[str, Param] = field(default_factory=dict)

    @property
    def searched(self) -> dict[str, Param]:
        return {k: p for k, p in self.params.items() if p.searched}

    @property
    def fixed(self) -> dict[str, Any]:
        return {k: p.value for k, p in self.params.items() if not p.searched}

    def param_space(self) -> dict[str, Any]:
        """Ray Tune ``param_space``: domains for searched keys, constants for fixed ones."""
        return {k: p.to_tune() for k, p in self.params.items()}

    def optuna_distributions(self) -> dict[str, Any]:
        return {k: p.to_optuna() for k, p in self.searched.items()}

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, p in self.params.items():
            if p.dist == "fixed":
                out[k] = p.value
            elif p.dist == "choice":
                out[k] = {"choice": list(p.choices)}
            elif p.dist == "quniform":
                out[k] = {"quniform": [p.low, p.high, p.step]}
            else:
                out[k] = {p.dist: [p.low, p.high]}
        return {"description": self.description, "params": out}


# ---------------------------------------------------------------------- loading
def resolve_space_path(name: str, spaces_dir: str | Path | None = None) -> Path:
    """``--space`` value -> file: a path (has a '/' or ends in .yaml/.yml) or a name."""
    if "/" in name or name.endswith((".yaml", ".yml")):
        path = Path(name).expanduser()
        if not path.is_file():
            raise SpaceError(f"--space {name}: no such file")
        return path
    folder = Path(spaces_dir) if spaces_dir else default_spaces_dir()
    path = folder / f"{name}.yaml"
    if not path.is_file():
        known = ", ".join(available_spaces(folder)) or "none"
        raise SpaceError(f"--space {name}: unknown search space (no {path}); known spaces: {known}")
    return path


def available_spaces(spaces_dir: str | Path | None = None) -> list[str]:
    folder = Path(spaces_dir) if spaces_dir else default_spaces_dir()
    return sorted(p.stem for p in folder.glob("*.yaml")) if folder.is_dir() else []


def load_space(name_or_path: str, spaces_dir: str | Path | None = None) -> SearchSpace:
    """Load and validate one space; raises :class:`SpaceError` naming the file and key."""
    path = resolve_space_path(name_or_path, spaces_dir)
    return parse_space(read_yaml_file(path, "search space", SpaceError), path)


def parse_space(doc: Any, path: str | Path) -> SearchSpace:
    path = Path(path)
    if not isinstance(doc, dict):
        raise SpaceError(f"{path}: expected a mapping with keys 'description' and 'params', "
                         f"got {type(doc).__name__}")
    unknown = [k for k in doc if k not in SPACE_KEYS]
    if unknown:
        raise SpaceError(f"{path}: {unknown[0]}: unknown top-level key (expected "
                         f"'description' and 'params'; trainer keys go under 'params')")
    description = doc.get("description")
    if not isinstance(description, str) or not description.strip():
        raise SpaceError(f"{path}: description: expected a one-line text")
    raw_params = doc.get("params")
    if not isinstance(raw_params, dict) or not raw_params:
        raise SpaceError(f"{path}: params: expected a non-empty mapping of trainer config keys")
    params = {}
    for key, spec in raw_params.items():
        params[str(key)] = _parse_param(path, str(key), spec)
    space = SearchSpace(path.stem, str(path), description.strip().splitlines()[0], params)
    _check_combinations(path, space)
    return space


def _parse_param(path: Path, key: str, spec: Any) -> Param:
    where = f"{path}: {key}"
    if key not in TrainConfig.field_names():
        raise SpaceError(f"{where}: unknown trainer config key (see mtbert/core/config.py)", key=key)
    if key in DATA_PER_SEARCH:
        raise SpaceError(f"{where}: cannot be searched: it shapes the tokenised data, which is "
                         f"fixed per search (set it with {DATA_PER_SEARCH[key]})", key=key)
    if key in RUN_PER_SEARCH:
        raise SpaceError(f"{where}: cannot be searched: it is set by {RUN_PER_SEARCH[key]}",
                         key=key)
    if not isinstance(spec, dict):
        if isinstance(spec, list):
            raise SpaceError(f"{where}: a bare list is ambiguous; {_FORMAT_HINT}", key=key)
        return Param(key, "fixed", value=_value(where, key, spec))
    if len(spec) != 1 or next(iter(spec)) not in DISTRIBUTIONS:
        raise SpaceError(f"{where}: invalid distribution {spec!r}; {_FORMAT_HINT}", key=key)
    dist, arg = next(iter(spec.items()))
    kind = field_kind(key)
    if dist == "fixed":
        return Param(key, "fixed", value=_value(where, key, arg))
    if dist == "choice":
        if not isinstance(arg, list) or not arg:
            raise SpaceError(f"{where}: choice needs a non-empty list of values", key=key)
        values = tuple(_value(where, key, v) for v in arg)
        if len(set(values)) != len(values):
            raise SpaceError(f"{where}: choice lists a value twice: {list(arg)}", key=key)
        return Param(key, "choice", choices=values)
    # numeric ranges
    step = None
    if dist == "quniform":
        if not isinstance(arg, list) or len(arg) != 3:
            raise SpaceError(f"{where}: quniform needs [low, high, step], got {arg!r}", key=key)
        *arg, step = arg
        step = _number(where, dist, step, integer=False)
    if not isinstance(arg, list) or len(arg) != 2:
        raise SpaceError(f"{where}: {dist} needs [low, high], got {arg!r}", key=key)
    if dist in ("uniform", "quniform", "loguniform") and kind != "float":
        raise SpaceError(f"{where}: {dist} needs a float field, {key} is {_kind_name(key)}"
                         + (" (use randint or choice)" if kind == "int" else " (use choice)"),
                         key=key)
    if dist == "randint" and kind != "int":
        raise SpaceError(f"{where}: randint needs an integer field, {key} is {_kind_name(key)}",
                         key=key)
    low, high = (_number(where, dist, b, integer=dist == "randint") for b in arg)
    if dist == "randint" and low > high:
        raise SpaceError(f"{where}: randint needs low <= high, got [{low}, {high}]", key=key)
    if dist != "randint" and not low < high:
        raise SpaceError(f"{where}: {dist} needs low < high, got [{low:g}, {high:g}]", key=key)
    if dist == "loguniform" and low <= 0:
        raise SpaceError(f"{where}: loguniform needs low > 0, got {low:g}", key=key)
    if step is not None:
        if step <= 0 or step > high - low:
            raise SpaceError(f"{where}: quniform step must be > 0 and at most high - low, "
                             f"got step {step:g} for [{low:g}, {high:g}]", key=key)
        # Ray rounds draws to multiples of step and Optuna counts from low: both agree
        # only when low and high are whole steps (a 1e-9 tolerance for decimal floats)
        whole = lambda x: abs(x - round(x)) < 1e-9 * max(1.0, abs(x))  # noqa: E731
        if not (whole((high - low) / step) and whole(low / step)):
            raise SpaceError(f"{where}: quniform needs low and high to be multiples of step, "
                             f"got [{low:g}, {high:g}] with step {step:g}", key=key)
    f_low, f_high, low_open = field_range(key)
    if f_low is not None and (low < f_low or (low_open and low == f_low)):
        rel = ">" if low_open else ">="
        raise SpaceError(f"{where}: {dist} bound {low:g} is outside the valid range of {key} "
                         f"(must be {rel} {f_low:g})", key=key)
    if f_high is not None and high > f_high:
        raise SpaceError(f"{where}: {dist} bound {high:g} is outside the valid range of {key} "
                         f"(must be <= {f_high:g})", key=key)
    return Param(key, dist, low=low, high=high, step=step)


def _kind_name(key: str) -> str:
    return {"choice": "a choice field", "bool": "a bool", "int": "an integer",
            "float": "a float", "str": "a text field"}[field_kind(key)]


def _number(where: str, dist: str, value: Any, integer: bool) -> float | int:
    if isinstance(value, bool):
        raise SpaceError(f"{where}: {dist} bound {value!r} is not a number")
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):
        raise SpaceError(f"{where}: {dist} bound {value!r} is not a number") from None
    if not math.isfinite(number):
        raise SpaceError(f"{where}: {dist} bound {value!r} is not finite")
    if integer:
        if not number.is_integer():
            raise SpaceError(f"{where}: {dist} bound {value!r} is not an integer")
        return int(number)
    return number


def _value(where: str, key: str, value: Any) -> Any:
    """Coerce one value to the field's type and check its valid range."""
    if isinstance(value, (dict, list)) or value is None:
        raise SpaceError(f"{where}: {value!r} is not a single value; {_FORMAT_HINT}", key=key)
    try:
        coerced = coerce_value(key, value, source=where)
        check_value(TrainConfig.field_spec(key), coerced)
    except ConfigError as exc:
        msg = str(exc)
        if not msg.startswith(where):
            msg = f"{where}: {msg}"
        raise SpaceError(msg, key=key) from None
    return coerced


def _check_combinations(path: Path, space: SearchSpace) -> None:
    """The fixed values form a valid config, and so does each searched value with them."""
    fixed = space.fixed
    try:
        TrainConfig.from_dict(fixed, source=str(path))
    except ConfigError as exc:
        raise SpaceError(f"{path}: {exc.key or 'params'}: the fixed values are invalid together: "
                         f"{exc}", key=exc.key) from None
    for key, p in space.searched.items():
        probes = p.choices if p.dist == "choice" else (p.low, p.high)
        for value in probes:
            try:
                TrainConfig.from_dict({**fixed, key: value}, source=str(path))
            except ConfigError as exc:
                raise SpaceError(
                    f"{path}: {key}: value {value!r} is invalid with the space's fixed values "
                    f"and the defaults: {exc} (fix the other key in the space)", key=key) from None


def list_spaces(spaces_dir: str | Path | None = None) -> list[tuple[str, str]]:
    """(name, description) of every space; an invalid file shows its error instead."""
    out = []
    folder = Path(spaces_dir) if spaces_dir else default_spaces_dir()
    for name in available_spaces(folder):
        try:
            space = load_space(name, folder)
            searched = ", ".join(space.searched)
            out.append((name, f"{space.description} [searches: {searched}]"))
        except SpaceError as exc:
            out.append((name, f"INVALID: {exc}"))
    return out


# ---------------------------------------------------------------------- given points
def read_points(path: str | Path, space: SearchSpace) -> tuple[dict[str, Any], ...]:
    """``--points FILE.json``: a JSON list of configurations the searcher proposes first,
    in order, each ``{key: value}`` for every key ``space`` searches and no other, each
    value one of the key's distribution (on a ``quniform`` step, as Optuna demands).
    ConfigError naming the file, the point (1-based) and the key."""
    import json

    where = f"--points {path}"
    try:
        text = Path(path).expanduser().read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{where}: cannot read it ({exc.strerror or exc})") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{where}: line {exc.lineno}: not JSON ({exc.msg})") from None
    if not isinstance(doc, list) or not doc or not all(isinstance(p, dict) for p in doc):
        raise ConfigError(f"{where}: expected a non-empty JSON list of objects "
                          "({key: value, ...}, one per trial)")
    searched = space.searched
    for i, point in enumerate(doc, 1):
        for key in searched:
            if key not in point:
                raise ConfigError(f"{where}: point {i}: no value of {key}, which the space "
                                  f"searches ({searched[key].describe()})", key=key)
        for key, value in point.items():
            if key not in searched:
                raise ConfigError(f"{where}: point {i}: {key}: not a key the space "
                                  f"{space.name} searches ({', '.join(searched)})", key=key)
            problem = searched[key].rejects(value)
            if problem:
                raise ConfigError(f"{where}: point {i}: {problem}", key=key)
    return tuple(dict(p) for p in doc)

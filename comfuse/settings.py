"""User settings, read from ``COMFUSE_*`` environment variables.

A dozen settings, grouped by concern: what happens on failure, the cache, logging,
autotuning, the graph limits, the planner. Each field below is one setting; the README's
settings table lists them. Code-generation variants are not settings: they are fields of a
plan's form (``planner.forms``), chosen by autotuning. ``COMFUSE_PLAN`` is the one developer
override of those fields (``docs/design.md``).

``get()`` returns the settings now (environment, then ``override``). Every setting that
changes generated code or the choice among plans (``KEYED``) is part of the autotuning
decision's cache key.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
from pathlib import Path
from typing import Iterator


@dataclasses.dataclass(frozen=True, slots=True)
class Settings:
    # -- failures --
    strict: bool  # COMFUSE_STRICT=1: a failure inside compilation raises instead of running unfused
    disable: bool  # COMFUSE_DISABLE=1: find and report regions, run everything unfused
    check: bool  # COMFUSE_CHECK=1: compare every launch with the float64 reference interpreter
    validate: str  # COMFUSE_VALIDATE: compare a region's first call with its own ops (auto, 1, 0)
    # -- cache --
    cache_dir: Path  # COMFUSE_CACHE_DIR: generated kernel sources and autotuning decisions
    # -- logging --
    log: str  # COMFUSE_LOG: info (progress of long work) or debug (every candidate's time)
    # -- autotuning --
    autotune: str  # COMFUSE_AUTOTUNE: time the candidate plans against the unfused ops (auto, 1, 0)
    tune_timing: str  # COMFUSE_TUNE_TIMING: time candidates by launches or by CUDA-graph replays
    graph_check: str  # COMFUSE_GRAPH_CHECK: time a fused graph against Inductor's (auto, 1, 0)
    # -- graph limits --
    fuel: int  # COMFUSE_FUEL: fuse at most this many regions per graph (-1: no cap)
    max_specializations: int  # COMFUSE_MAX_SPECIALIZATIONS: graphs per compiled function's frame, shapes per dynamic graph
    # -- planner --
    schedule: str  # COMFUSE_SCHEDULE: force one schedule; empty: the planner and autotuning choose
    # -- developer override (docs/design.md, not a user setting) --
    plan: str  # COMFUSE_PLAN: "field=value,...": the forced form of every plan (no autotuning among forms)


# the settings that change the candidates, their code or how they are timed: part of the
# autotuning decision's key (runtime/tuning.py)
KEYED = ("schedule", "plan", "tune_timing")
SCHEDULES = ("tile", "row_in_cta", "cooperative", "split", "ws_strip", "ws_split", "ws_stages")
_CHOICES = {"validate": ("auto", "1", "0"), "autotune": ("auto", "1", "0"), "graph_check": ("auto", "1", "0"),
            "tune_timing": ("launch", "graph"), "log": ("", "info", "debug"), "schedule": ("",) + SCHEDULES}
_ON, _OFF = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _flag(name: str, raw: str | None, default: bool) -> bool:
    if raw is None or raw.strip() == "":
        return default
    value = raw.strip().lower()
    if value not in _ON + _OFF:
        raise ValueError(f"{name}={raw!r}: expected 1 or 0")
    return value in _ON


def _int(name: str, raw, default: int) -> int:
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except (TypeError, ValueError):
        raise ValueError(f"{name}={raw!r} is not an integer") from None


def _choice(field: str, name: str, raw: str | None, default: str) -> str:
    value = default if raw is None else raw.strip().lower()
    if value in _ON and "1" in _CHOICES[field]:
        value = "1"
    elif value in _OFF and "0" in _CHOICES[field]:
        value = "0"
    if value not in _CHOICES[field]:
        raise ValueError(f"{name}={raw!r}: choose {', '.join(repr(c) for c in _CHOICES[field] if c)}")
    return value


def _read(env) -> Settings:
    home = Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return Settings(
        strict=_flag("COMFUSE_STRICT", env.get("COMFUSE_STRICT"), False),
        disable=_flag("COMFUSE_DISABLE", env.get("COMFUSE_DISABLE"), False),
        check=_flag("COMFUSE_CHECK", env.get("COMFUSE_CHECK"), False),
        validate=_choice("validate", "COMFUSE_VALIDATE", env.get("COMFUSE_VALIDATE"), "auto"),
        cache_dir=Path(env.get("COMFUSE_CACHE_DIR") or home / "comfuse"),
        log=_choice("log", "COMFUSE_LOG", env.get("COMFUSE_LOG"), ""),
        autotune=_choice("autotune", "COMFUSE_AUTOTUNE", env.get("COMFUSE_AUTOTUNE"), "auto"),
        tune_timing=_choice("tune_timing", "COMFUSE_TUNE_TIMING", env.get("COMFUSE_TUNE_TIMING"), "launch"),
        graph_check=_choice("graph_check", "COMFUSE_GRAPH_CHECK", env.get("COMFUSE_GRAPH_CHECK"), "auto"),
        fuel=_int("COMFUSE_FUEL", env.get("COMFUSE_FUEL"), -1),
        max_specializations=_int("COMFUSE_MAX_SPECIALIZATIONS", env.get("COMFUSE_MAX_SPECIALIZATIONS"), 64),
        schedule=_choice("schedule", "COMFUSE_SCHEDULE", env.get("COMFUSE_SCHEDULE"), ""),
        plan=(env.get("COMFUSE_PLAN") or "").strip(),
    )


FIELDS = tuple(f.name for f in dataclasses.fields(Settings))
_ENV = ("XDG_CACHE_HOME",) + tuple(f"COMFUSE_{name.upper()}" for name in FIELDS)
_ENV_BYTES = tuple(os.fsencode(name) for name in _ENV)
_overrides: dict[str, object] = {}
_memo: dict[tuple, Settings] = {}


def _environment() -> tuple:
    """The variables' values now, as a key: on POSIX the raw bytes of ``os.environ``'s own
    mapping (``get()`` 1.5 us, against 12.8 us through ``os.environ.get``, which decodes each:
    bench/results/2026-12-05-cpu-region-call/; a fused region's call reads the settings)."""
    raw = getattr(os.environ, "_data", None)
    if os.name == "posix" and isinstance(raw, dict):
        return tuple(map(raw.get, _ENV_BYTES))
    return tuple(os.environ.get(name) for name in _ENV)


def get(pinned: tuple = ()) -> Settings:
    """The settings now: environment variables, then ``pinned`` (``overrides_now()`` of the
    moment a region module was made: the backend's options hold for its calls), then
    ``override``. Read on every fused call, so the result is remembered per (environment,
    pinned, overrides) snapshot."""
    env = _environment()
    key = (env, tuple(sorted((k, repr(v)) for k, v in _overrides.items())) if _overrides else (), pinned)
    found = _memo.get(key)
    if found is None:
        if len(_memo) > 256:
            _memo.clear()
        found = _read({name: os.fsdecode(v) if isinstance(v, bytes) else v for name, v in zip(_ENV, env)})
        values = {**dict(pinned), **_overrides}
        found = dataclasses.replace(found, **values) if values else found
        _memo[key] = found
    return found


def overrides_now() -> tuple:
    """The overrides in force now, as ``get`` and ``beneath`` take them: a region module made
    inside a compilation keeps them for its later calls (runtime/fused.py), so that the
    options a compilation was given (the backend's ``options``) hold at the calls too."""
    return tuple(sorted(_overrides.items(), key=lambda kv: kv[0]))


def beneath(pinned: tuple):
    """``pinned`` (an ``overrides_now()``) in force for a block, beneath the overrides set now
    (an ``override`` of the names not overridden now)."""
    return override(**{k: v for k, v in pinned if k not in _overrides})


def chosen(name: str) -> bool:
    """Whether the user named setting ``name``, in its COMFUSE_* variable or an ``override``
    (a default that depends on the context, such as graph timing under CUDA graphs, yields)."""
    return name in _overrides or f"COMFUSE_{name.upper()}" in os.environ


def coerce(name: str, value):
    """``value`` (an option's, e.g. the torch.compile backend's) as setting ``name`` takes it,
    read as its COMFUSE_* variable's text would be."""
    if name not in FIELDS:
        raise TypeError(f"unknown comfuse setting {name!r}; settings are {', '.join(FIELDS)}")
    text = ("1" if value else "0") if isinstance(value, bool) else str(value)
    return getattr(_read({f"COMFUSE_{name.upper()}": text}), name)


@contextlib.contextmanager
def override(**values: object) -> Iterator[Settings]:
    """Set settings for a block of code: ``with override(strict=True): ...``; restored after."""
    unknown = set(values) - set(FIELDS)
    if unknown:
        raise TypeError(f"unknown comfuse settings: {sorted(unknown)}")
    if isinstance(values.get("cache_dir"), str):  # (a path as text, as COMFUSE_CACHE_DIR gives it)
        values["cache_dir"] = Path(values["cache_dir"])
    for name in set(values) & set(_CHOICES):  # (checked as the variable's text would be)
        values[name] = _choice(name, f"COMFUSE_{name.upper()}", str(values[name]), "")
    saved = dict(_overrides)
    _overrides.update(values)
    try:
        yield get()
    finally:
        _overrides.clear()
        _overrides.update(saved)

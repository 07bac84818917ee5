"""Engine flags shared by `strata engine`, `strata generate`, `strata bench offline|overhead`, and
passed through by `strata up`: one flag per `EngineConfig` field, built from the field (its type,
default and help), named like `vllm serve`'s flags where the meaning is the same."""

import argparse
import types
import typing
from dataclasses import MISSING, Field, fields, replace

from services.engine.config import EngineConfig


def flag_name(config_field: Field) -> str:
    return "--" + config_field.name.replace("_", "-")


def _value_type(config_field: Field) -> type:
    """``int`` for ``int | None``, the annotation itself otherwise."""
    annotation = config_field.type
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return next(arg for arg in typing.get_args(annotation) if arg is not type(None))
    return annotation


def _argparse_kwargs(config_field: Field) -> dict:
    kwargs = dict(config_field.metadata)
    if "action" not in kwargs:
        kwargs.setdefault("type", _value_type(config_field))  # a field may name its own (human_readable_int)
    return kwargs


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Every `EngineConfig` field as a flag with the field's default (``--model``: None, the built-in model)."""
    for config_field in fields(EngineConfig):
        default = None if config_field.default is MISSING else config_field.default
        parser.add_argument(flag_name(config_field), default=default, **_argparse_kwargs(config_field))


def add_engine_passthrough_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup, names: list[str]) -> None:
    """The engine flags ``names`` (field names) for a command that passes them on to its engines only when
    given (`strata up`): each flag's default is None (not given: the engine's own default, which its help
    states)."""
    by_name = {config_field.name: config_field for config_field in fields(EngineConfig)}
    for name in names:
        config_field = by_name[name]
        kwargs = _argparse_kwargs(config_field)
        kwargs["help"] = kwargs["help"].replace("%(default)s", str(config_field.default))
        kwargs.pop("choices", None)  # the engine checks the value
        parser.add_argument(flag_name(config_field), default=None, **kwargs)


def model_dir_from_args(args: argparse.Namespace) -> str:
    """--model, or the built-in default model (built on first use)."""
    if args.model:
        return args.model
    from services.default_model.model import ensure_default_model

    return str(ensure_default_model())


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    """Raises SystemExit with the config's own message for an invalid combination of flags."""
    values = {config_field.name: getattr(args, config_field.name) for config_field in fields(EngineConfig)}
    try:
        return EngineConfig(**{**values, "model": model_dir_from_args(args)})
    except ValueError as exc:
        raise SystemExit(f"strata: {exc}")


def with_local_model(config: EngineConfig) -> EngineConfig:
    """``config`` with its model a local directory: a Hugging Face Hub id becomes its snapshot in the
    cache, fetched there first where it is not (`model_source`); SystemExit saying what to do otherwise."""
    from services.common.model_source import resolve_model_dir

    try:
        return replace(config, model=resolve_model_dir(config.model))
    except ValueError as error:
        raise SystemExit(f"strata: {error}") from None

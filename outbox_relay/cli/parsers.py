"""Building the command's parsers: the options several commands share (a relay setting, --dsn, the log
options, a key's arguments) and the help format (every default shown, action lists as written)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from pydantic.fields import FieldInfo

from ..settings import bounds, default_text, env_var
from ..settings_base import environment_only
from .values import log_level, partition_key


def add_setting_option(parser: argparse.ArgumentParser, name: str, field: FieldInfo) -> None:
    option = "--" + name.replace("_", "-")
    allowed = bounds(field)
    default = default_text(name, field)
    help_text = (f"{field.description or name}" + (f" ({allowed})" if allowed else "")
                 + (" (required)" if default == "required" else f" (default {default})") + f" [env {env_var(name)}]")
    if environment_only(field):
        return  # the environment or its *_file setting only: a command line shows in `ps`
    if field.annotation is bool:
        parser.add_argument(option, dest=name, action=argparse.BooleanOptionalAction, default=None, help=help_text)
    elif name == "projection":
        parser.add_argument(option, dest=name, action="append", metavar="NAME", default=None, help=help_text)
    elif name == "sink":
        parser.add_argument(option, dest=name, action="append", metavar="MODULE:ATTR", default=None, help=help_text)
    elif name == "kafka_config":
        parser.add_argument("--kafka-option", dest=name, action="append", metavar="KEY=VALUE", default=None,
                            help="librdkafka setting, repeatable (TLS/SASL pass through); KEY=@PATH reads the value "
                                 f"from a file, so secrets stay out of `ps` (default none) [env {env_var(name)} as "
                                 "JSON]")
    else:
        parser.add_argument(option, dest=name, default=None, help=help_text)


def add_dsn_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dsn", default=None, help=f"PostgreSQL connection string (required) [env {env_var('dsn')}]")


def add_global_options(parser: argparse.ArgumentParser, default: Callable[[Any], Any]) -> None:
    parser.add_argument("--log-level", type=log_level, default=default("info"),
                        help="debug, info, warning, error (debug also prints the traceback of an unexpected error; "
                             "default info)")
    parser.add_argument("--log-json", action="store_true", default=default(False),
                        help="one JSON object per log line")


def add_key_arguments(parser: argparse.ArgumentParser, sink_required: bool = True) -> None:
    add_dsn_option(parser)
    parser.add_argument("key", type=partition_key, metavar="KEY", help="the partition key")
    parser.add_argument("--sink", required=sink_required, default=None,
                        help="the sink (kafka, a projection's name)" + ("" if sink_required else "; default: all"))
    parser.add_argument("--json", action="store_true", help="machine-readable output")


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions as written (the action lists), and every option's default unless it has none."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (default is None or default is False or default is argparse.SUPPRESS or "default" in text
                or not action.option_strings):
            return text
        return f"{text} (default {default})"


def describe_actions(summary: str, actions: dict[str, str]) -> str:
    """A command's description with one line per action (argparse gives choices no help of their own)."""
    width = max(len(a) for a in actions) + 2
    return summary + "\n\nactions:\n" + "\n".join(f"  {a.ljust(width)}{h}" for a, h in actions.items())


def subcommand_class(common: argparse.ArgumentParser) -> type[argparse.ArgumentParser]:
    class Subcommand(argparse.ArgumentParser):
        def __init__(self, **kwargs: Any) -> None:
            kwargs.setdefault("formatter_class", HelpFormatter)
            super().__init__(parents=[common], **kwargs)

    return Subcommand

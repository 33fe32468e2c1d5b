"""What every `ffr` command's help shares: defaults shown, and old option spellings that still work.

One name per concept across commands (the user-facing issue's rule): when a flag is renamed, the
old spelling stays as a hidden deprecated alias that does what the new one does after printing one
line, so scripts keep working while `--help` shows a single spelling. `tests/test_cli_contract.py`
walks every command's help and checks the rule.
"""
from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's defaults formatter, minus the noise: no "(default: None/False)" and nothing added to a help
    text that already states its default in words."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text.lower() or action.default in (None, False, argparse.SUPPRESS) or action.nargs == 0:
            return text
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """`ffr`'s parser: every sub-parser inherits the class (argparse's `parser_class`), hence the formatter."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        """A mistyped option is one line, as every other error (argparse would print the whole usage first, 40
        lines for `ffr coordinator serve`); --help is named for the rest."""
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class _DeprecatedAlias(argparse.Action):
    """Does what the new spelling's action does, after one line on stderr naming the new spelling."""

    def __init__(self, option_strings, dest, target: argparse.Action, note: str = "", **kwargs):
        self.target, self.note = target, note
        super().__init__(option_strings, dest, **kwargs)
        self.flag = self.nargs == 0

    def __call__(self, parser, namespace, values, option_string=None):
        new = self.target.option_strings[0] + (f" {self.const}" if self.flag and self.target.nargs != 0 else "")
        print(f"{parser.prog}: warning: {option_string} is an old spelling of {new}{self.note}; it still works",
              file=sys.stderr)
        setattr(namespace, self.dest, self.const if self.flag else values)


_VALUE = object()


def deprecated_alias(parser, old: str, target: argparse.Action, note: str = "", const=_VALUE) -> None:
    """Keep `old` working as `target`'s option, hidden from --help (one spelling per concept in the help).

    A flag alias stores `const` (by default the target flag's own constant); `--no-pretrained` stores "none"
    into `--init`'s destination."""
    flag = target.nargs == 0 or const is not _VALUE
    const = target.const if const is _VALUE else const
    parser.add_argument(old, dest=target.dest, action=_DeprecatedAlias, target=target, note=note, const=const,
                        nargs=0 if flag else target.nargs, type=None if flag else target.type,
                        choices=None if flag else target.choices, metavar=None if flag else target.metavar,
                        default=argparse.SUPPRESS, help=argparse.SUPPRESS)


HOLDOUT_IDENTITIES = 0.2  # fraction of identities kept out of training for evaluation, in `ffr train` and `ffr fleet`
GATE_IDENTITIES = 0.3  # `ffr fleet`: share of those people (on no device) the coordinator keeps for its gate
PUBLIC_IDENTITIES = 0.2  # `ffr fleet`: share of those people whose faces devices are served (without --public-data)
SELECT_IDENTITIES = 0.2  # fraction of `ffr train`'s training identities kept out to choose how far fine-tuning moves
DETECTOR_CHOICES = ("auto", "yunet", "haar", "none")


def one_line(exc: Exception, flags: dict[str, str] | None = None) -> str:
    """An error as one line; a settings schema's refusal names the option (`--lr`) instead of a pydantic dump,
    spelled as `flags` says where a field's flag is not its name (`epochs` is `--local-epochs` for rounds)."""
    errors = getattr(exc, "errors", None)
    if callable(errors) and type(exc).__name__ == "ValidationError":
        first = errors()[0]
        more = f" (and {len(errors()) - 1} more)" if len(errors()) > 1 else ""
        if first.get("type") == "value_error":  # a check of ours: its message already names the option
            return _respelt(str(first["ctx"]["error"]), flags) + more
        field = str(first["loc"][-1]) if first.get("loc") else "value"
        flag = (flags or {}).get(field, f"--{field.replace('_', '-')}")
        return f"{flag}: {first['msg'].lower()}, got {first.get('input')!r}{more}"
    return _respelt(str(exc), flags)


def _respelt(message: str, flags: dict[str, str] | None) -> str:
    """One line; a check's message that opens with an option named by its field (`--epochs ...`) names it as the
    command spells it."""
    message = " ".join(message.split())
    for field, flag in (flags or {}).items():
        message = re.sub(rf"^--{field.replace('_', '-')}\b(?!-)", flag, message)
    return message


def at_least(lowest: int):
    """An argparse type: a whole number no smaller than `lowest` (threads, frames, crops), refused at parse time in
    argparse's one line instead of failing later inside torch or ONNX Runtime."""
    def whole(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < lowest:
            raise argparse.ArgumentTypeError(f"must be at least {lowest} (got {value})")
        return value
    return whole


def fraction(text: str) -> float:
    """An argparse type: a fraction in [0, 1) (of people, of images), refused at parse time; nan too."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 <= value < 1:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be a fraction in [0, 1), not {text}")
    return value


def port(text: str, lowest: int = 0) -> int:
    """An argparse type: a TCP port, `lowest` (0: any free one) to 65535, refused at parse time before anything
    starts (`functools.partial(port, lowest=1)` where 0 means something else)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not lowest <= value <= 65535:
        any_free = "; 0: any free port" if lowest == 0 else ""
        raise argparse.ArgumentTypeError(f"{value} is not a port ({lowest}-65535{any_free})")
    return value


def add_detector_option(group) -> None:
    """--detector, with the same choices and meaning in every command that finds faces."""
    group.add_argument("--detector", choices=DETECTOR_CHOICES, default="auto",
                       help="face detector: auto (YuNet with five-point alignment onto the ArcFace template, Haar "
                            "where YuNet is missing or finds nothing; none for SYNTHETIC data), yunet, haar, none "
                            "(the images are already aligned face crops)")


def add_init_option(p, what: str) -> None:
    """--init (and its old flag --no-pretrained), the same in every command that starts a model."""
    init = p.add_argument("--init", choices=("face", "imagenet", "none"), default="face",
                          help=f"{what}: face (the shipped face-pretrained embedder, default), imagenet "
                               "(ImageNet MobileNetV2), none (random)")
    deprecated_alias(p, "--no-pretrained", init, const="none")


@dataclass(frozen=True)
class Owned:
    """An option that means something only while its owner is on: a method's, a technique's or a rule's own setting.

    Given while its owner is off it would be ignored, so the command refuses it in one line instead (issue 28: each
    choice takes only its own settings). Such options default to None, which leaves the spec's own default."""

    needs: str                   # the owner, as the user turns it on: "--method fedprox"
    on: Callable[[Any], bool]    # whether the part the command built has the owner on
    argv: tuple[str, ...] | None = None  # options that turn the owner on (None: `needs` split), for tests
    fix: str = ""                # how to turn the owner on, where it is not "use NEEDS"

    def turn_on(self) -> list[str]:
        return self.needs.split() if self.argv is None else list(self.argv)


def dest(flag: str) -> str:
    """argparse's destination for a long option."""
    return flag.removeprefix("--").replace("-", "_")


def _given(args, flag: str) -> bool:
    """Whether the user gave `flag`: a value (None: not given) or a switch (False: not given)."""
    value = getattr(args, dest(flag), None)
    return value is not None and value is not False


def given(args, flags, fields: dict[str, str] | None = None) -> dict:
    """{spec field: value} of those options the user gave (not given, the spec's default stands); a field is the
    option's destination unless `fields` names it otherwise ({destination: field})."""
    fields = fields or {}
    return {fields.get(dest(f), dest(f)): getattr(args, dest(f)) for f in flags if _given(args, f)}


def refuse_unowned(args, owned: dict[str, Owned], built) -> None:
    """Raise ValueError, one line, for the first option given whose owner is off in `built`."""
    for flag, owner in owned.items():
        if _given(args, flag) and not owner.on(built):
            raise ValueError(f"{flag} has no effect without {owner.needs} (drop it, or "
                             f"{owner.fix or 'use ' + owner.needs})")

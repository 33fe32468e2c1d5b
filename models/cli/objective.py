"""The federated method's and the local objective's options, shared by `ffr coordinator serve` and `ffr fleet simulate`.

`--method` and each method's options come from the methods' settings models (`protocol.methods`): an option is the
`flag` of a method's setting, its help that setting's description, and it is refused with a method that lacks it.
`--method fedfr` turns on FedFR's techniques with the paper's weights (alpha = 1, 5, 10; t_HN 0.4; tau 0.5); each
technique has its own switch, so an ablation is one flag each (`--method fedfr --no-contrastive`,
`--no-hard-negatives`, `--no-dfc`).
"""
from __future__ import annotations

import argparse

from models.cli.common import Owned, deprecated_alias, dest, given, one_line, refuse_unowned
from protocol import methods
from protocol.codecs import CODECS, TOPK_FRACTION
from protocol.messages import TrainingConfig, TransportSettings
from protocol.methods import DEFAULT_METHOD, method_named, owners_of
from protocol.training_parts import ModelSpec, OptimiserSettings

SPEC = TrainingConfig()  # the flags' defaults are the spec's


def method_flags() -> dict[str, list[str]]:
    """{option: the methods that take it}, every method's settings in the list's order."""
    flags = [flag for kind in methods.METHODS.values() for flag in kind.flags()]
    return {flag: owners_of(flag) for flag in dict.fromkeys(flags)}


def _either(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def method_owned(flag: str, owners: list[str]) -> Owned:
    """A method's own option: refused unless the round configuration's method takes it."""
    return Owned(f"--method {_either(owners)}", lambda t: flag in type(t.method).flags(),
                 argv=("--method", owners[0]))


# Each method's own settings, refused with a method that lacks them
METHOD_OWNED: dict[str, Owned] = {flag: method_owned(flag, owners) for flag, owners in method_flags().items()}
# FedFR's options that mean something only with their technique on (both are on with --method fedfr)
_TECHNIQUE = {"--t-hn": ("--hard-negatives", lambda m: m.uses_public_set()),
              "--tau": ("--contrastive", lambda m: m.uses_previous_local()),
              "--alpha-con": ("--contrastive", lambda m: m.uses_previous_local())}

# Each method's and technique's own settings: given while their owner is off, the command refuses them (a method's
# first: `--t-hn` with FedProx names --method fedfr, with FedFR's hard negatives off --hard-negatives)
OWNED: dict[str, Owned] = {
    **METHOD_OWNED,
    **{flag: Owned(switch, lambda t, on=on: on(t.method), argv=("--method", "fedfr"))
       for flag, (switch, on) in _TECHNIQUE.items()},
    "--dfc-weight": Owned("--dfc", lambda t: t.model.dfc),
    "--dfc-steps": Owned("--dfc", lambda t: t.model.dfc),
    "--dfc-lr": Owned("--dfc", lambda t: t.model.dfc),
    "--dfc-anchor": Owned("--dfc", lambda t: t.model.dfc),
    "--topk-fraction": Owned("--codec topk", lambda t: t.transport.codec == "topk"),
}


def add_method_options(group, public_flag: str, old_spelling: str) -> None:
    """--method (one choice: aggregation and local objective), each method's own options (from its settings model)
    and --server-momentum; `old_spelling` is the command's former name for the aggregation choice (--strategy or
    --algorithm), kept as a deprecated alias."""
    method = group.add_argument(
        "--method", choices=tuple(methods.METHODS), default=DEFAULT_METHOD,
        help="; ".join(f"{name}: {m.summary.format(public=public_flag)}" for name, m in methods.METHODS.items()))
    deprecated_alias(group, old_spelling, method)
    for flag, owners in method_flags().items():
        action = _add_setting(group, flag, owners)
        if flag == "--prox-mu" and old_spelling == "--strategy":  # `ffr coordinator serve --mu` meant FedProx's mu
            deprecated_alias(group, "--mu", action)
    group.add_argument("--server-momentum", type=float,
                       help="FedAvgM's server momentum (default 0.9; --method fedavgm)")


def _add_setting(group, flag: str, owners: list[str]) -> argparse.Action:
    """One method setting's option: its type, default and help from the first owner's settings model."""
    owner = method_named(owners[0])
    field = owner.model_fields[owner.flags()[flag]]
    if field.annotation in (bool, "bool"):
        state = "on" if field.default else "off"
        return group.add_argument(flag, action=argparse.BooleanOptionalAction, default=None,
                                  help=f"{field.description} (default {state}; --method {_either(owners)})")
    kind = int if field.annotation in (int, "int") else float
    return group.add_argument(flag, type=kind,
                              help=f"{field.description} (default {field.default:g}; --method {_either(owners)})")


def add_objective_options(group) -> None:
    """What the local objective adds to any method: the DFC fit after training and the head's imprinting."""
    group.add_argument("--dfc-steps", type=int, help="steps fitting the DFC branch on frozen features after local "
                                                     f"training (default {SPEC.dfc_steps})")
    group.add_argument("--dfc-lr", type=float, help=f"learning rate of that fit (default {SPEC.dfc_lr:g})")
    group.add_argument("--dfc-anchor", type=float,
                       help="what that fit pays for each unit of the DFC transform's squared distance from the "
                            f"identity it starts as: a device of few people keeps strangers apart (default "
                            f"{SPEC.dfc_anchor:g})")
    group.add_argument("--imprint-head", action=argparse.BooleanOptionalAction, default=True,
                       help="each round, set the device's class centres to its people's mean embedding under the "
                            "received model before training (weight imprinting; default on)")


def add_local_training_options(group) -> None:
    """What every device does in a round, beside the method and the objective's terms."""
    group.add_argument("--local-epochs", type=int, default=1, help="epochs each device trains per round (default 1)")
    group.add_argument("--batch-size", type=int, default=32, help="devices' training batch size (default 32)")
    group.add_argument("--lr", type=float, default=1e-4, help="devices' learning rate (Adam; default 1e-4)")
    group.add_argument("--dfc", action=argparse.BooleanOptionalAction, default=True,
                       help="devices train the DFC personalisation branch (default on)")
    group.add_argument("--dfc-weight", type=float, default=None,
                       help="alpha_3: weight of the DFC loss on devices (default 1; 10 with --method fedfr)")
    group.add_argument("--width-mult", type=float, default=1.0, help="MobileNetV2 width multiplier (default 1)")
    group.add_argument("--batchnorm", choices=("frozen", "frozen-trunk", "train"),
                       help="frozen: devices train with BatchNorm in inference mode, so a few people's batch "
                            "statistics never enter the shared model; frozen-trunk: all but the embedding layer's; "
                            "train: they update it (default: frozen from the face weights, measured in "
                            "bench/results/honest_round_batchnorm.md; train from any other --init, whose statistics "
                            "are not a face model's)")
    group.add_argument("--top-blocks", type=int, metavar="N",
                       help="devices train only the trunk's last N blocks and the embedding layer (default: all)")


def training_config(args, **extra) -> TrainingConfig:
    """The round configuration devices are sent, from the options `add_method_options`,
    `add_local_training_options`, `add_codec_options` and `add_objective_options` added; every command that runs
    rounds builds it here, so a flag means the same in each. `extra`: fields a command sets itself."""
    if not 0 < given(args, ["--topk-fraction"]).get("topk_fraction", TOPK_FRACTION) <= 1:  # TrainingConfig's bounds
        raise ValueError("--codec must be fp16, fp32, int8 or topk, and --topk-fraction in (0, 1]")
    kind = method_named(args.method or DEFAULT_METHOD)
    flags = {"epochs": "--local-epochs", "algorithm": "--method", **{f: flag for flag, f in kind.flags().items()}}
    try:
        method = method_settings(args, kind)
        optimisation = OptimiserSettings(epochs=args.local_epochs, batch_size=args.batch_size, lr=args.lr)
        dfc_weight = args.dfc_weight if args.dfc_weight is not None else \
            kind.model_defaults.get("dfc_weight", SPEC.model.dfc_weight)
        model = ModelSpec(dfc=args.dfc, width_mult=args.width_mult, dfc_weight=dfc_weight,
                          imprint_head=args.imprint_head)
        transport = TransportSettings(codec=args.codec, **given(args, ["--topk-fraction"]),
                                      **{k: extra.pop(k) for k in TransportSettings.model_fields if k in extra})
        config = TrainingConfig(method=method, optimisation=optimisation, model=model, transport=transport,
                                batchnorm=batchnorm(args), top_blocks=args.top_blocks, dp_clip=args.dp_clip,
                                **given(args, ["--dfc-steps", "--dfc-lr", "--dfc-anchor"]), **extra)
    except ValueError as exc:  # pydantic's refusal, named as these commands spell the option
        raise ValueError(one_line(exc, flags)) from None
    refuse_unowned(args, METHOD_OWNED, config)
    refuse_unowned(args, OWNED, config)
    return config


def method_settings(args, kind: type) -> methods.MethodSettings:
    """The chosen method's (`kind`'s) settings: each of its options given, else its own default. Another method's
    options are left for `refuse_unowned` to name."""
    return kind(**{field: getattr(args, dest(flag)) for flag, field in kind.flags().items()
                   if getattr(args, dest(flag), None) is not None})


def batchnorm(args) -> str:
    """--batchnorm, else frozen from the shipped face weights and train from any other start (a random model's
    BatchNorm statistics are no model's: frozen, its activations grow until they overflow)."""
    if args.batchnorm is not None:
        return args.batchnorm
    return SPEC.batchnorm if getattr(args, "init", "face") == "face" else "train"


def add_codec_options(group) -> None:
    """How devices compress their updates; named in the round configuration and in each signed update header."""
    codec = group.add_argument("--codec", choices=CODECS, default="fp16",
                       help="update codec: fp16 (default, 1/2 of fp32's bytes), fp32, int8 (per-channel, 1/4) or "
                            "topk (the --topk-fraction largest coordinates; 15%% is about 1/8.8); int8 and topk keep "
                            "what they could not send on the device and add it to the next update (error feedback)")
    deprecated_alias(group, "--wire-dtype", codec)
    group.add_argument("--topk-fraction", type=float,
                       help=f"fraction of coordinates the topk codec sends (default {TOPK_FRACTION}: with their "
                            "bitmask, about 1/8.8 of fp32's bytes)")

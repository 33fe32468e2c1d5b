"""The local-objective options shared by `ffr coordinator serve` and `ffr fleet simulate`.

`--method fedfr` turns on FedFR's techniques with the paper's weights (alpha = 1, 5, 10; t_HN 0.4;
tau 0.5); each technique has its own switch, so an ablation is one flag each
(`--method fedfr --no-contrastive`, `--no-hard-negatives`, `--no-dfc`).
"""
from __future__ import annotations

import argparse

from models.cli.common import Owned, deprecated_alias, given, one_line, refuse_unowned
from protocol import methods
from protocol.codecs import CODECS, TOPK_FRACTION
from protocol.messages import TrainingConfig, TransportSettings
from protocol.methods import DEFAULT_METHOD, Method, method_named, owner_of
from protocol.training_parts import ModelSpec, OptimiserSettings, flatten

SPEC = TrainingConfig()  # the flags' defaults are the spec's


def method_owned(option: str, of=lambda built: built) -> Owned:
    """`option` is its method's own (`protocol.methods`): refused unless the part the command built (`of` finds the
    round configuration in it) runs that method."""
    method: Method = owner_of(option)
    return Owned(f"--method {method.name}", lambda built: method.is_on(of(built)))


# Each method's and technique's own settings: given while their owner is off, the command refuses them
OWNED: dict[str, Owned] = {
    **{option: method_owned(option) for m in methods.METHODS.values() for option in m.options
       if option != "--server-momentum"},  # the coordinator's own setting (coordinator.cli.ROUND_OWNED)
    "--t-hn": Owned("--hard-negatives", lambda t: t.hard_negatives),
    "--tau": Owned("--contrastive", lambda t: t.contrastive),
    "--alpha-con": Owned("--contrastive", lambda t: t.contrastive),
    "--dfc-weight": Owned("--dfc", lambda t: t.model.dfc),
    "--dfc-steps": Owned("--dfc", lambda t: t.model.dfc),
    "--dfc-lr": Owned("--dfc", lambda t: t.model.dfc),
    "--topk-fraction": Owned("--codec topk", lambda t: t.transport.codec == "topk"),
}


def add_method_options(group, public_flag: str, old_spelling: str) -> None:
    """--method (one choice: aggregation and local objective), --prox-mu and --server-momentum; `old_spelling` is the
    command's former name for the aggregation choice (--strategy or --algorithm), kept as a deprecated alias."""
    method = group.add_argument(
        "--method", choices=tuple(methods.METHODS), default=DEFAULT_METHOD,
        help="; ".join(f"{m.name}: {m.summary.format(public=public_flag)}" for m in methods.METHODS.values()))
    deprecated_alias(group, old_spelling, method)
    prox = group.add_argument("--prox-mu", type=float,
                              help=f"FedProx's proximal weight mu (default {SPEC.prox_mu:g}; --method fedprox)")
    if old_spelling == "--strategy":  # `ffr coordinator serve --mu` meant FedProx's mu
        deprecated_alias(group, "--mu", prox)
    group.add_argument("--server-momentum", type=float,
                       help="FedAvgM's server momentum (default 0.9; --method fedavgm)")


def add_objective_options(group) -> None:
    group.add_argument("--hard-negatives", action=argparse.BooleanOptionalAction, default=None,
                       help="sample hard negatives from the device's public set (default: on with --method fedfr)")
    group.add_argument("--t-hn", type=float, help=f"hard-negative cosine threshold t_HN (default {SPEC.t_hn:g})")
    group.add_argument("--contrastive", action=argparse.BooleanOptionalAction, default=None,
                       help="FedFR's contrastive regulariser, eq. 5 (default: on with --method fedfr)")
    group.add_argument("--tau", type=float, help=f"contrastive temperature (default {SPEC.tau:g})")
    group.add_argument("--alpha-cos", type=float, help="alpha_1: weight of the CosFace loss (default 1)")
    group.add_argument("--alpha-con", type=float,
                       help=f"alpha_2: weight of the contrastive term (default {SPEC.alpha_con:g})")
    group.add_argument("--dfc-steps", type=int, help="steps fitting the DFC branch on frozen features after local "
                                                     f"training (default {SPEC.dfc_steps})")
    group.add_argument("--dfc-lr", type=float, help=f"learning rate of that fit (default {SPEC.dfc_lr:g})")
    group.add_argument("--embedding-reg", type=float,
                       help="C: add C * (1 - cos(global embedding, local embedding)) to the local loss (the HF-MAML "
                            "paper's eq. 4; FedAvg/FedProx/HF-MAML; default 0: off)")
    group.add_argument("--maml-alpha", type=float,
                       help=f"HF-MAML inner step size alpha (default {SPEC.maml_alpha:g})")
    group.add_argument("--maml-beta", type=float,
                       help=f"HF-MAML outer step size beta (default {SPEC.maml_beta:g}, the paper's Tab. IV)")
    group.add_argument("--maml-delta", type=float, help="HF-MAML finite-difference step delta of the Hessian-vector "
                                                        f"product (default {SPEC.maml_delta:g})")
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
    settings = objective_settings(args)
    if not 0 < given(args, ["--topk-fraction"]).get("topk_fraction", TOPK_FRACTION) <= 1:  # TrainingConfig's bounds
        raise ValueError("--codec must be fp16, fp32, int8 or topk, and --topk-fraction in (0, 1]")
    if settings["hfmaml"] and (settings["hard_negatives"] or settings["contrastive"]):
        raise ValueError("--method hfmaml takes no hard negatives or contrastive term (FedFR's)")
    if settings["embedding_reg"] and (settings["hard_negatives"] or settings["contrastive"]):
        raise ValueError("--embedding-reg applies to fedavg, fedprox and hfmaml, not to FedFR's objective")
    try:
        optimisation = OptimiserSettings(epochs=args.local_epochs, batch_size=args.batch_size, lr=args.lr)
        model = ModelSpec(dfc=args.dfc, width_mult=args.width_mult, dfc_weight=settings.pop("dfc_weight"),
                          imprint_head=settings.pop("imprint_head"))
        transport = TransportSettings(codec=args.codec, **given(args, ["--topk-fraction"]),
                                      **{k: extra.pop(k) for k in TransportSettings.model_fields if k in extra})
        config = TrainingConfig(optimisation=optimisation, model=model, transport=transport,
                                batchnorm=batchnorm(args), top_blocks=args.top_blocks,
                                algorithm=method_named(args.method).strategy, dp_clip=args.dp_clip,
                                **given(args, ["--prox-mu"]), **settings, **extra)
    except ValueError as exc:  # pydantic's refusal, named as these commands spell the option
        raise ValueError(one_line(exc, {"epochs": "--local-epochs", "algorithm": "--method"})) from None
    refuse_unowned(args, OWNED, config)
    return config


def batchnorm(args) -> str:
    """--batchnorm, else frozen from the shipped face weights and train from any other start (a random model's
    BatchNorm statistics are no model's: frozen, its activations grow until they overflow)."""
    if args.batchnorm is not None:
        return args.batchnorm
    return SPEC.batchnorm if getattr(args, "init", "face") == "face" else "train"


def objective_settings(args) -> dict:
    """TrainingConfig fields for the chosen method and switches, in the flat form (`protocol.training_parts`): a
    setting given wins, else the method's term (`protocol.methods`), else the spec's default."""
    switched = ("hard_negatives", "contrastive", "hfmaml", "dfc_weight", "embedding_reg")  # what methods set
    defaults = flatten(SPEC.model_dump())  # the round's defaults by name
    terms = {**{k: defaults[k] for k in switched}, **method_named(args.method or DEFAULT_METHOD).terms}
    switches = {k: getattr(args, k) for k in ("hard_negatives", "contrastive") if getattr(args, k) is not None}
    return {**terms, **switches, "imprint_head": args.imprint_head,
            **given(args, ["--alpha-cos", "--dfc-weight", "--embedding-reg", "--t-hn", "--tau", "--alpha-con",
                           "--dfc-steps", "--dfc-lr", "--maml-alpha", "--maml-beta", "--maml-delta"])}


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

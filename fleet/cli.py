"""`ffr fleet partition | simulate | report`: what will federated training give my fleet?"""
from __future__ import annotations

import argparse
import functools
import json
import logging
import sys
from dataclasses import replace
from pathlib import Path

from models.cli.common import (
    GATE_IDENTITIES,
    HOLDOUT_IDENTITIES,
    PUBLIC_IDENTITIES,
    Owned,
    add_init_option,
    deprecated_alias,
    dest,
    fraction,
    given,
    port,
    refuse_unowned,
)
from models.faces.datasets import LAYOUTS

PARTITIONS = ("iid", "dirichlet", "lognormal", "equal", "attribute")


def _partition_options(p: argparse.ArgumentParser, data_required: bool) -> None:
    g = p.add_argument_group("data and partition")
    g.add_argument("--data", required=data_required, type=str,
                   help="face dataset (folder per identity, LFW, or CelebA)"
                        + ("" if data_required else "; default: SYNTHETIC identities generated into RUN_DIR"))
    g.add_argument("--layout", choices=LAYOUTS, default="auto", help="dataset layout (default: guessed)")
    g.add_argument("--clients", type=int, default=10, help="number of simulated devices (default 10)")
    g.add_argument("--partition", choices=PARTITIONS, default="iid",
                   help="how identities are spread over devices (default iid)")
    g.add_argument("--alpha", type=float, help="Dirichlet concentration (default 0.5)")
    g.add_argument("--alpha-x100", action="store_true",
                   help="multiply alpha by 100, as the design document's code does")
    mu = g.add_argument("--lognormal-mu", type=float, metavar="MU", help="lognormal partition's mu (default 3)")
    deprecated_alias(g, "--mu", mu, note=" (the lognormal partition's; FedProx's weight is --prox-mu)")
    sigma = g.add_argument("--lognormal-sigma", type=float, metavar="SIGMA",
                           help="lognormal partition's sigma (default 3)")
    deprecated_alias(g, "--sigma", sigma)
    g.add_argument("--rules", type=Path,
                   help='attribute rules, JSON: [{"where": {"Male": 1}}, {"where": {"Male": -1}}]')
    g.add_argument("--holdout-identities", type=fraction, default=HOLDOUT_IDENTITIES,
                   help="fraction of identities kept off every device, for evaluation on unseen people")
    held = g.add_argument("--holdout-clients", dest="heldout_clients", type=int, default=0,
                          help="clients kept out of training entirely")
    deprecated_alias(g, "--heldout-clients", held)
    g.add_argument("--seed", type=int, default=0, help="seed of the partition, sampling and training")


from coordinator.cli import add_gate_options, add_round_options  # noqa: E402
from fleet.attacks import ATTACKS  # noqa: E402
from models.cli.common import add_detector_option  # noqa: E402
from models.cli.objective import (  # noqa: E402
    add_codec_options,
    add_local_training_options,
    add_method_options,
    add_objective_options,
)


def _rules(path: Path) -> list:
    """--rules FILE's JSON (checked for shape by SimConfig.validate); a file that is not JSON is named."""
    try:
        return json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"--rules {path} is not JSON ({' '.join(str(exc).split())})") from None


def _config(args):
    """The nested spec (`fleet.config.SimConfig`) from the options: its `server` and `gate` parts are built by the
    same functions as `ffr coordinator serve`'s, the rest by name."""
    from dataclasses import fields

    from coordinator.cli import gate_setup, round_settings
    from fleet.config import SimConfig
    from models.cli.objective import training_config

    owned = {dest(flag) for flag in SIM_OWNED}  # given or not: not given, SimConfig's default stands
    values = {f.name: getattr(args, f.name) for f in fields(SimConfig) if hasattr(args, f.name) and f.name not in owned}
    values.update(given(args, SIM_OWNED))
    values["rules"] = _rules(args.rules) if args.rules else None
    if getattr(args, "cache_dir", None) is not None:
        values["crop_cache"] = str(args.cache_dir)
    if hasattr(args, "method"):  # `ffr fleet simulate`; `partition` needs no rounds
        values["server"] = round_settings(args, training_config(args), min_clients=1)
        values["gate"] = gate_setup(args, args.seed)
    else:
        values["server"] = replace(SimConfig().server, seed=args.seed)
    config = SimConfig(**values)
    refuse_unowned(args, SIM_OWNED, config)
    return config


# The simulation's own owned settings (models.cli.common.Owned): given while their owner is off, refused
SIM_OWNED: dict[str, Owned] = {
    "--alpha": Owned("--partition dirichlet", lambda c: c.partition == "dirichlet"),
    "--lognormal-mu": Owned("--partition lognormal", lambda c: c.partition == "lognormal"),
    "--lognormal-sigma": Owned("--partition lognormal", lambda c: c.partition == "lognormal"),
    "--attack": Owned("--malicious", lambda c: c.malicious > 0, argv=("--malicious", "0.2")),
    "--fv-validators": Owned("--fv", lambda c: c.server.fv),
    "--cpus-per-device": Owned("--backend ray", lambda c: c.backend == "ray"),
    "--gpus-per-device": Owned("--backend ray", lambda c: c.backend == "ray"),
}


def cmd_partition(args) -> int:
    from fleet.data import make_partition
    from models.faces.datasets import load_index

    config = _config(args)
    config.validate()
    index = load_index(args.data, args.layout)
    result = make_partition(index, index.identities, config)
    if args.out:
        result.save(args.out)
    summary = result.summary(index.counts())
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    print(f"{summary['scheme']} partition of {len(index.identities)} identities over {summary['n_clients']} clients "
          f"(seed {args.seed}); {summary['holdout_identities']} identities ({summary['holdout_images']} images) "
          f"held out for global evaluation; imbalance ratio {summary['imbalance_ratio']:.1f}")
    print(f"{'client':>6} {'identities':>10} {'images':>7}")
    for row in summary["clients"]:
        flag = "  (held out of training)" if row["held_out_of_training"] else ""
        print(f"{row['client']:>6} {row['identities']:>10} {row['images']:>7}{flag}")
    return 0


def cmd_simulate(args) -> int:
    from fleet.report import summary_markdown
    from fleet.simulate import simulate

    config = _config(args)
    config.progress = not args.quiet
    if not args.verbose:  # per-message coordinator logs would drown the progress bars
        logging.getLogger("coordinator").setLevel(logging.WARNING)
    try:
        summary = simulate(config, args.out)
    except KeyboardInterrupt:
        print(f"\nstopped; the run's state is in {args.out}. Run the same command again to resume.", file=sys.stderr)
        return 130
    except RuntimeError as exc:
        print(f"ffr fleet simulate: failed: {exc}. The run's state is in {args.out}; fix the cause and run the "
              "same command to resume.", file=sys.stderr)
        return 1
    print()
    print(summary_markdown(summary))
    print(f"summary: {args.out / 'summary.json'}, {args.out / 'summary.md'}; MLflow: {args.out / 'mlflow.db'}")
    return 0


def cmd_report(args) -> int:
    from fleet.report import compare, run_rows

    if args.json:
        print(json.dumps(run_rows(args.runs), indent=2))
        return 0
    table = compare(args.runs)
    print(table)
    if args.out:
        args.out.write_text(table + "\n")
    return 0


def add_commands(fsub) -> None:
    """The `ffr fleet` subcommands, added to its subparsers."""
    p = fsub.add_parser("partition", help="show how a dataset's people would be spread over simulated devices",
                        description="Identity-level partition of a dataset over N clients, deterministic from "
                                    "--seed; prints identities and images per client and the imbalance ratio "
                                    "(largest/smallest client by images). Nothing is trained.")
    _partition_options(p, data_required=True)
    p.add_argument("--out", type=Path, help="save the partition as JSON (to repeat a run exactly)")
    p.add_argument("--json", action="store_true", help="print the partition summary as JSON")
    p.set_defaults(func=cmd_partition)

    p = fsub.add_parser(
        "simulate", help="simulate federated training on a fleet of virtual devices",
        description="Starts a coordinator (embedded mosquitto unless --broker) and N virtual devices running the "
                    "real edge client, a few at a time in a process pool (their state lives on disk in RUN_DIR). "
                    "Evaluates the global model every round on unseen people, then each client's personalised "
                    "verifiers, beside a centrally trained upper bound. Writes RUN_DIR/summary.json, summary.md, "
                    "plots and an MLflow run. Ctrl-C stops cleanly; the same command resumes.")
    _partition_options(p, data_required=False)
    g = p.add_argument_group("federated training")
    add_method_options(g, public_flag="--public-data", old_spelling="--algorithm")
    add_local_training_options(g)
    g.add_argument("--patience", type=int, default=5,
                   help="stop after this many rounds without a better validation AUC (0: never; default 5)")
    g.add_argument("--min-delta", type=float, default=1e-3, help="smallest AUC gain that counts as better")
    add_init_option(g, "round 0's model")
    add_codec_options(g)
    add_round_options(p, validators="the first --fv-validators held-out clients (needs --holdout-clients)")
    g = p.add_argument_group("local objective (FedFR and its ablations)")
    add_objective_options(g)
    g.add_argument("--public-data", help="FedFR's public set D_g: a folder of aligned faces of people no client has "
                                         "(flat or one folder per person), packed once into RUN_DIR/public_set")
    g.add_argument("--public-limit", type=int, default=2000, help="at most this many public faces (default 2000)")
    g.add_argument("--public-identities", type=fraction, default=PUBLIC_IDENTITIES,
                   help="without --public-data, the share of the people on no device whose faces every device is "
                        "served as its public set: the strangers it checks a new model, chooses between its models "
                        "and calibrates its door on; no unseen-people figure uses them "
                        f"(default {PUBLIC_IDENTITIES:g}; 0: no public set)")
    g = p.add_argument_group("attacks (malicious devices, against the coordinator's defences)")
    g.add_argument("--malicious", type=float, default=0.0,
                   help="fraction of training clients that poison their updates (default 0)")
    g.add_argument("--attack", choices=ATTACKS,
                   help="what they send (default scaled): scaled (1000x delta), sign-flip (-10x delta), wipe "
                        "(-global, 10^15 samples), collapse (pull all embeddings together from inside the norm "
                        "bound, largest accepted sample count), drift (the collapse scaled to pass its own estimate "
                        "of the gate), impersonate (pull its person onto another device's, whose photos it holds), "
                        "impersonate-hidden (that pull carried on its honest update, at the honest update's norm)")
    gate = add_gate_options(p)
    gate.add_argument("--gate-identities", type=fraction, default=GATE_IDENTITIES,
                      help="without --gate-data, the share of the people on no device that the coordinator keeps "
                           "for its gate: faces it never serves, and no unseen-people figure uses "
                           f"(default {GATE_IDENTITIES:g}; 0: judge on --public-data, if any)")
    g = p.add_argument_group("simulation")
    g.add_argument("--out", required=True, type=Path, help="run folder (RUN_DIR); an existing one is resumed")
    g.add_argument("--workers", type=int, default=2,
                   help="devices trained at once on this machine (pool: worker processes; ray: CPUs given to a "
                        "local Ray; default 2)")
    g.add_argument("--backend", choices=("pool", "ray"), default="pool",
                   help="who runs the device turns: pool (worker processes, default) or ray (Ray tasks, on this "
                        "machine or on the cluster at --ray-address)")
    g.add_argument("--ray-address", help="an existing Ray cluster (e.g. ray://HEAD:10001 or HEAD:6379); every node "
                                         "must reach the broker and mount RUN_DIR at the same path")
    g.add_argument("--dashboard-port", type=functools.partial(port, lowest=1),
                   help="serve the coordinator's dashboard at http://127.0.0.1:PORT/dashboard while the run goes on "
                        "(the address with its token is printed)")
    g.add_argument("--cpus-per-device", type=float, help="CPUs Ray reserves per device turn (default 1)")
    g.add_argument("--gpus-per-device", type=float, help="GPUs Ray reserves per device turn (default 0)")
    g.add_argument("--broker", help="use this MQTT broker (mqtt://HOST:PORT) instead of an embedded mosquitto")
    add_detector_option(g)
    g.add_argument("--synthetic-identities", type=int, default=60, help="without --data: SYNTHETIC identities")
    g.add_argument("--synthetic-images", type=int, default=10, help="without --data: images per identity")
    cache = g.add_argument("--cache-dir", type=Path,
                           help="where cropped faces are cached (default $FFR_CACHE_DIR or ~/.cache/ffr-edge)")
    deprecated_alias(g, "--crop-cache", cache)
    central = g.add_argument("--no-centralised", dest="centralized", action="store_false",
                             help="skip the centralised upper bound")
    deprecated_alias(g, "--no-centralized", central)
    g.add_argument("--impostor-images", type=int, default=300,
                   help="other clients' test images each client's verifier is tried against (default 300)")
    g.add_argument("--fv-validators", type=int, help="held-out clients that validate (default 1)")
    g.add_argument("--tune-steps", type=int, default=0,
                   help="also measure each client's global model after this many local batches on its training "
                        "images ('tuned', as the HF-MAML paper evaluates; it uses 5; default 0: off)")
    g.add_argument("--eval-clients", type=int,
                   help="measure per-client quality on a seeded sample of this many clients (default: all)")
    g.add_argument("--no-mlflow", dest="mlflow", action="store_false", help="do not log to MLflow")
    p.set_defaults(func=cmd_simulate)

    p = fsub.add_parser("report", help="several simulation runs side by side",
                        description="One Markdown table (or JSON) with a row per RUN_DIR's summary.json.")
    p.add_argument("runs", nargs="+", type=Path, metavar="RUN_DIR")
    p.add_argument("--out", type=Path, help="also write the table to this Markdown file")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    p.set_defaults(func=cmd_report)

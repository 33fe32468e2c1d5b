"""`ffr coordinator serve | admit`: run the federation, admit its devices."""
from __future__ import annotations

import argparse
from pathlib import Path

from coordinator.engine import ROUND_TIMEOUT_S
from coordinator.server_step import FIXED_STEP
from models.cli.common import Owned, add_init_option, at_least, given, port, refuse_unowned
from models.cli.objective import (
    add_codec_options,
    add_local_training_options,
    add_method_options,
    add_objective_options,
)
from protocol.messages import MAX_CHUNK_BYTES
from protocol.methods import method_named


def cmd_coordinator_serve(args) -> int:
    from coordinator.service import serve

    public = {}
    if args.public_set is not None and args.gate_data is None and not args.no_gate:
        from models.public_set import hold_back

        # the gate judges on faces no device can download: a share of the public set, never served
        args.public_set, args.gate_data = hold_back(Path(args.public_set), Path(args.state) / "public", seed=args.seed)
        print(f"quality gate: {args.gate_data.name}, a share of --public-set kept by the coordinator and never served; "
              f"devices get {args.public_set.name}", flush=True)
    if args.public_set is not None:
        from coordinator.public_set import announce_public_set, public_set_url

        public = announce_public_set(args.public_set, public_set_url(args.http_host, args.http_port, args.public_url))
    config, settings = serve_spec(args, public)
    if settings.training.method.uses_public_set() and not public:
        print("hard negatives are on but this coordinator serves no public set (--public-set): each device needs "
              "its own (`ffr edge run --public-set FILE`)", flush=True)
    if args.exit_grace is not None and not (args.exit_when_done and args.exit_grace >= 0):
        raise ValueError("--exit-grace is how long --exit-when-done waits (seconds, not negative): give both")
    grace = {} if args.exit_grace is None else {"exit_grace_s": args.exit_grace}
    return serve(config, settings, exit_when_done=args.exit_when_done, docs=args.api_docs, **grace)


def serve_spec(args, public: dict | None = None):
    """(`ServiceConfig`, `RoundSettings`) from `ffr coordinator serve`'s options; `public`: the announced public
    set's part of `TrainingConfig` (`public_set`: its URL, hash and size), when it serves one."""
    from coordinator.service import ServiceConfig
    from models.cli.objective import training_config

    if args.chunk_kib * 1024 > MAX_CHUNK_BYTES:  # TrainingConfig's bound, named as this command spells it
        raise ValueError(f"--chunk-kib must be at most {MAX_CHUNK_BYTES // 1024} (got {args.chunk_kib})")
    training = training_config(args, chunk_bytes=args.chunk_kib * 1024, **(public or {}))
    settings = round_settings(args, training, min_clients=args.min_clients)
    config = ServiceConfig(state=args.state, broker=args.broker, username=args.username, password=args.password,
                           ca_file=args.ca_file, http_host=args.http_host, http_port=args.http_port,
                           init=args.init, broker_acl=not args.no_broker_acl, tls=args.tls,
                           public_set=args.public_set, gate=gate_setup(args, args.seed), keepalive_s=args.keepalive)
    refuse_unowned(args, SERVE_OWNED, config)
    return config, settings


# The deployment's owned options: the embedded broker's, and a login for a broker that asks for one
_EMBEDDED = Owned("the embedded broker", lambda c: c.broker is None, argv=(), fix="leave out --broker")
_LOGIN = Owned("--broker URL", lambda c: c.broker is not None or not c.broker_acl, argv=("--broker", "mqtt://h:1"),
               fix="use --broker URL; the embedded broker makes its own logins")


def _speaks_tls(config) -> bool:
    """Whether the coordinator's broker is TLS: an mqtts:// --broker, or the embedded one with --tls."""
    from protocol.transport import BrokerAddress

    return BrokerAddress.parse(config.broker).tls if config.broker else config.tls


_TLS = Owned("a TLS broker", _speaks_tls, argv=("--broker", "mqtts://h:1"),
             fix="use --broker mqtts://HOST:PORT, or --tls")
SERVE_OWNED: dict[str, Owned] = {"--tls": _EMBEDDED, "--no-broker-acl": _EMBEDDED, "--username": _LOGIN,
                                 "--password": _LOGIN, "--ca-file": _TLS}


def round_settings(args, training, **fixed):
    """A run's `RoundSettings` from the options `add_round_options` added (and `--seed`, `--method`,
    `--server-momentum`): `ffr coordinator serve` and `ffr fleet simulate` build them here alike. `fixed`: what a
    command decides itself (the quorum)."""
    from coordinator.settings import RoundSettings

    own = given(args, ROUND_OWNED, {"fv_timeout": "fv_timeout_s"})
    settings = RoundSettings(rounds=args.rounds, fraction=args.fraction, round_timeout_s=args.round_timeout,
                             training=training, seed=args.seed, combine=args.combine, norm_factor=args.norm_factor,
                             norm_ceiling=args.norm_ceiling, norm_action=args.norm_action, dp_noise=args.dp_noise,
                             server_step=args.server_step, screen=args.screen,
                             fv=args.fv or method_named(args.method).validation, **own, **fixed)
    refuse_unowned(args, ROUND_OWNED, settings)
    return settings


# Each rule's own settings (models.cli.common.Owned): given while the rule is off, refused
ROUND_OWNED: dict[str, Owned] = {
    "--server-momentum": Owned("--method fedavgm", lambda s: s.training.method.strategy == "fedavgm"),
    "--trim": Owned("--combine trimmed-mean", lambda s: s.combine == "trimmed-mean"),
    "--byzantine": Owned("--combine krum", lambda s: s.combine == "krum"),
    "--dp-delta": Owned("--dp-noise", lambda s: s.dp_noise > 0, argv=("--dp-clip", "1", "--dp-noise", "1")),
    "--fv-candidates": Owned("--fv", lambda s: s.fv),
    "--fv-phi": Owned("--fv", lambda s: s.fv),
    "--fv-epsilon": Owned("--fv", lambda s: s.fv),
    "--fv-timeout": Owned("--fv", lambda s: s.fv),
}


def add_round_options(p: argparse.ArgumentParser, validators: str) -> None:
    """What a run's rounds are (coordinator.settings.RoundSettings): their number and sampling, the combination
    rule and its bounds, DP-FedAvg and Federated Validation. `validators`: who validates, in this command."""
    from coordinator.robust import COMBINERS
    from coordinator.update_screen import SCREENS

    g = p.add_argument_group("rounds")
    g.add_argument("--rounds", type=int, default=10, help="federated rounds (default 10)")
    g.add_argument("--fraction", type=float, default=1.0, help="fraction of devices sampled per round (default 1)")
    g.add_argument("--round-timeout", type=float, default=ROUND_TIMEOUT_S,
                   help=f"seconds a round waits for updates (default {ROUND_TIMEOUT_S:g})")
    g.add_argument("--server-step", type=float, default=FIXED_STEP,
                   help="without real faces to choose on: how far the published model moves towards the round's "
                        f"aggregate, 1 = all the way (default {FIXED_STEP:g}; a gate on real faces chooses the step, "
                        "one on stand-in faces only judges this one)")
    g = p.add_argument_group("robust aggregation (every update is norm-bounded; the new model is checked)")
    g.add_argument("--combine", choices=COMBINERS, default="mean",
                   help="how updates are combined: the weighted mean (FedAvg), a coordinate-wise trimmed mean or "
                        "median, or Multi-Krum (default mean)")
    g.add_argument("--screen", choices=tuple(SCREENS),
                   help="each update judged against the round's others before combining: flame (FLAME, USENIX "
                        "Security 2022: updates outside the majority cluster of directions are left out, the rest "
                        "clipped to their median norm; rounds of 4 or more updates) or none (default flame; none "
                        "with --dp-clip)")
    g.add_argument("--trim", type=float, help="trimmed mean: fraction dropped at each end (default 0.2)")
    g.add_argument("--byzantine", type=int, help="Krum: devices assumed malicious (default (n - 3) / 2)")
    g.add_argument("--norm-factor", type=float, default=3.0,
                   help="an update's norm may be at most this x the median of recent ones (default 3)")
    g.add_argument("--norm-ceiling", type=float, default=0.1,
                   help="... and never above this fraction of the global model's norm (default 0.1)")
    g.add_argument("--norm-action", choices=("clip", "reject"), default="clip",
                   help="what happens to an update above the bound (default clip)")
    g = p.add_argument_group("differential privacy (DP-FedAvg, McMahan et al. 2018)")
    g.add_argument("--dp-clip", type=float, help="devices clip their update to this L2 norm; updates weigh the same")
    g.add_argument("--dp-noise", type=float, default=0.0,
                   help="noise multiplier z: N(0, (z * clip / n)^2) is added to the mean (default 0: none)")
    g.add_argument("--dp-delta", type=float, help="delta at which epsilon is reported (default 1e-5)")
    g = p.add_argument_group("Federated Validation (FedFace; coordinator.validation)")
    g.add_argument("--fv", action="store_true",
                   help=f"{validators} score candidate aggregation weightings every round (they send only the "
                        "score; they do not train)")
    g.add_argument("--fv-candidates", type=int, help="T: candidate weightings per round (default 3)")
    g.add_argument("--fv-phi", type=float, help="eq. 13's smoothing rate phi (default 0.01)")
    g.add_argument("--fv-epsilon", type=float, help="eq. 8's epsilon (default 1e-3)")
    g.add_argument("--fv-timeout", type=float, help="seconds validators have per round (default 120)")


def cmd_coordinator_admit(args) -> int:
    from coordinator.admission import admit

    credential = admit(args.state, args.device_id, args.broker)
    credential.save(args.out)
    print(f"admitted {args.device_id}: credential written to {args.out} (mode 0600). Copy it to the device "
          f"privately and run: ffr edge run --credential {args.out.name} --data DIR --home DIR", flush=True)
    return 0


def add_broker_options(p: argparse.ArgumentParser, default: str | None) -> None:
    p.add_argument("--broker", default=default, help="MQTT broker URL, mqtt://HOST:PORT or mqtts://HOST:PORT"
                   + ("" if default else " (default: start an embedded mosquitto)"))
    p.add_argument("--username", help="broker user name")
    p.add_argument("--password", help="broker password")
    p.add_argument("--ca-file", help="CA certificate for mqtts:// brokers")


def add_gate_options(p: argparse.ArgumentParser):
    """The quality gate's options (coordinator.quality_gate), shared by `ffr coordinator serve` and `ffr fleet`; the
    group, for a command's own gate options."""
    from coordinator.quality_gate import GateSettings

    d = GateSettings()
    g = p.add_argument_group("quality gate (each new global model is scored on the coordinator's faces before it "
                             "is published; a worse one rolls the round back)")
    g.add_argument("--gate-data", metavar="PATH",
                   help="aligned faces to score candidates on: a folder (one sub-folder per person gives TAR/FAR; "
                        "a flat folder of unlabelled faces works too) or a public set file (default: faces the "
                        "coordinator keeps to itself: serve keeps a share of --public-set and never serves it, fleet "
                        "simulate a share of the people on no device; serve without any: SYNTHETIC stand-in faces, "
                        "which judge --server-step but never choose the step)")
    g.add_argument("--gate-far", type=float, default=d.far,
                   help=f"the operating point checked: the current model's threshold for this FAR (default {d.far:g})")
    g.add_argument("--gate-far-ratio", type=float, default=d.far_ratio,
                   help="roll back when the candidate accepts more than this x the current model's impostors at that "
                        f"threshold (default {d.far_ratio:g})")
    g.add_argument("--gate-auc-margin", type=float, default=d.auc_margin,
                   help=f"... or loses more than this much AUC (default {d.auc_margin:g})")
    g.add_argument("--gate-pair-jump", type=float, default=d.pair_jump,
                   help="... or accepts any one impostor pair that rose this much beyond the others' median move (or "
                        f"8 robust deviations of all pairs' rises, if more) (default {d.pair_jump:g})")
    g.add_argument("--gate-faces", type=int, default=d.limit, help=f"faces scored, at most (default {d.limit})")
    g.add_argument("--no-gate", action="store_true", help="publish without the quality gate (not for deployments)")
    return g


def gate_setup(args, seed: int):
    """The gate's part of a command's spec (`coordinator.quality_gate.GateSetup`) from `add_gate_options`' flags."""
    from coordinator.quality_gate import GateSettings, GateSetup

    bar = GateSettings(far=args.gate_far, far_ratio=args.gate_far_ratio, auc_margin=args.gate_auc_margin,
                       pair_jump=args.gate_pair_jump, limit=args.gate_faces, seed=seed)
    return GateSetup(data=args.gate_data, off=args.no_gate, bar=bar)


def add_commands(csub) -> None:
    """The `ffr coordinator` subcommands, added to its subparsers."""
    p = csub.add_parser("serve", help="run federated rounds over MQTT, with an HTTP API",
                        description="Run rounds: sample devices, announce, collect backbone deltas, aggregate, "
                                    "publish the new global model. State (models, history) lives in --state and "
                                    "survives restarts. The dashboard is at http://HOST:PORT/dashboard.")
    add_broker_options(p, None)
    p.add_argument("--http-host", default="127.0.0.1", help="address the HTTP API and dashboard listen on")
    p.add_argument("--http-port", type=port, default=8080, help="port of the HTTP API and dashboard")
    p.add_argument("--min-clients", type=int, default=2, help="devices needed to start a round and to aggregate it")
    add_round_options(p, validators="devices run with `ffr edge run --validation DIR`")
    g = p.add_argument_group("federated method")
    add_method_options(g, public_flag="--public-set", old_spelling="--strategy")
    p.add_argument("--state", type=Path, default=Path("coordinator_state"),
                   help="state folder (models, history, keys); kept across restarts")
    add_local_training_options(g)
    add_codec_options(g)
    p.add_argument("--chunk-kib", type=at_least(1), default=256,
                   help=f"largest MQTT message, KiB (1-{MAX_CHUNK_BYTES // 1024})")
    add_init_option(p, "round 0's model")
    p.add_argument("--seed", type=int, default=0, help="seed of device sampling and of round 0's model")
    p.add_argument("--exit-when-done", action="store_true",
                   help="exit after the last round is aggregated and the devices took the final model")
    p.add_argument("--exit-grace", type=float, metavar="SECONDS",
                   help="with --exit-when-done: how long the devices get to take the final model before the "
                        "coordinator (and an embedded broker) stops anyway (default 60)")
    p.add_argument("--api-docs", action="store_true",
                   help="serve the API's interactive docs at /docs and /openapi.json (default off: they map the API "
                        "for anyone who can reach the port)")
    g = p.add_argument_group("local objective (FedFR's hard negatives need a public set: --public-set here, "
                             "or `ffr edge run --public-set` on each device)")
    add_objective_options(g)
    g.add_argument("--public-set", type=Path,
                   help="FedFR's D_g, a file from `ffr edge public-set`: served at GET /public-set and announced by "
                        "sha256 in every round; devices fetch it once")
    g.add_argument("--public-url", help="the URL devices fetch the public set from (default: "
                                        "http://HTTP-HOST:HTTP-PORT/public-set)")
    add_gate_options(p)
    p.add_argument("--tls", action="store_true",
                   help="the embedded broker speaks TLS (mqtts://) with a CA generated in STATE/tls; devices get the "
                        "CA in their credential files")
    p.add_argument("--no-broker-acl", action="store_true",
                   help="run the embedded broker without logins and ACLs (not for deployments)")
    p.add_argument("--keepalive", type=at_least(1), default=30, metavar="S",
                   help="MQTT keepalive of the coordinator's connection, in seconds: the broker drops it after 1.5 "
                        "times this without a packet (default: %(default)s)")
    p.set_defaults(func=cmd_coordinator_serve)

    p = csub.add_parser("admit", help="admit a device: issue its one-time credential file",
                        description="Writes a credential file (mode 0600) for one device: its id, a one-time "
                                    "admission token, the coordinator's public key to pin, the broker address and "
                                    "(with the embedded broker) the device's broker login. Hand it to the device "
                                    "out of band; nothing secret crosses the broker. Admitting an id again issues "
                                    "a new credential (e.g. for a device that lost its home folder).")
    p.add_argument("--state", type=Path, default=Path("coordinator_state"), help="the coordinator's state folder")
    p.add_argument("--device-id", required=True, help="the device's id ([A-Za-z0-9_.-], at most 64 characters)")
    p.add_argument("--out", type=Path, required=True, help="credential file to write")
    p.add_argument("--broker", help="broker URL devices connect to (default: the one the coordinator serves on)")
    p.set_defaults(func=cmd_coordinator_admit)

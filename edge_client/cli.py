"""`ffr edge run | public-set`: a device in the federation, and FedFR's public set file."""
from __future__ import annotations

from pathlib import Path

from models.cli.common import add_detector_option


def cmd_edge_run(args) -> int:
    from edge_client.daemon import run

    return run(args.credential, args.data, args.home, until_finished=args.exit_when_done, broker=args.broker,
               detector=args.detector, ca_file=args.ca_file, export_onnx=not args.no_export, seed=args.seed,
               public_set=args.public_set, validation=args.validation, in_process=args.in_process)


def cmd_edge_public_set(args) -> int:
    from models.public_set import build_public_set

    if args.limit < 1:
        raise ValueError("--limit must be at least 1")
    sha = build_public_set(args.data, args.out, args.limit, args.seed, progress=not args.quiet)
    print(f"public set {args.out}: sha256 {sha}")
    return 0


def add_commands(esub) -> None:
    """The `ffr edge` subcommands, added to its subparsers."""
    p = esub.add_parser("run", help="join the federation: train locally each round, send only backbone deltas",
                        description="Joins with its credential file, trains on the people enrolled on this device "
                                    "(`ffr device enroll --home`; or --data, one folder each) every round it is "
                                    "picked for, sends only the backbone delta, and exports its models into --home.",
                        epilog="example: ffr device enroll --home ~/.ffr-device --from known_people/ && "
                               "ffr edge run --credential kitchen-pi.credential --home ~/.ffr-device")
    p.add_argument("--credential", required=True, type=Path,
                   help="the credential file from `ffr coordinator admit` (device id, coordinator key, broker)")
    p.add_argument("--data", type=Path,
                   help="train on this folder (one sub-folder of photos per person: simulations, bulk import) "
                        "instead of the people enrolled in --home (default: the enrolled people, decrypted in memory "
                        "for each round, whoever was enrolled or removed since included)")
    p.add_argument("--home", required=True, type=Path, help="the device's private state folder")
    p.add_argument("--broker", help="override the broker URL in the credential")
    p.add_argument("--ca-file", help="CA certificate for mqtts:// brokers (default: the one in the credential)")
    add_detector_option(p)
    p.add_argument("--no-export", action="store_true", help="do not export ONNX models after each round")
    p.add_argument("--in-process", action="store_true",
                   help="train in the daemon's own process (default: a child process for each round, so that the "
                        "daemon holds no torch between rounds: 133 MB idle instead of 938 MB, bench.daemon_memory)")
    p.add_argument("--seed", type=int, default=0, help="seed of local training")
    p.add_argument("--exit-when-done", action="store_true", help="exit after the coordinator's last round")
    p.add_argument("--public-set", type=Path,
                   help="FedFR's public face set D_g (a file from `ffr edge public-set`): hard negatives are sampled "
                        "from it when a round asks; nothing about it is ever sent")
    p.add_argument("--validation", type=Path,
                   help="FedFace's Federated Validation: this device scores the coordinator's candidate models on "
                        "these private images (one folder per person) and sends only the score; it does not train")
    p.set_defaults(func=cmd_edge_run)

    p = esub.add_parser("public-set", help="pack a folder of aligned faces into a public set file (FedFR's D_g)",
                        description="Samples up to --limit aligned face images (flat folder or one folder per person, "
                                    "e.g. ../shared/faces/utkface_aligned) of people nobody enrols, into one "
                                    "safetensors file of 128x128 crops; prints its sha256.")
    p.add_argument("--data", required=True, type=Path, help="folder of aligned face crops")
    p.add_argument("--out", required=True, type=Path, help="the file to write (.safetensors)")
    p.add_argument("--limit", type=int, default=2000, help="at most this many images (default 2000)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sample")
    p.set_defaults(func=cmd_edge_public_set)

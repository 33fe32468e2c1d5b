"""A run's summary as JSON and Markdown, and `ffr fleet report`: several runs side by side."""
from __future__ import annotations

import json
from pathlib import Path

from protocol.json_file import read_json

VERIFIERS = ("start", "global", "tuned", "local", "local+dfc", "global+dfc", "centralized")


def _f(value, digits: int = 3) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def mean_std(stats: dict | None, metric: str) -> str:
    if not stats or not stats.get(metric):
        return "n/a"
    return f"{stats[metric]['mean']:.3f} ± {stats[metric]['std']:.3f}"


def method_label(c: dict) -> str:
    """e.g. 'fedavg +DFC', or 'fedfr +HN +con +DFC' for FedFR and its ablations."""
    name = c.get("method") or c.get("method.name") or c["algorithm"]  # the run's --method; the wire's; before both
    fedfr = name == "fedfr"
    hn, con = (c.get(f"method.{k}", c.get(k)) for k in ("hard_negatives", "contrastive"))  # today's name, or older
    hn, con = (fedfr if on is None else on for on in (hn, con))
    return " ".join([name] + [flag for flag, on in (("+HN", hn), ("+con", con), ("+DFC", c["dfc"])) if on])


def run_row(summary: dict) -> dict:
    """The figures one row of a comparison table shows."""
    c, g = summary["config"], summary["global"]
    central = (summary.get("centralized") or {}).get("global") or {}
    training = summary["personalized"]["training_clients"]
    start = summary.get("initial") or {}
    partition = c["partition"] + (f" {c['alpha']}" if c["partition"] == "dirichlet" else "")
    return {
        "run": Path(summary["run"]).name, "data": summary["data_kind"], "partition": partition,
        "algorithm": method_label(c), "clients": c["clients"],
        "rounds": summary["rounds_completed"], "best round": summary["best_round"],
        "start AUC": _f(start.get("auc")), "global AUC": _f(g.get("auc")),
        "start TAR@1e-3": _f(start.get("tar@1e-3")), "global TAR@1e-3": _f(g.get("tar@1e-3")),
        "global EER": _f(g.get("eer")), "global TAR@1e-2": _f(g.get("tar@1e-2")),
        "central AUC": _f(central.get("auc")), "central EER": _f(central.get("eer")),
        **{f"pers. TAR@1e-3 {v}": mean_std(training.get(v), "tar@1e-3")
           for v in ("start", "global", "local", "local+dfc", "global+dfc")},
        **_door_columns(summary["personalized"].get("doors") or {}),
        "MB/round up": _f(summary["bytes"]["per_round_up_mean"] / 1e6, 1),
        "s/round": _f(summary.get("round_seconds_mean"), 1), "wall s": _f(summary["wall_seconds"], 0),
    }


def _door_columns(doors: dict) -> dict:
    """The devices' doors at the threshold each calibrates, start against what each verifies with now (n/a for a
    run from before doors were scored)."""
    start, now = doors.get("start") or {}, doors.get("chosen") or {}
    return {"door TAR start": _f(start.get("tar")), "door TAR now": _f(now.get("tar")),
            "door FAR start": _f(start.get("far"), 5), "door FAR now": _f(now.get("far"), 5),
            "doors over 2x now (beyond interval)": f"{now['over_2x']} ({now['beyond_2x']})" if "over_2x" in now
            else "n/a"}


def _with(figures: dict, interval: dict, key: str, digits: int = 3) -> str:
    """'0.952 [0.941, 0.960]': a figure and its bootstrap interval over people, where there is one."""
    bounds = interval.get(key)
    shown = _f(figures.get(key), digits)
    if not bounds or figures.get(key) is None:
        return shown
    return f"{shown} [{bounds[0]:.{digits}f}, {bounds[1]:.{digits}f}]"


def _rounds_lines(summary: dict) -> list[str]:
    """Every published round's global model on unseen people beside the start: whether the federation paid."""
    history = summary.get("history") or []
    if len(history) < 2 or history[0].get("holdout_auc") is None:
        return []
    start = history[0]
    lines = ["", "## Round by round, people no device holds", "",
             "| round | AUC | vs start | TAR@1e-3 | vs start | TAR@1e-4 |", "|---|---|---|---|---|---|"]
    for h in history:
        interval = h.get("holdout_interval") or {}
        figures = {k.removeprefix("holdout_"): v for k, v in h.items() if k.startswith("holdout_")}
        lines.append(f"| {h['round']}{' (start)' if h['round'] == 0 else ''} | {_with(figures, interval, 'auc', 4)} | "
                     f"{_delta(h.get('holdout_auc'), start.get('holdout_auc'), 4)} | "
                     f"{_with(figures, interval, 'tar@1e-3')} | "
                     f"{_delta(h.get('holdout_tar@1e-3'), start.get('holdout_tar@1e-3'))} | "
                     f"{_with(figures, interval, 'tar@1e-4')} |")
    return lines


def _delta(value, start, digits: int = 3) -> str:
    return "n/a" if value is None or start is None else f"{value - start:+.{digits}f}"


def markdown_table(rows: list[dict]) -> str:
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(r.get(k, "")) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def _rolled_back_lines(rolled_back: list[dict]) -> list[str]:
    """The rounds the coordinator refused to publish (its quality gate or a check), each with its reason: the run
    went on from the model before, and a reader of the table would otherwise see only fewer rounds."""
    if not rolled_back:
        return []
    sent = sum(r["bytes_up"] for r in rolled_back) / 1e6
    return [f"**{len(rolled_back)} round(s) rolled back by the coordinator** (devices' uploads in them: {sent:.1f} MB, "
            "not in the cost below):", "", *[f"- round {r['round_id']}: {r['reason']}" for r in rolled_back], ""]


def _attack_lines(attack: dict | None) -> list[str]:
    """What the attackers achieved, in one paragraph (the figures are `summary.json`'s `attack`)."""
    if not attack:
        return []
    far = attack.get("far@start") or {}
    return [f"**Attack `{attack['kind']}`** by {', '.join(attack['attackers']) or 'no device'}: impostors accepted "
            f"on unseen people at the starting model's FAR=1e-3 threshold {_f(far.get('start'), 4)} at the start, "
            f"{_f(far.get('last'), 4)} with the last published model ({_f(far.get('ratio'), 2)}x)."
            + (f" Impersonation of {attack['victim_person']} ({attack['victim']}) by {attack['attacker_person']}: "
               f"success rate {_f(attack['success_rate'])} on the victim's device, "
               f"{_f(attack['success_rate_global'])} with the published model, "
               f"{_f(attack['success_rate_start'])} with the starting model." if "success_rate" in attack else ""),
            ""]


def _door_lines(doors: dict) -> list[str]:
    """Each device's door at the threshold it calibrates (`fleet.doors`), averaged over devices, start vs now."""
    if not doors.get("per_client"):
        return []
    chosen = doors["chosen"]
    lines = ["", "## Each device's door (mean over devices)", "",
             f"At the threshold each device calibrates for FAR {doors['far_promised']:g} (its judged images and the "
             "public faces it was served): its people's TAR on their test images, and the FAR on photos of people on "
             f"no device. The device verifies with the personalised model on {chosen['personalised']} of "
             f"{chosen['devices']}. Over 2x: devices whose strangers' FAR is above twice the promise, and in "
             "brackets those above it beyond their 95% interval over the strangers (one look-alike stranger makes "
             "most of a door's false accepts, so a door that keeps its promise can measure over it).", "",
             "| model | devices | TAR | FAR | worst device's FAR | over 2x (beyond interval) |",
             "|---|---|---|---|---|---|"]
    for name, label in (("start", "start (before the federation)"), ("global", "global"),
                        ("personalised", "personalised"), ("chosen", "what each device verifies with")):
        d = doors.get(name) or {}
        if d.get("devices"):
            over = f"{d['over_2x']} ({d['beyond_2x']})" if "over_2x" in d else "n/a"
            lines.append(f"| {label} | {d['devices']} | {_f(d['tar'])} | {_f(d['far'], 5)} | "
                         f"{_f(d['far_worst'], 5)} | {over} |")
    return lines


OWN_GAIN = 0.10  # issue 47's bar: a device's own people 10 points of TAR@1e-3 above the starting model


def _tar(row: dict, name: str) -> float | None:
    return (row.get(name) or {}).get("tar@1e-3")


def _door_pair(doors: dict, key: str) -> tuple[float | None, float | None]:
    """One door figure of a device, start and now: the starting model's door and the one the device verifies with."""
    start, now = doors.get("start") or {}, doors.get(doors.get("chosen") or "", {})
    return start.get(key), now.get(key)


def _door_cell(doors: dict, key: str, digits: int) -> str:
    """'start -> now' of one door figure."""
    start, now = _door_pair(doors, key)
    return f"{_f(start, digits)} -> {_f(now, digits)}"


def _fell(start: float | None, now: float | None) -> bool:
    """Whether a figure ended below where it started (False where either is missing)."""
    return now is not None and start is not None and now < start


def _device_lines(personalized: dict) -> list[str]:
    """Each training device: its own people's TAR@1e-3 against strangers with the starting, the global and its
    personalised model, and its door start -> now, with how many devices reach the 10-point bar, how many end
    below the start (own people at their FAR=1e-3 threshold, and at the door: its TAR), and how many start so high
    that the bar is out of reach (a device of one person at 1.000 would otherwise read as a miss); nothing for a run
    from before doors were scored."""
    doors = (personalized.get("doors") or {}).get("per_client") or {}
    rows = [r for r in personalized.get("per_client") or [] if not r.get("held_out") and _tar(r, "start") is not None]
    if not rows or not doors:
        return []
    lines = ["", "### Per device", "",
             "Own people TAR@1e-3: against strangers at their own FAR=1e-3 threshold; personalised: the global "
             "backbone with the device's DFC branch. The door: at the threshold the device calibrated, start -> the "
             "model it verifies with now; the FAR's 95% interval over the strangers in brackets.", "",
             "| device | own TAR@1e-3 start | global | personalised | gain | verifies with | door TAR | door FAR |",
             "|---|---|---|---|---|---|---|---|"]
    gains, worse, door_worse = [], 0, 0
    for r in rows:
        d = doors.get(str(r["client"])) or {}
        start, mine = _tar(r, "start"), _tar(r, "global+dfc")
        used = _tar(r, "global+dfc" if d.get("chosen") == "personalised" else "global")
        gain = None if mine is None else mine - start
        gains.append(gain)
        worse += _fell(start, used)
        door_worse += _fell(*_door_pair(d, "tar"))
        now = d.get(d.get("chosen") or "", {})
        interval = now.get("far_interval")
        far = _door_cell(d, "far", 5) + (f" [{interval[0]:.5f}, {interval[1]:.5f}]" if interval else "")
        lines.append(f"| {r['client']} | {_f(start)} | {_f(_tar(r, 'global'))} | {_f(mine)} | "
                     f"{'n/a' if gain is None else f'{gain:+.3f}'} | {d.get('chosen', 'no door scored')} | "
                     f"{_door_cell(d, 'tar', 3)} | {far} |")
    reached = sum(g is not None and g >= OWN_GAIN for g in gains)
    capped = sum(_tar(r, "start") > 1 - OWN_GAIN for r in rows)
    lines += ["", f"{reached} of {len(rows)} devices gain {OWN_GAIN * 100:.0f} points or more on their own people "
              f"with the personalised model; {worse} end below the start with the model they verify with "
              f"({door_worse} at the door they calibrated)"
              + (f"; {capped} start above {1 - OWN_GAIN:.3f}, where {OWN_GAIN * 100:.0f} points cannot be gained."
                 if capped else ".")]
    return lines


def _people_lines(people: dict | None) -> list[str]:
    """Who the people on no device are used for (absent from runs before it was recorded)."""
    if not people:
        return []
    public = (f"the devices' public set is --public-data ({people['public_data']})" if people.get("public_data")
              else f"{people['public']} served to every device as its public set")
    return [f"People on no device: {people['unseen']} unseen (the figures below), {people['gate']} kept for the "
            f"coordinator's quality gate, {public}.", ""]


def summary_markdown(summary: dict) -> str:
    c = summary["config"]
    lines = [f"# Fleet simulation: {Path(summary['run']).name}", "",
             f"{'SYNTHETIC faces' if summary['data_kind'] == 'synthetic' else 'data: ' + str(c['data'])}; "
             f"{c['clients']} clients, {c['partition']} partition, {method_label(c)}, "
             f"{summary['rounds_completed']} rounds ({summary['status']}), "
             f"best round {summary['best_round']}.", "", *_people_lines(summary.get("people_on_no_device")),
             *_rolled_back_lines(summary.get("rolled_back", [])),
             *_attack_lines(summary.get("attack")),
             "## Global model on unseen people", "",
             "[low, high]: 95% bootstrap interval over people.", "",
             "| model | AUC | EER | TAR@1e-2 | TAR@1e-3 | TAR@1e-4 |", "|---|---|---|---|---|---|"]
    rows = [("starting model (round 0)", summary["initial"])] if summary.get("initial") else []
    rows.append((f"federated (round {summary['best_round']})", summary["global"]))
    if summary.get("centralized"):
        rows.append(("centralised (upper bound)", summary["centralized"]["global"]))
    for name, g in rows:
        interval = g.get("interval") or {}
        lines.append(f"| {name} | {_with(g, interval, 'auc', 4)} | {_f(g.get('eer'))} | {_f(g.get('tar@1e-2'))} | "
                     f"{_with(g, interval, 'tar@1e-3')} | {_with(g, interval, 'tar@1e-4')} |")
    lines += _rounds_lines(summary)
    if not summary["personalized"]["training_clients"]:
        lines += ["", "## Personalised verification", "",
                  "Not measured: no client has two test images of one person (more images per identity needed)."]
    for title, key in (("training clients", "training_clients"), ("clients held out of training", "held_out_clients")):
        stats = summary["personalized"][key]
        if not stats:
            continue
        lines += ["", f"## Personalised verification, {title} (mean ± std over clients)", "",
                  f"Each client's own people against {summary['personalized'].get('impostors', 'other people')}; "
                  "start: the model every device had before the federation.", "",
                  "| verifier | clients | AUC | EER | TAR@1e-2 | TAR@1e-3 |", "|---|---|---|---|---|---|"]
        for name in VERIFIERS:
            if name in stats:
                s = stats[name]
                lines.append(
                    f"| {name} | {s['clients']} | {mean_std(s, 'auc')} | {mean_std(s, 'eer')} | "
                    f"{mean_std(s, 'tar@1e-2')} | "
                    f"{mean_std(s, 'tar@1e-3')} |"
                )
    lines += _door_lines(summary["personalized"].get("doors") or {})
    lines += _device_lines(summary["personalized"])
    b = summary["bytes"]
    lines += [
        "",
        "## Cost",
        "",
        f"- bytes up (device -> coordinator): {b['up'] / 1e6:.1f} MB in all, "
        f"{b['per_round_up_mean'] / 1e6:.1f} MB per round",
        f"- bytes down (model downloads): {b['down'] / 1e6:.1f} MB in all",
        f"- wall time: {summary['wall_seconds']:.0f} s; {_f(summary.get('round_seconds_mean'), 1)} s per round",
        "",
        "## Plots",
        "",
    ] + [f"- {k}: `{v}`" for k, v in summary["plots"].items()]
    return "\n".join(lines) + "\n"


def write_summary(summary: dict, out: Path) -> list[Path]:
    json_path, md_path = out / "summary.json", out / "summary.md"
    tmp = json_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(summary, indent=2))
    tmp.replace(json_path)
    md_path.write_text(summary_markdown(summary))
    return [json_path, md_path]


def load_summary(run_dir: Path) -> dict:
    path = Path(run_dir) / "summary.json"
    if not path.exists():
        raise FileNotFoundError(f"no summary.json in {run_dir}: has the simulation finished?")
    return read_json(path, "ffr fleet simulate", "run the simulation again, or leave this folder out")


def run_rows(run_dirs: list[Path]) -> list[dict]:
    """A row per run folder; a summary that is not one `ffr fleet simulate` wrote is named in one line."""
    rows = []
    for run_dir in run_dirs:
        try:
            rows.append(run_row(load_summary(run_dir)))
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"{Path(run_dir) / 'summary.json'} is damaged or was not written by ffr fleet simulate "
                             f"({type(exc).__name__}: {exc})") from None
    return rows


def compare(run_dirs: list[Path]) -> str:
    """`ffr fleet report`: one Markdown table, a row per run."""
    return markdown_table(run_rows(run_dirs))

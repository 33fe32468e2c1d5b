"""Identity-level partitions of a face dataset over simulated devices, deterministic from a seed.

A person lives on exactly one device (as they would in a real fleet). Schemes:
- `iid`: identities shuffled and split evenly;
- `equal`: the same number of identities per device (the remainder joins the held-out people);
- `dirichlet`: device shares drawn from one Dirichlet(alpha, ..., alpha) over devices. The design
  document's code multiplies its input alpha by 100; `alpha_x100=True` reproduces that;
- `lognormal`: identities per device proportional to LogNormal(mu, sigma) draws (HF-MAML);
- `attribute`: devices defined by rules over per-image attributes (CelebA's attribute file).
Every device gets at least one identity. A fraction of identities is kept off every device to
measure the global model on unseen people, and some devices can be held out of training.
Images within a device are split per identity by `models.faces.splits.stratified_split`.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from protocol.json_file import json_object, read_json

SCHEMES = ("iid", "dirichlet", "lognormal", "equal", "attribute")


class PartitionError(ValueError):
    """A partition that cannot be made; raised before any training starts."""


@dataclass
class Partition:
    scheme: str
    params: dict
    seed: int
    clients: list[list[str]]
    holdout_identities: list[str] = field(default_factory=list)
    heldout_clients: list[int] = field(default_factory=list)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(self), indent=1))
        return path

    @classmethod
    def load(cls, path: str | Path) -> Partition:
        """A saved partition (a run folder's, read back on resume); a damaged or foreign file is named."""
        return read_json(Path(path), "ffr fleet", "choose another --out", _checked_partition, error=PartitionError)

    def summary(self, images_per_identity: dict[str, int]) -> dict:
        rows = []
        for k, ids in enumerate(self.clients):
            rows.append({"client": k, "identities": len(ids), "images": sum(images_per_identity[i] for i in ids),
                         "held_out_of_training": k in self.heldout_clients})
        images = [r["images"] for r in rows]
        return {"scheme": self.scheme, "params": self.params, "seed": self.seed, "clients": rows,
                "n_clients": len(rows), "holdout_identities": len(self.holdout_identities),
                "holdout_images": sum(images_per_identity[i] for i in self.holdout_identities),
                "imbalance_ratio": max(images) / max(1, min(images))}


def allocate(n_items: int, shares: np.ndarray) -> np.ndarray:
    """Integer counts summing to n_items, at least 1 each, proportional to `shares` (largest remainder)."""
    k = len(shares)
    if n_items < k:
        raise PartitionError(f"cannot give each of {k} clients an identity: only {n_items} identities")
    shares = np.asarray(shares, dtype=np.float64)
    shares = shares / shares.sum() if shares.sum() > 0 else np.full(k, 1.0 / k)
    extra = (n_items - k) * shares
    counts = np.floor(extra).astype(int)
    remainder = n_items - k - counts.sum()
    counts[np.argsort(-(extra - counts), kind="stable")[:remainder]] += 1
    return counts + 1


def check_scheme(scheme: str, alpha: float = 0.5, sigma: float = 3.0) -> None:
    """A scheme's parameters that cannot work, refused in one line (callers check before writing anything)."""
    if scheme not in SCHEMES:
        raise PartitionError(f"unknown partition {scheme!r}; choose one of {', '.join(SCHEMES)}")
    if scheme == "dirichlet" and not alpha > 0:  # `not >` also refuses nan
        raise PartitionError(f"the dirichlet alpha (--alpha) must be positive, got {alpha:g}")
    if scheme == "lognormal" and not sigma >= 0:
        raise PartitionError(f"the lognormal sigma (--lognormal-sigma) must not be negative, got {sigma:g}")


def _checked_partition(raw) -> Partition:
    """partition.json's shape: Partition's fields, people as names, held-out clients among the clients."""
    def names(value) -> bool:
        return isinstance(value, list) and all(isinstance(v, str) for v in value)

    part = Partition(**json_object(raw))
    if not (isinstance(part.scheme, str) and isinstance(part.params, dict) and isinstance(part.seed, int)
            and isinstance(part.clients, list) and all(names(c) for c in part.clients)
            and names(part.holdout_identities) and isinstance(part.heldout_clients, list)
            and all(isinstance(k, int) and 0 <= k < len(part.clients) for k in part.heldout_clients)):
        raise TypeError("not a partition")
    return part


def check_rules(rules) -> None:
    """The attribute partition's rules, `[{"where": {ATTR: 1 | -1}}, ...]` one per device, refused in one line
    otherwise (they come from a user's --rules file and back from a run's config.json)."""
    def good(rule) -> bool:
        where = rule.get("where") if isinstance(rule, dict) else None
        return (isinstance(where, dict) and bool(where) and set(rule) <= {"where"}
                and all(isinstance(k, str) and v in (1, -1) and not isinstance(v, bool) for k, v in where.items()))

    if not isinstance(rules, list) or not rules:
        raise PartitionError('--rules must be a JSON list with one rule per device: [{"where": {"Male": 1}}, ...]')
    bad = next((rule for rule in rules if not good(rule)), None)
    if bad is not None:
        raise PartitionError(f'--rules: {json.dumps(bad)[:80]} is not a rule; each is {{"where": {{ATTR: 1 or -1}}}}')


def client_shares(scheme: str, n_clients: int, rng: np.random.Generator, alpha: float = 0.5,
                  alpha_x100: bool = False, mu: float = 3.0, sigma: float = 3.0) -> np.ndarray:
    check_scheme(scheme, alpha, sigma)
    if scheme in ("iid", "equal"):
        return np.full(n_clients, 1.0 / n_clients)
    if scheme == "dirichlet":
        return rng.dirichlet(np.full(n_clients, alpha * 100.0 if alpha_x100 else alpha))
    if scheme == "lognormal":
        draws = rng.lognormal(mu, sigma, n_clients)
        return draws / draws.sum()
    raise PartitionError(f"unknown partition {scheme!r}; choose one of {', '.join(SCHEMES)}")


def partition(
    identities: list[str],
    n_clients: int,
    scheme: str = "iid",
    seed: int = 0,
    holdout_fraction: float = 0.1,
    heldout_clients: int = 0,
    alpha: float = 0.5,
    alpha_x100: bool = False,
    mu: float = 3.0,
    sigma: float = 3.0,
    identity_attributes: dict[str, dict[str, int]] | None = None,
    rules: list[dict] | None = None,
) -> Partition:
    """Split `identities` over `n_clients`; see the module docstring for the schemes."""
    if n_clients < 1:
        raise PartitionError("need at least one client")
    if heldout_clients >= n_clients:
        raise PartitionError(f"{heldout_clients} held-out clients leave none of {n_clients} to train")
    rng = np.random.default_rng(seed)
    order = [identities[i] for i in rng.permutation(len(identities))]
    n_hold = int(round(len(order) * holdout_fraction))
    holdout, pool = order[:n_hold], order[n_hold:]
    params = {"n_clients": n_clients, "holdout_fraction": holdout_fraction}
    if scheme == "attribute":
        clients = _by_attributes(pool, identity_attributes, rules)
        params["rules"] = rules
    else:
        if scheme == "equal":
            per = len(pool) // n_clients
            if per == 0:
                raise PartitionError(
                    f"cannot give each of {n_clients} clients an identity: only {len(pool)} identities"
                )
            holdout, pool = holdout + pool[per * n_clients:], pool[:per * n_clients]
        shares = client_shares(scheme, n_clients, rng, alpha, alpha_x100, mu, sigma)
        counts = allocate(len(pool), shares)
        bounds = np.concatenate([[0], np.cumsum(counts)])
        clients = [sorted(pool[bounds[k]:bounds[k + 1]]) for k in range(n_clients)]
        params.update({"alpha": alpha, "alpha_x100": alpha_x100} if scheme == "dirichlet" else
                      {"mu": mu, "sigma": sigma} if scheme == "lognormal" else {})
    held = sorted(rng.choice(len(clients), heldout_clients, replace=False).tolist()) if heldout_clients else []
    return Partition(scheme, params, seed, clients, sorted(holdout), held)


def _by_attributes(
    pool: list[str], attributes: dict[str, dict[str, int]] | None, rules: list[dict] | None
) -> list[list[str]]:
    """Each identity goes to the first rule its (majority) attributes satisfy; unmatched ones go nowhere."""
    if not attributes:
        raise PartitionError("the attribute partition needs per-image attributes (e.g. CelebA's list_attr_celeba.txt); "
                             "this dataset has none")
    check_rules(rules)
    known = set(next(iter(attributes.values())))
    for rule in rules:
        unknown = set(rule.get("where", {})) - known
        if unknown:
            raise PartitionError(f"rule {rule} names unknown attributes {sorted(unknown)}")
    clients: list[list[str]] = [[] for _ in rules]
    for identity in pool:
        values = attributes.get(identity, {})
        for k, rule in enumerate(rules):
            if all(values.get(a) == v for a, v in rule["where"].items()):
                clients[k].append(identity)
                break
    empty = [k for k, ids in enumerate(clients) if not ids]
    if empty:
        raise PartitionError(f"no identity matches the rules of clients {empty}")
    return [sorted(ids) for ids in clients]


def read_celeba_attributes(path: Path, image_identity: dict[str, str]) -> dict[str, dict[str, int]]:
    """Per-identity attributes (+1/-1 by majority over its images) from CelebA's list_attr_celeba.txt."""
    lines = Path(path).read_text().splitlines()
    names = lines[1].split()
    sums: dict[str, np.ndarray] = {}
    for line in lines[2:]:
        parts = line.split()
        if len(parts) != len(names) + 1 or parts[0] not in image_identity:
            continue
        ident = image_identity[parts[0]]
        sums[ident] = sums.get(ident, np.zeros(len(names))) + np.array(parts[1:], dtype=float)
    return {i: {n: 1 if v >= 0 else -1 for n, v in zip(names, s)} for i, s in sums.items()}

"""A device's credential file: what the operator hands a device so it can join, out of band.

Written by `ffr coordinator admit` (mode 0600); read by `ffr edge run --credential`.
"""
from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from protocol.auth import PUBLIC_KEY_PATTERN, write_secret

CREDENTIAL_FORMAT = "ffr-edge-credential/1"


class Credential(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: str = CREDENTIAL_FORMAT
    device_id: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    token: str = Field(pattern=r"^[0-9a-f]{64}$")
    coordinator_public_key: str = Field(pattern=PUBLIC_KEY_PATTERN)
    broker: str
    broker_username: str | None = None
    broker_password: str | None = None
    ca_pem: str | None = None   # the broker's CA when it speaks TLS

    @classmethod
    def load(cls, path: Path) -> Credential:
        try:
            credential = cls.model_validate_json(Path(path).read_bytes())
        except OSError as exc:
            raise ValueError(f"cannot read the credential file {path}: {exc.strerror or exc}") from None
        except ValidationError as exc:
            raise ValueError(f"{path} is not an ffr-edge credential file (from `ffr coordinator admit`): "
                             f"{_first_problem(exc)}") from None
        except ValueError as exc:
            raise ValueError(f"{path} is not an ffr-edge credential file: {str(exc)[:120]}") from None
        if credential.format != CREDENTIAL_FORMAT:
            raise ValueError(f"{path}: unsupported credential format {credential.format!r}")
        return credential

    def save(self, path: Path) -> None:
        write_secret(Path(path), self.model_dump_json(indent=2))


def _first_problem(exc: ValidationError) -> str:
    """A pydantic refusal in a few words: the field at fault, never the input (it may hold a secret)."""
    errors = exc.errors()
    first = errors[0]
    if first["type"] == "json_invalid":
        return "not JSON"
    where = ".".join(str(part) for part in first.get("loc", ())) or "the file"
    more = f" (and {len(errors) - 1} more problem(s))" if len(errors) > 1 else ""
    return f"{where}: {first['msg'].lower()}{more}"

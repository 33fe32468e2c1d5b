"""A private certificate authority for the embedded broker (`ffr coordinator serve --tls`).

On first use it writes, in `STATE/tls/`: a CA (ECDSA P-256, 10 years) and a broker
certificate it signs for localhost and the given host names. The CA certificate travels to
devices inside their credential files, so they verify the broker without any public PKI.
Private keys are written mode 0600 and never leave the state folder.
"""
from __future__ import annotations

import datetime as dt
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from protocol.auth import write_secret


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "ffr-edge"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def ensure_broker_tls(state: Path, hosts: tuple[str, ...] = ("127.0.0.1", "localhost")) -> dict[str, Path]:
    """The CA and broker certificate files (created once); keys: ca, cert, key."""
    folder = Path(state) / "tls"
    paths = {"ca": folder / "ca.pem", "cert": folder / "broker.pem", "key": folder / "broker.key"}
    if all(p.exists() for p in paths.values()):
        return paths
    now = dt.datetime.now(dt.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(_name("ffr-edge coordinator CA"))
        .issuer_name(_name("ffr-edge coordinator CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=3650))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )
    names = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder().subject_name(_name("ffr-edge broker")).issuer_name(ca.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=825))
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    write_secret(folder / "ca.key", _key_pem(ca_key))
    write_secret(paths["key"], _key_pem(key))
    paths["cert"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    return paths

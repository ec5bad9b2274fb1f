"""Certificates made in the test: a CA, a server certificate for 127.0.0.1 / localhost, a client certificate, and a
client certificate from another CA (which servers requiring client certificates must refuse)."""

from __future__ import annotations

import datetime
import ipaddress
import pathlib

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


def _key():
    return ec.generate_private_key(ec.SECP256R1())


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write(path: pathlib.Path, cert, key) -> tuple[pathlib.Path, pathlib.Path]:
    path.with_suffix(".pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    path.with_suffix(".key").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                           serialization.PrivateFormat.PKCS8,
                                                           serialization.NoEncryption()))
    return path.with_suffix(".pem"), path.with_suffix(".key")


def _ca(common_name: str):
    key = _key()
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(_name(common_name)).issuer_name(_name(common_name))
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    return cert, key


def _leaf(ca, common_name: str, server: bool):
    ca_cert, ca_key = ca
    key = _key()
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(_name(common_name)).issuer_name(ca_cert.subject)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH if server
                                                     else ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False))
    if server:
        builder = builder.add_extension(x509.SubjectAlternativeName([
            x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    return builder.sign(ca_key, hashes.SHA256()), key


def make_pki(out: pathlib.Path) -> dict[str, pathlib.Path]:
    out.mkdir(parents=True, exist_ok=True)
    ca, rogue = _ca("grpo-stream test CA"), _ca("someone else's CA")
    paths = {"ca": out / "ca.pem", "rogue_ca": out / "rogue-ca.pem"}
    paths["ca"].write_bytes(ca[0].public_bytes(serialization.Encoding.PEM))
    paths["rogue_ca"].write_bytes(rogue[0].public_bytes(serialization.Encoding.PEM))
    paths["server_cert"], paths["server_key"] = _write(out / "server", *_leaf(ca, "trainer", server=True))
    paths["client_cert"], paths["client_key"] = _write(out / "client", *_leaf(ca, "sampler-0", server=False))
    paths["rogue_cert"], paths["rogue_key"] = _write(out / "rogue", *_leaf(rogue, "intruder", server=False))
    return paths
